"""``dhelix::exchange``: send a tensor to one peer and receive one of its shape from another, in one op.

The per-peer decomposition (``graph_passes.decompose``) emits it by name
(``torch.ops.dhelix.exchange.default``); importing ``dhelix_compile`` registers it. Functional
and asynchronous like torch's functional collectives: it returns ``[send_done, received]``, each
completed with ``_c10d_functional.wait_tensor``.

Why not torch's ``_c10d_functional.batch_p2p_ops``: it registers the *send input* in the
functional-collective work registry (keyed by its storage) and that entry is never cleared by waiting the op's outputs
(checked on gloo, torch 2.13: ``_get_work_registry_size()`` stays one higher, and waiting the
send input blocks). Inductor reuses storage freely, so a later receive buffer that reuses a sent
tensor's storage finds the stale entry, and its ``wait_tensor`` blocks forever (seen as a hang
in a TP+SP backward graph; gone with ``allow_buffer_reuse=False``). ``dhelix::exchange`` sends
a private copy of its input and receives into a tensor it allocates, and registers exactly its two
outputs, so nothing Inductor manages is ever registered.

How it is sent depends on the backend:

- **gloo**: one ``all_to_all_single`` over the group whose only non-empty splits are the
  payload to ``to_peer`` and the tensor from ``from_peer``, which gloo sends on its own worker
  threads, as every collective. On the 1 Gbit/s emulated link (2 ranks, 2026-11-25,
  ``BENCHMARKS.md``) an exchange costs the calling thread, the link and the CPU in all the same as
  an isend/irecv pair (0.5-0.7 ms to issue 0.5-2 MiB, most of it the payload's copy); what the
  collective form adds is that an exchange is checked like any collective: it must be called by
  every rank of the group in the same order, which the decompose pass's exchanges are (each rank
  runs the same per-peer steps), and the compile-time rank-consistency check compares them with
  the collectives, where a mismatched pair of P2P sends would only hang.
- **NCCL and others**: ``batch_isend_irecv`` of the pair, so two ranks sending to each other
  first cannot deadlock.
"""

from __future__ import annotations

from typing import Any

import torch

from dhelix_compile import _torch_compat as compat

_IN_FLIGHT_SENDS: list[tuple[Any, torch.Tensor]] = []  # (work, payload) kept alive until done


@torch.library.custom_op("dhelix::exchange", mutates_args=())
def p2p_exchange(send: torch.Tensor, to_peer: int, from_peer: int, tag: int, group_name: str) -> list[torch.Tensor]:
    """Send ``send`` to group rank ``to_peer`` and receive a tensor of its shape from ``from_peer``.

    Asynchronous: returns ``[send_done, received]``; complete each with
    ``_c10d_functional.wait_tensor`` (``send_done`` is an empty placeholder). Works on gloo (as
    an all-to-all on gloo's threads) and NCCL (``batch_isend_irecv``); see the module docstring.
    """
    import torch.distributed as dist

    group = compat.resolve_group(group_name)
    backend = dist.get_backend(group)
    if backend == "fake":  # nothing is sent; its works never complete
        return [send.new_empty(0), torch.empty_like(send, memory_format=torch.contiguous_format)]
    payload = send.clone(memory_format=torch.contiguous_format)  # ours until the send completes: one copy
    received = torch.empty_like(payload)
    if backend == "gloo":
        send_work = recv_work = _all_to_all_exchange(payload, received, to_peer, from_peer, group)
    else:
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, payload, group=group, group_peer=to_peer, tag=tag),
                dist.P2POp(dist.irecv, received, group=group, group_peer=from_peer, tag=tag),
            ]
        )
        send_work, recv_work = (works[0], works[-1]) if works else (None, None)
    done = send.new_empty(0)
    if send_work is not None:
        compat.register_work(done, send_work)
        compat.register_work(received, recv_work)
        _IN_FLIGHT_SENDS[:] = [(w, t) for w, t in _IN_FLIGHT_SENDS if not w.is_completed()]
        _IN_FLIGHT_SENDS.append((send_work, payload))
    return [done, received]


def _all_to_all_exchange(
    payload: torch.Tensor, received: torch.Tensor, to_peer: int, from_peer: int, group: Any
) -> Any:
    """The exchange as one asynchronous ``all_to_all_single`` (gloo; see the module docstring):
    every split empty but ``payload`` to ``to_peer`` and ``received`` from ``from_peer``."""
    import torch.distributed as dist

    ranks = dist.get_world_size(group)
    send_splits = [0] * ranks
    send_splits[to_peer] = payload.numel()
    receive_splits = [0] * ranks
    receive_splits[from_peer] = received.numel()
    return dist.all_to_all_single(
        received.view(-1), payload.view(-1), receive_splits, send_splits, group=group, async_op=True
    )


@p2p_exchange.register_fake
def _p2p_exchange_fake(
    send: torch.Tensor, to_peer: int, from_peer: int, tag: int, group_name: str
) -> list[torch.Tensor]:
    return [send.new_empty(0), torch.empty_like(send, memory_format=torch.contiguous_format)]


#: The op the decompose pass emits (``torch.ops.dhelix.exchange.default``).
P2P_EXCHANGE = torch.ops.dhelix.exchange.default
