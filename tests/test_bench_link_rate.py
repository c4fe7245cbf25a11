"""``--rate auto``: the link rate at which a step's collectives alone take its compute time."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

import pytest

from dhelix_compile.bench import link_rate, run
from dhelix_compile.bench.link_rate import calibrated, format_rate, next_rate, parse_rate


@pytest.mark.parametrize(
    ("text", "bits"),
    [("1gbit", 1e9), ("400mbit", 400e6), ("800kbit", 800e3), ("1000000bit", 1e6), ("1.5Gbit", 1.5e9), (" 7mbit ", 7e6)],
)
def test_tc_rates_parse_to_bits_per_second(text: str, bits: float) -> None:
    assert parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize("text", ["fast", "400", "400mb", "mbit", "-3mbit", ""])
def test_what_is_not_a_rate_is_named(text: str) -> None:
    with pytest.raises(ValueError, match="not a link rate"):
        parse_rate(text)


def test_rates_format_as_whole_mbit_that_parse_back() -> None:
    assert format_rate(1.2346e9) == "1235mbit"
    assert format_rate(3e3) == "1mbit"  # never 0mbit, which tc rejects
    assert parse_rate(format_rate(560e6)) == 560e6


def test_the_next_rate_scales_by_t_comm_over_t_compute_within_bounds() -> None:
    assert next_rate([(1e9, 0.2)], 0.1) == pytest.approx(2e9)  # communication twice the compute: twice the rate
    assert next_rate([(1e9, 0.05)], 0.1) == pytest.approx(0.5e9)
    assert next_rate([(1e9, 1e6)], 0.1) == link_rate.MAX_RATE and next_rate([(1e9, 1e-9)], 0.1) == link_rate.MIN_RATE
    with pytest.raises(ValueError, match="positive"):
        next_rate([(1e9, 0.0)], 0.1)
    assert calibrated(0.105, 0.100) and not calibrated(0.120, 0.100)


def test_once_two_rates_bracket_t_compute_the_next_is_interpolated_inside() -> None:
    """T_comm = c / rate**2 between the two: the power law through them finds the rate exactly;
    an erratic link (slower at the higher rate) still keeps the next rate inside the bracket."""
    probes = [(1e9, 0.4), (4e9, 0.025)]  # 0.4 * (1e9 / r)**2 = 0.1 at r = 2e9
    assert next_rate(probes, 0.1) == pytest.approx(2e9)
    erratic = [(1e9, 1.6), (3.4e9, 0.31), (2.2e9, 0.61)]  # the data-parallel step, 2026-11-27
    assert 2.2e9 < next_rate(erratic, 0.48) < 3.4e9
    assert link_rate.best_rate(erratic, 0.48) == 2.2e9  # 0.61 / 0.48 = 1.27 is closer by ratio than 0.48 / 0.31 = 1.55


def _modelled_link(fixed_s: float, megabits: float, launched: list[str]) -> Any:
    """A stand-in for ``run._launch`` in comm mode: T_comm = a fixed cost + the step's bits over
    75% of the rate (TCP through tbf), as measured on this project's link."""

    def launch(out: Path, mode: str, link: Any, args: argparse.Namespace, extra: Any = ()) -> tuple[dict, Any]:
        assert mode == "comm" and args.repeats == 3 and link.rate is not None
        launched.append(link.rate)
        t_comm = fixed_s + megabits * 1e6 / (0.75 * parse_rate(link.rate))
        return {"t_comm_s": [t_comm, t_comm * 1.01, t_comm * 0.99]}, None

    return launch


@pytest.mark.parametrize(("fixed_s", "megabits", "t_compute_s"), [(0.004, 120.0, 0.150), (0.030, 60.0, 0.300)])
def test_auto_finds_the_rate_where_t_comm_takes_t_compute(
    monkeypatch: Any, tmp_path: Path, fixed_s: float, megabits: float, t_compute_s: float
) -> None:
    launched: list[str] = []
    monkeypatch.setattr(run, "_launch", _modelled_link(fixed_s, megabits, launched))
    monkeypatch.setattr(run, "can_rate_limit", lambda: (True, ""))
    rate, probes = run._calibrate_rate(argparse.Namespace(repeats=12), t_compute_s, tmp_path)
    assert launched[0] == link_rate.PROBE_RATE and [p["rate"] for p in probes] == launched
    assert rate is not None and len(probes) <= link_rate.MAX_PROBES
    assert rate == probes[-1]["rate"]  # converged: the last rate timed is the one the run uses
    t_comm = fixed_s + megabits * 1e6 / (0.75 * parse_rate(rate))
    assert t_comm == pytest.approx(t_compute_s, rel=link_rate.TOLERANCE)


def test_auto_settles_on_the_closest_timed_rate_when_none_converges(monkeypatch: Any, tmp_path: Path) -> None:
    """A link whose T_comm jumps between two values, neither near T_compute: after MAX_PROBES
    rates, the run takes the timed rate closest to T_compute, not an untimed guess."""
    times = iter([0.9, 0.03, 0.9, 0.03])

    def erratic(out: Path, mode: str, link: Any, args: argparse.Namespace, extra: Any = ()) -> tuple[dict, Any]:
        return {"t_comm_s": [next(times)] * 3}, None

    monkeypatch.setattr(run, "_launch", erratic)
    monkeypatch.setattr(run, "can_rate_limit", lambda: (True, ""))
    rate, probes = run._calibrate_rate(argparse.Namespace(repeats=6), 0.1, tmp_path)
    assert len(probes) == link_rate.MAX_PROBES
    closest = min(probes, key=lambda p: abs(math.log(p["t_comm_s"] / 0.1)))
    assert rate == closest["rate"]


def test_auto_without_a_rate_limited_link_is_loopback(monkeypatch: Any, tmp_path: Path) -> None:
    monkeypatch.setattr(run, "can_rate_limit", lambda: (False, "not root"))
    monkeypatch.setattr(run, "_launch", lambda *a, **k: pytest.fail("nothing to time on loopback"))
    assert run._calibrate_rate(argparse.Namespace(repeats=3), 0.1, tmp_path) == (None, [])


def test_the_table_says_which_rates_auto_timed() -> None:
    summary = {
        "rate": "840mbit",
        "rate_probes": [{"rate": "1gbit", "t_comm_s": 0.126}, {"rate": "840mbit", "t_comm_s": 0.149}],
    }
    assert run.rate_probes_line(summary) == [
        "rate auto: 840mbit, where T_comm takes about T_compute (the collectives alone: 126.0 ms at 1gbit, "
        "149.0 ms at 840mbit)"
    ]
    assert run.rate_probes_line({"rate": "1gbit", "rate_probes": []}) == []


def test_a_bad_rate_is_named(capsys: Any) -> None:
    assert run.main(["--rate", "fast"]) == 2
    assert "--rate: not a link rate: 'fast'" in capsys.readouterr().err


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.skipif(not run.can_rate_limit()[0], reason="needs root, ip and tc for a rate-limited link")
@pytest.mark.full
def test_auto_calibrates_on_a_real_link(tmp_path: Path) -> None:
    """The worker's comm mode on a real rate-limited link: the chosen rate gives T_comm near T_compute."""
    args = run.parse_args(["--model", "tiny", "--variants", "inductor", "--timeout-s", "240"])
    rate, probes = run._calibrate_rate(args, 0.050, tmp_path)
    assert rate is not None and probes and all(p["t_comm_s"] > 0 for p in probes)


def test_the_run_on_the_fake_group_compiles_into_caches_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step the link run times finds in Inductor's caches what the user's held, not what
    the run on the fake group compiled just before: that run gets a cache folder of its own."""
    launched: list[dict[str, Any]] = []

    class Stop(Exception):
        pass

    def launch(argv: Any, world_size: int, link: Any, *, timeout_s: float, env: Any = None) -> Any:
        launched.append(dict(env or {}))
        raise Stop

    monkeypatch.setattr(run, "launch_ranks", launch)
    args = run.parse_args(["--model", "tiny", "--variants", "inductor", "--rate", "none"])
    with pytest.raises(Stop):
        run.measure(args)
    own = launched[0].get("TORCHINDUCTOR_CACHE_DIR")
    assert own is not None and own != os.environ.get("TORCHINDUCTOR_CACHE_DIR")
