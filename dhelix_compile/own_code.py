"""Frames of their own for Dynamo: ``with_own_code`` and ``in_own_frame``.

Dynamo caches compiled code, and counts recompiles against ``recompile_limit``, per code object.
Two callers compiling the same method share that cache: ``helix`` steps over different models
would exhaust the limit (``fullgraph=True`` turns that into an error), and a cache entry that one
caller left (a model wrapped by FSDP2, whose forward graph-breaks at once, has guards that let
any model of the class through) sends the other caller's model through it, broken into pieces.
A method with its own code object starts with its own cache.

Dynamo also decides by a frame's file whether to compile it: it skips the frames of torch's own
files (its skipfiles), the forwards of ``torch.nn``'s modules among them, and starts a graph at
the first frame it does not skip. ``nn.Sequential(...).compile(fullgraph=True)`` therefore
raises "found no compiled frames" on its first call: ``Module.compile`` compiles the module's
``_call_impl``, and every frame under it is torch's. ``torch.compile(module)`` puts a frame of
its own around such a module (``wrap_inline``); ``in_own_frame`` does the same for a callable,
with a fresh code object: Dynamo compiles that frame and inlines the callable into its graph.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])
_R = TypeVar("_R")
_ids = itertools.count()


def with_own_code(method: _F, name: str | None = None) -> _F:
    """``method`` (a bound method written in Python) with a fresh code object named ``name``
    (default: its own name), numbered so that every call gives another."""
    assert isinstance(method, types.MethodType), f"a bound method, got {type(method).__name__}"
    function = method.__func__
    assert isinstance(function, types.FunctionType), "a method written in Python"
    code = function.__code__.replace(co_name=f"{name or function.__name__}_{next(_ids)}")
    fresh = types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)
    return types.MethodType(fresh, method.__self__)  # type: ignore[return-value]


def in_own_frame(fn: Callable[..., _R], name: str) -> Callable[..., _R]:
    """A function that returns ``fn(*args, **kwargs)``, written in this file, with a fresh code
    object named ``name`` (numbered as by ``with_own_code``): Dynamo compiles its frame even where
    ``fn``'s own code is in its skipfiles (module docstring)."""

    def call(*args: Any, **kwargs: Any) -> _R:
        return fn(*args, **kwargs)

    code = call.__code__.replace(co_name=f"{name}_{next(_ids)}")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)
