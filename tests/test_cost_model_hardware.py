"""Hardware tables: datasheet entries, registries, user files, the measured CPU."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from cost_model import hardware
from cost_model.hardware import (
    DEVICES,
    LINKS,
    Device,
    Link,
    UnknownHardwareError,
    get_device,
    get_link,
    load_hardware_file,
    measure_cpu_device,
    register_device,
    register_link,
)

aten = torch.ops.aten


def test_datasheet_numbers() -> None:
    h100 = get_device("h100_sxm")
    assert h100.peak_flops_per_s[torch.bfloat16] == pytest.approx(989.5e12)
    assert h100.mem_bandwidth_bytes_per_s == pytest.approx(3.35e12)
    assert get_device("h200").mem_bandwidth_bytes_per_s == pytest.approx(4.8e12)
    assert get_device("a100_80gb").peak_flops_per_s[torch.float16] == pytest.approx(312e12)
    assert get_device("a40").mem_bandwidth_bytes_per_s == pytest.approx(696e9)
    assert get_link("nvlink4").bandwidth_bytes_per_s == pytest.approx(450e9)
    assert get_link("nvlink3").bandwidth_bytes_per_s == pytest.approx(300e9)
    assert get_link("ib_ndr").bandwidth_bytes_per_s == pytest.approx(50e9)
    assert get_link("eth_25g").bandwidth_bytes_per_s == pytest.approx(3.125e9)


def test_every_entry_has_a_source_and_sane_numbers() -> None:
    required_devices = {"h100_sxm", "h200", "a100_80gb", "a800", "a40"}
    required_links = {"nvlink3", "nvlink4", "pcie4", "pcie5", "ib_hdr", "ib_ndr", "eth_25g", "eth_100g", "loopback"}
    assert required_devices <= set(DEVICES)
    assert required_links <= set(LINKS)
    for dev in DEVICES.values():
        assert dev.source
        assert dev.contention_factor >= 1.0
        # bf16 tensor cores beat fp32 on every GPU in the table
        if dev.name in required_devices:
            assert dev.flops_per_s(torch.bfloat16) > dev.flops_per_s(torch.float32)
            assert dev.contention_factor == pytest.approx(1.1)
    for link in LINKS.values():
        assert link.source and link.latency_s > 0


def test_aliases_and_unknown_names() -> None:
    assert get_device("H100") is DEVICES["h100_sxm"]
    with pytest.raises(UnknownHardwareError, match=r"valid devices: .*h100_sxm"):
        get_device("tpu_v5")
    with pytest.raises(KeyError, match=r"valid links: .*nvlink4"):
        get_link("carrier_pigeon")


def test_register_user_entries() -> None:
    dev = Device("test_gpu", {torch.bfloat16: 1e15}, 2e12, 3e-6, "unit test")
    try:
        register_device(dev)
        assert get_device("test_gpu") is dev
        # unknown dtypes fall back to the slowest entry present
        assert dev.flops_per_s(torch.float64) == 1e15
        with pytest.raises(ValueError, match="already registered"):
            register_device(Device("test_gpu", {torch.bfloat16: 2e15}, 2e12, 3e-6, "other"))
        link = register_link(Link("test_link", 1e9, 1e-5, "unit test"))
        assert get_link("test_link") is link
    finally:
        DEVICES.pop("test_gpu", None)
        LINKS.pop("test_link", None)


def test_device_is_frozen_and_validated() -> None:
    dev = get_device("a40")
    with pytest.raises(TypeError):
        dev.peak_flops_per_s[torch.float32] = 1.0  # type: ignore[index]  # writing the read-only mapping on purpose
    with pytest.raises(ValueError, match="contention_factor"):
        Device("bad", {torch.float32: 1.0}, 1.0, 0.0, "x", contention_factor=0.5)
    assert dev.replace(contention_factor=1.3).contention_factor == 1.3


def test_load_hardware_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "hw.json"
    path.write_text(
        json.dumps(
            {
                "devices": [
                    {
                        "name": "file_gpu",
                        "peak_flops_per_s": {"bfloat16": 4e14, "float32": 5e13},
                        "mem_bandwidth_bytes_per_s": 1.5e12,
                        "source": "vendor",
                    }
                ],
                "links": [{"name": "file_link", "bandwidth_bytes_per_s": 5e10, "latency_s": 5e-6}],
            }
        )
    )
    toml = tmp_path / "hw.toml"
    toml.write_text('[[links]]\nname = "toml_link"\nbandwidth_bytes_per_s = 1e9\nlatency_s = 1e-6\n')
    try:
        load_hardware_file(path)
        load_hardware_file(toml)
        assert get_device("file_gpu").flops_per_s(torch.bfloat16) == 4e14
        assert get_link("file_link").latency_s == 5e-6
        assert get_link("toml_link").bandwidth_bytes_per_s == 1e9
    finally:
        DEVICES.pop("file_gpu", None)
        LINKS.pop("file_link", None)
        LINKS.pop("toml_link", None)


def test_measured_cpu_device_is_cached() -> None:
    cpu = measure_cpu_device()
    assert cpu is measure_cpu_device()
    assert cpu.flops_per_s(torch.float32) > 1e7
    assert cpu.mem_bandwidth_bytes_per_s > 1e7
    assert 0 < cpu.launch_overhead_s < 1e-2
    assert cpu.contention_factor >= 1.0
    assert "measured" in cpu.source
    assert get_device("cpu").peak_flops_per_s == cpu.peak_flops_per_s
    assert hardware.DEVICES["cpu"].name == "cpu"
