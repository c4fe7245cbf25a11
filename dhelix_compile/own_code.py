"""``with_own_code``: a bound method whose function has a code object of its own.

Dynamo caches compiled code, and counts recompiles against ``recompile_limit``, per code object.
Two callers compiling the same method share that cache: ``helix`` steps over different models
would exhaust the limit (``fullgraph=True`` turns that into an error), and a cache entry that one
caller left (a model wrapped by FSDP2, whose forward graph-breaks at once, has guards that let
any model of the class through) sends the other caller's model through it, broken into pieces.
A method with its own code object starts with its own cache.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])
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
