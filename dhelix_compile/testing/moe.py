"""A capacity-bounded mixture-of-experts layer: single-process reference and expert parallel.

Contract
--------
* Routing (GShard/Switch style): softmax router over ``n_experts``; each token picks its
  ``top_k`` experts (gate = the probability for top-1, the renormalised top-2 probabilities for
  top-2). Each expert takes at most ``capacity = ceil(capacity_factor * T * top_k / E)`` tokens
  per dispatch group of ``T`` tokens, first choices before second choices, earlier tokens first;
  the rest are dropped (contribute zero). Every shape depends only on ``T`` and the config, never
  on the routing, so the layer is a static-shape graph for ``torch.compile``.
* ``ReferenceMoE.forward(x[G, T, D]) -> [G, T, D]``: G independent dispatch groups on one
  process (capacity applies per group).
* ``ExpertParallelMoE.from_reference(ref, group)``: on rank r of a group of size W (W divides E),
  experts ``[r*E/W, (r+1)*E/W)``; ``forward(x_local[T, D]) -> [T, D]`` where ``x_local`` is
  dispatch group r. It equals ``ReferenceMoE.forward(x)[r]`` for ``x[W, T, D]``::

      route -> dispatch[E, C, D] (expert-major: rank s's experts are rows s*E/W*C ...)
            -> all_to_all_single(splits [E/W*C]*W)            -> [W(src), E/W, C, D]
            -> local experts on [E/W, W*C, D] (batched bmm)   -> back to [W, E/W, C, D]
            -> all_to_all_single (same static splits)         -> [E, C, D] -> combine -> [T, D]

  ``all_to_all_single`` (``torch.distributed._functional_collectives``, same op as
  ``all_to_all_single_autograd`` in torch 2.13) is differentiable: its backward is the
  all-to-all with the split sizes swapped.
* Gradient convention: rank r's loss covers its group and the ranks' losses sum to the reference
  loss. Expert weights get exact gradients; the replicated router weight gets a partial one
  (``sync_replicated_grads(model, model.replicated_parameter_names())``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from dhelix_compile.models.llama import init_weights_
from dhelix_compile.testing.sharding import copy_shards_from

__all__ = ["ExpertParallelMoE", "MoEConfig", "ReferenceMoE", "expert_ffn", "route"]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of the MoE layer; defaults are test-sized."""

    dim: int = 32
    """Token width."""
    ffn_hidden: int = 64
    """Hidden width of each SwiGLU expert."""
    n_experts: int = 4
    """Number of experts; divisible by the expert-parallel degree."""
    top_k: Literal[1, 2] = 2
    """Experts per token."""
    capacity_factor: float = 1.25
    """Slots per expert = ceil(capacity_factor * tokens * top_k / n_experts)."""
    dtype: torch.dtype = torch.float32
    """Parameter dtype."""
    seed: int = 0
    """Seed of the weight initialisation."""

    def capacity(self, n_tokens: int) -> int:
        """Slots per expert for a dispatch group of ``n_tokens`` tokens."""
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts))

    def validate(self, world_size: int = 1) -> None:
        """Raise ``ValueError`` for an unsupported config or an uneven expert split."""
        if self.top_k not in (1, 2) or self.top_k > self.n_experts:
            raise ValueError(f"MoEConfig: top_k={self.top_k} must be 1 or 2 and <= n_experts")
        if self.n_experts % world_size:
            raise ValueError(f"MoEConfig: n_experts={self.n_experts} not divisible by world_size={world_size}")


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dispatch, combine)``, each ``[..., T, E, C]``, for tokens ``x[..., T, D]``.

    ``dispatch`` is 0/1 (token t goes to slot c of expert e), ``combine`` is dispatch times the
    gate. Written with comparisons against ``arange`` rather than ``one_hot``/``scatter`` so
    that every shape is static and every op has a plain autograd formula.
    """
    n_experts = router_weight.shape[0]
    n_tokens = x.shape[-2]
    lead = x.shape[:-2]
    probs = (x.float() @ router_weight.float().t()).softmax(-1)  # [..., T, E]
    top_p, top_i = probs.topk(top_k, dim=-1)  # [..., T, k]
    gates = top_p if top_k == 1 else top_p / top_p.sum(-1, keepdim=True)
    experts = torch.arange(n_experts, device=x.device)
    choice = (top_i.unsqueeze(-1) == experts).float()  # [..., T, k, E]
    # Slot of each (token, choice) in its expert: count earlier claims, choice-major order.
    choice_major = choice.transpose(-3, -2).reshape(*lead, top_k * n_tokens, n_experts)
    claims = (choice_major.cumsum(-2) - 1.0).reshape(*lead, top_k, n_tokens, n_experts)
    pos = (claims.transpose(-3, -2) * choice).sum(-1)  # [..., T, k]
    kept = choice * (pos < capacity).unsqueeze(-1).float()  # [..., T, k, E]
    slots = torch.arange(capacity, device=x.device, dtype=pos.dtype)
    slot = (pos.clamp(max=capacity - 1).unsqueeze(-1) == slots).float()  # [..., T, k, C]
    per_choice = kept.unsqueeze(-1) * slot.unsqueeze(-2)  # [..., T, k, E, C]
    dispatch = per_choice.sum(-3)
    combine = (per_choice * gates[..., None, None]).sum(-3)
    return dispatch.to(x.dtype), combine.to(x.dtype)


def expert_ffn(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU per expert: ``x[E, N, D]``, ``w1/w3[E, D, H]``, ``w2[E, H, D]`` -> ``[E, N, D]``."""
    return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)


class ReferenceMoE(nn.Module):
    """All experts on one process; ``forward(x[G, T, D])`` routes each group independently."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        e, d, h = config.n_experts, config.dim, config.ffn_hidden
        with torch.random.fork_rng(devices=[]):
            self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, d, h))
        self.w2 = nn.Parameter(torch.empty(e, h, d))
        self.w3 = nn.Parameter(torch.empty(e, d, h))
        init_weights_(self, config.seed)
        self.to(config.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups, n_tokens, dim = x.shape
        n_experts = self.config.n_experts
        capacity = self.config.capacity(n_tokens)
        dispatch, combine = route(x, self.router.weight, self.config.top_k, capacity)
        dispatched = torch.einsum("gtec,gtd->egcd", dispatch, x)
        tokens = dispatched.reshape(n_experts, groups * capacity, dim)
        y = expert_ffn(tokens, self.w1, self.w3, self.w2)
        return torch.einsum("gtec,egcd->gtd", combine, y.view(n_experts, groups, capacity, dim))


class ExpertParallelMoE(nn.Module):
    """This rank's experts; tokens travel with two static-split ``all_to_all_single`` calls."""

    def __init__(self, config: MoEConfig, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        config.validate(self.ep)
        self.config = config
        pg = group or dist.group.WORLD
        assert pg is not None, "torch.distributed is initialized"
        self.group_name = pg.group_name
        e_local, d, h = config.n_experts // self.ep, config.dim, config.ffn_hidden
        with torch.random.fork_rng(devices=[]):
            self.router = nn.Linear(d, config.n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(e_local, d, h))
        self.w2 = nn.Parameter(torch.empty(e_local, h, d))
        self.w3 = nn.Parameter(torch.empty(e_local, d, h))
        self.to(config.dtype)

    @classmethod
    @torch.no_grad()
    def from_reference(cls, reference: ReferenceMoE, group: dist.ProcessGroup | None = None) -> ExpertParallelMoE:
        """This rank's experts and a replica of the router, copied from ``reference``."""
        model = cls(reference.config, group)
        copy_shards_from(model, reference, model.rank, model.ep)
        return model

    def shard_dims(self) -> dict[str, int | None]:
        """Experts are split on dim 0; the router is replicated."""
        return {"router.weight": None, "w1": 0, "w2": 0, "w3": 0}

    def replicated_parameter_names(self) -> list[str]:
        return ["router.weight"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_tokens, dim = x.shape
        n_experts, ep = self.config.n_experts, self.ep
        e_local = n_experts // ep
        capacity = self.config.capacity(n_tokens)
        dispatch, combine = route(x, self.router.weight, self.config.top_k, capacity)
        send = torch.einsum("tec,td->ecd", dispatch, x).reshape(n_experts * capacity, dim)
        splits = [e_local * capacity] * ep  # static: the same on every rank, every step
        recv = funcol.all_to_all_single(send, splits, splits, self.group_name)
        tokens = recv.view(ep, e_local, capacity, dim).transpose(0, 1)
        y = expert_ffn(tokens.reshape(e_local, ep * capacity, dim), self.w1, self.w3, self.w2)
        y = y.view(e_local, ep, capacity, dim).transpose(0, 1).reshape(ep * e_local * capacity, dim)
        back = funcol.all_to_all_single(y, splits, splits, self.group_name)
        return torch.einsum("tec,ecd->td", combine, back.view(n_experts, capacity, dim))
