"""Which nodes of a graph draw random numbers, and which of those advance the generator's stream.

``helix`` runs models that draw random numbers (dropout in training mode) with the random
stream of the accumulation loop through the same code generator: every forward draws what it
would draw in that loop, in micro-batch order. Two strand calls merge into one graph only when
at most one of them advances the default generator (:func:`draws_from_the_stream`): then the
merged graph consumes the stream in that strand's own order. Two forwards that both draw (the
paired schedules' F+F steps) run one after the other. A backward that replays a checkpointed
region's saved RNG state (``run_with_rng_state``, below) sets the generator to that state and
restores it afterwards: it draws the forward's numbers again and leaves the stream as it was.

Whether a call draws is decided from the op *and its arguments*:

* An op tagged ``nondeterministic_seeded`` (or one of the random ops named in
  :data:`RANDOM_OP_NAMES`) draws, unless its drop probability is a literal 0 or its ``train``
  (``training``) flag a literal ``False``: the dropouts (``p``), the fused attention kernels
  (``dropout_p``: ``_scaled_dot_product_flash_attention_for_cpu`` and its CUDA siblings are
  tagged because of it) and the RNN kernels (``dropout``). A symbolic probability draws.
* Activation checkpointing wraps each recomputed op tagged ``nondeterministic_seeded`` so that
  the recompute sees the forward's RNG state (AOTAutograd's ``functionalize_rng_ops``)::

      forward:   state, out = run_and_save_rng_state(op, *args)
      backward:  out = run_with_rng_state(state, op, *args)
      (CUDA:     out = graphsafe_run_with_rng_state(op, *args, rng_state=generator))

  A wrapper draws exactly when the op it wraps does. A checkpointed attention block wraps its
  attention kernel with ``dropout_p=0.0``: nothing random. A checkpointed ``nn.Dropout(0.1)`` in
  training mode draws: Inductor's decompositions trace it as ``inductor_random``, or, with
  Inductor's ``fallback_random``, as ``native_dropout(x, 0.1, True)`` under the wrapper.

Pseudo-code::

    draws(op, args, kwargs):
        if op is an RNG-state wrapper:
            return draws(the wrapped op, its args, its kwargs)   (not an aten op: True)
        if op is neither tagged random nor named in RANDOM_OP_NAMES: return False
        bound = args and kwargs by name, defaults filled in (no schema: return True)
        if bound's train (or training) is a literal False: return False
        probability = bound's p (a dropout), else its dropout_p or dropout
        return probability is not a literal 0   (no such argument: True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from cost_model.op_kinds import op_name

#: Random ops without the ``nondeterministic_seeded`` tag (Inductor's and the RNG prims), and the
#: random aten ops by name, for targets that carry no tags (an ``OpOverloadPacket``).
RANDOM_OP_NAMES = frozenset(
    {
        "native_dropout",
        "dropout",
        "bernoulli",
        "rand",
        "randn",
        "randint",
        "rand_like",
        "randn_like",
        "randint_like",
        "randperm",
        "normal",
        "uniform",
        "exponential",
        "multinomial",
        "inductor_random",
        "inductor_seeds",
        "philox_rand",
    }
)

#: AOTAutograd's RNG-state wrappers (see the module docstring): name -> position of the wrapped op.
RNG_STATE_WRAPPERS: Mapping[str, int] = {
    "run_and_save_rng_state": 0,
    "run_with_rng_state": 1,
    "graphsafe_run_with_rng_state": 0,
}

#: The wrappers that run their op under a saved state and set the generator back to its own state
#: afterwards (``torch._prims.rng_prims``): the stream is left as it was.
REPLAYING_WRAPPERS = frozenset({"run_with_rng_state"})

#: Arguments that make a random op deterministic when they are literal: drop probability 0 (``p``
#: of the ops named ``*dropout``; these of the attention and RNN kernels), train off.
_PROBABILITY_ARGS = ("dropout_p", "dropout")
_TRAIN_ARGS = ("train", "training")


def random_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The ops of ``gm``'s nodes that draw random numbers, qualified (``aten.native_dropout.default``;
    a wrapper as ``run_and_save_rng_state(aten.native_dropout.default)``), in graph order; empty if none."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and draws_random_numbers(node.target, node.args, node.kwargs):
            found.append(_qualified(node))
    return found


def draws_from_the_stream(gm: torch.fx.GraphModule) -> bool:
    """Whether running ``gm`` advances the default generator: a node draws random numbers, other
    than under :data:`REPLAYING_WRAPPERS` (each restores the generator's state after its op)."""
    return any(
        node.op == "call_function"
        and op_name(node) not in REPLAYING_WRAPPERS
        and draws_random_numbers(node.target, node.args, node.kwargs)
        for node in gm.graph.nodes
    )


def draws_random_numbers(target: object, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether calling ``target(*args, **kwargs)`` draws random numbers (the module docstring's rule)."""
    name = op_name(target)
    if name in RNG_STATE_WRAPPERS:
        position = RNG_STATE_WRAPPERS[name]
        wrapped = args[position]
        if not isinstance(wrapped, torch._ops.OpOverload):
            return True  # AOTAutograd wraps aten ops; anything else we cannot read: assume it draws
        inner_kwargs = {k: v for k, v in kwargs.items() if k != "rng_state"}
        return draws_random_numbers(wrapped, args[position + 1 :], inner_kwargs)
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags and name not in RANDOM_OP_NAMES:
        return False
    bound = _bound_arguments(target, args, kwargs)
    if bound is None:
        return True  # arguments we cannot read: assume the op draws
    if any(bound.get(flag) is False for flag in _TRAIN_ARGS):
        return False
    probability_args = ("p",) if name.endswith("dropout") else _PROBABILITY_ARGS
    for arg in probability_args:
        if arg in bound:
            return not _literal_zero(bound[arg])
    return True


def _bound_arguments(target: object, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """``args`` and ``kwargs`` by argument name, defaults filled in; None for a target without a schema."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    normalized = normalize_function(target, tuple(args), dict(kwargs), normalize_to_only_use_kwargs=True)
    return None if normalized is None else dict(normalized.kwargs)


def _literal_zero(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _qualified(node: torch.fx.Node) -> str:
    name = op_name(node)
    if name in RNG_STATE_WRAPPERS:
        return f"{name}({op_name(node.args[RNG_STATE_WRAPPERS[name]], qualified=True)})"
    return op_name(node, qualified=True)
