"""Stage transfers: some inputs and outputs of a ``PipelineStage`` moved by dhelix's point-to-point ops.

Contract
    :class:`StageTransfers` installs, on one stage object, the caller's sends and receives for
    the outputs, inputs and gradients it names (by position), and torch's for the others: the
    stage's send and receive ops for the runtime's ``SEND_F``, ``RECV_F``, ``SEND_B`` and
    ``RECV_B`` steps, and the retrieval of received activations and gradients, where the
    received pieces are written into torch's buffers first. What a stage on the same rank hands
    over (V-schedules) is converted on the way. ``pipeline_runtime.boundaries`` decides what
    moves how; every private name of ``PipelineStage`` is reached through
    ``dhelix_compile._torch_compat``.

Pseudo-code::

    send ops(mb)    = caller's sends of the named outputs + torch's sends of the rest
    recv ops(mb)    = caller's receives of the named inputs + torch's receives of the rest
    received(mb)    = caller's pieces written into torch's buffers; then torch's retrieval
    local input(mb) = the named outputs of the stage before, converted; then torch's
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from dhelix_compile import _torch_compat as compat

#: ``(micro-batch, tensor) -> P2P ops``: the sends of one output (or one input's gradient).
SendOps = Callable[[int, Any], list[Any]]


class Receiving(Protocol):
    """The receives of one input (or one output's gradient): posted at its receive step, written
    into the stage's buffer of that micro-batch before the stage reads it."""

    def ops(self, microbatch: int) -> list[Any]: ...

    def fill(self, microbatch: int, buffer: torch.Tensor) -> None: ...


class StageTransfers:
    """Some inputs and outputs of a ``PipelineStage`` moved by the caller's point-to-point ops
    instead of torch's (each rank's local tile to the rank of the next stage at the same pipeline
    position); the others keep torch's. Indices are the stage's output or input positions.

    Installed on the stage object: its send and receive ops for the runtime's ``SEND_F``,
    ``RECV_F``, ``SEND_B`` and ``RECV_B`` steps, and the retrieval of received activations and
    gradients (where the received pieces are written into torch's buffers first). ``local_inputs``
    converts what a stage on the same rank hands over (V-schedules), ``local_output_grads`` the
    gradients handed back to it.
    """

    def __init__(self, stage: Any) -> None:
        self.stage = stage

    def install(
        self,
        *,
        send_outputs: dict[int, SendOps],
        recv_inputs: dict[int, Receiving],
        send_input_grads: dict[int, SendOps],
        recv_output_grads: dict[int, Receiving],
        local_inputs: dict[int, Callable[[Any], Any]],
        local_output_grads: dict[int, Callable[[Any], Any]],
    ) -> None:
        stage = self.stage
        get_fwd_send_ops, get_bwd_send_ops = stage.get_fwd_send_ops, stage.get_bwd_send_ops
        retrieve_activations, retrieve_grads = compat.stage_retrievals(stage)
        set_local_fwd_input, set_local_bwd_input = stage.set_local_fwd_input, stage.set_local_bwd_input

        def fwd_send_ops(mb: int) -> list[Any]:
            outputs = stage.fwd_cache[mb][0]
            ops = [op for idx, send in send_outputs.items() for op in send(mb, outputs[idx])]
            torch_sends = stage.act_send_info
            stage.act_send_info = {i: [None] if i in send_outputs else d for i, d in torch_sends.items()}
            try:
                return ops + get_fwd_send_ops(mb)
            finally:
                stage.act_send_info = torch_sends

        def bwd_send_ops(mb: int) -> list[Any]:
            if not stage.has_backward or stage.is_first:
                return []
            grads = stage.bwd_cache[mb]
            ops = [op for idx, send in send_input_grads.items() for op in send(mb, grads[idx])]
            torch_sends = compat.stage_grad_send_info(stage)
            stage.grad_send_info = [None if i in send_input_grads else d for i, d in enumerate(torch_sends)]
            stage.bwd_cache[mb] = tuple(None if i in send_input_grads else g for i, g in enumerate(grads))
            try:
                return ops + get_bwd_send_ops(mb)
            finally:
                stage.grad_send_info = torch_sends

        def recv_ops(infos: tuple[Any, ...], mb: int, receiving: dict[int, Receiving]) -> list[Any]:
            ops = [op for receive in receiving.values() for op in receive.ops(mb)]
            return ops + compat.stage_recv_ops(stage, tuple(info for i, info in enumerate(infos) if i not in receiving))

        def fwd_recv_ops(mb: int) -> list[Any]:
            return recv_ops(stage.args_recv_info[mb], mb, recv_inputs)

        def bwd_recv_ops(mb: int) -> list[Any]:
            if not stage.has_backward or stage.is_last:
                return []
            return recv_ops(stage.grad_recv_info[mb], mb, recv_output_grads)

        def activations(mb: int) -> Any:
            for idx, receive in recv_inputs.items():
                receive.fill(mb, stage.args_recv_info[mb][idx].buffer)
            return retrieve_activations(mb)

        def grads(mb: int) -> Any:
            for idx, receive in recv_output_grads.items():
                receive.fill(mb, stage.grad_recv_info[mb][idx].buffer)
            return retrieve_grads(mb)

        def local_fwd_input(outputs: Any, mb: int) -> None:
            if isinstance(outputs, tuple | list):
                outputs = tuple(local_inputs[i](o) if i in local_inputs else o for i, o in enumerate(outputs))
            elif 0 in local_inputs:
                outputs = local_inputs[0](outputs)
            set_local_fwd_input(outputs, mb)

        def local_bwd_input(next_grads: tuple[Any, ...], mb: int) -> None:
            converted = tuple(
                local_output_grads[i](g) if i in local_output_grads and g is not None else g
                for i, g in enumerate(next_grads)
            )
            set_local_bwd_input(converted, mb)

        stage.get_fwd_send_ops, stage.get_bwd_send_ops = fwd_send_ops, bwd_send_ops
        stage.get_fwd_recv_ops, stage.get_bwd_recv_ops = fwd_recv_ops, bwd_recv_ops
        compat.set_stage_retrievals(stage, activations, grads)
        stage.set_local_fwd_input, stage.set_local_bwd_input = local_fwd_input, local_bwd_input
