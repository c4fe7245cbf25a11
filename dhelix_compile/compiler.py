"""The backend entry points Dynamo calls.

Two ways in, one path::

    torch.compile(m, backend="dhelix", options={...})   # entry point torch_dynamo_backends
        └─► dhelix_backend(gm, example_inputs, options={...}, mode=None)

    torch.compile(m, backend=dhelix_compile.backend(dump_dir="d"))
        └─► backend(**options) validates now, returns a configured dhelix_backend

Both build a :class:`DHelixConfig` (defaults < ``DHELIX_*`` env vars < options), check pass
names, and call :func:`dhelix_compile.capture.capture`. Options are read here, before any
AOTAutograd helper sees the call (torch's ``aot_autograd`` helper drops extra kwargs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.fx

from cost_model import DEVICES, LINKS
from dhelix_compile.capture import capture
from dhelix_compile.config import ConfigError, DHelixConfig
from graph_passes import UnknownPassError, check_pass_names


def resolve_config(options: Mapping[str, Any] | DHelixConfig | None) -> DHelixConfig:
    """Options (or a ready config) -> a validated config whose pass names exist."""
    config = options if isinstance(options, DHelixConfig) else DHelixConfig.from_options(options)
    try:
        check_pass_names(config.disable_passes)
    except UnknownPassError as exc:
        raise ConfigError(str(exc)) from None
    if config.device not in ("auto", "cpu") and config.device.lower() not in DEVICES:
        raise ConfigError(
            f"dhelix option device={config.device!r}: choose 'auto' or one of {', '.join(['cpu', *DEVICES])}"
        )
    if config.link != "auto" and config.link.lower() not in LINKS:
        raise ConfigError(f"dhelix option link={config.link!r}: choose 'auto' or one of {', '.join(LINKS)}")
    return config


def dhelix_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | DHelixConfig | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The ``torch.compile`` backend named ``"dhelix"``.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs.
        options: ``torch.compile(..., options=)``; keys are :class:`DHelixConfig` fields.
        mode: ``torch.compile(..., mode=)``; its Inductor settings apply to dhelix's codegen.
    """
    return capture(gm, example_inputs, resolve_config(options), mode=mode)


def backend(**options: Any) -> Callable[..., Any]:
    """A configured dhelix backend: ``torch.compile(m, backend=dhelix_compile.backend(**options))``.

    Options are validated now, so a typo fails at the call, not at the first forward.
    """
    config = resolve_config(options)

    @functools.wraps(dhelix_backend)
    def configured(
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        options: Mapping[str, Any] | None = None,
        mode: str | None = None,
    ) -> Callable[..., Any]:
        merged = config.patch(**options) if options else config
        return dhelix_backend(gm, example_inputs, options=merged, mode=mode)

    configured.__name__ = "dhelix"
    return configured
