"""The pipeline step loop: FORWARD and FULL_BACKWARD of a ``_PipelineScheduleRuntime``, as its own loop runs them.

Contract
    torch's runtime runs a per-rank list of actions, and ``register_custom_function`` replaces
    one computation type's step, but its default steps live in a closure of
    ``_step_microbatches`` that a custom function cannot call. :class:`PipelineSteps` does what
    that closure does for FORWARD and FULL_BACKWARD: wait for the received input (or output
    gradient), run the stage, compute the loss on the last stage, hand tensors to a
    neighbouring stage on the same rank; the backward in two halves, so that ``helix_pipeline``
    can run it on its partner thread. Every private name of torch's runtime is reached through
    ``dhelix_compile._torch_compat``.

Pseudo-code::

    forward(action):  wait received input (unless the previous stage is on this rank)
                      output = stage.forward_one_chunk(mb); loss on the last stage
                      hand output to the next stage on this rank (now, or after the block)
    backward(action): wait received output gradient; return run:
                      stage.backward_one_chunk(mb); hand input gradients to the previous stage
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from dhelix_compile import _torch_compat as compat


class PipelineSteps:
    """FORWARD and FULL_BACKWARD of a ``_PipelineScheduleRuntime``, as its own loop runs them.

    ``install`` registers ``forward(action, ctx)``, ``backward(action, ctx)`` and
    ``overlap(action, ctx)`` as the schedule's custom functions, and records the
    ``return_outputs`` / ``loss_kwargs`` of each ``step`` (the custom functions' context
    does not carry them). ``p2p_timeout_s``: how long a step waits for a stage's input or
    output gradient, and for each send the runtime waits for (at the end of the step: while a
    step runs, torch's ``_wait_batch_p2p`` is this class's, process-wide); ``None``: each
    transfer's own timeout.
    """

    def __init__(self, schedule: Any, p2p_timeout_s: float | None = None) -> None:
        self.schedule = schedule
        self.return_outputs = True
        self.loss_kwargs: dict[str, Any] | None = None
        self.p2p_timeout_s = p2p_timeout_s
        self._deferred: dict[str, Callable[[], None]] | None = None

    def install(
        self, forward: Callable[..., None], backward: Callable[..., None], overlap: Callable[..., None]
    ) -> None:
        compat.install_pipeline_steps(self.schedule, forward, backward, overlap, self._step)

    @contextlib.contextmanager
    def _step(self, return_outputs: bool, loss_kwargs: dict[str, Any] | None) -> Iterator[None]:
        """Around one ``step``: its options recorded, torch's waits bounded."""
        self.return_outputs, self.loss_kwargs = return_outputs, loss_kwargs
        with self._torch_waits_bounded():
            yield

    @contextlib.contextmanager
    def _torch_waits_bounded(self) -> Iterator[None]:
        """torch's runtime waiting for its transfers (``_wait_batch_p2p``) with ``p2p_timeout_s``."""
        if self.p2p_timeout_s is None:
            yield
            return
        with compat.pipeline_transfer_waits(self._wait_transfers):
            yield

    def _stages(self) -> dict[int, Any]:
        return compat.runtime_stages(self.schedule)

    def _wait_received(self, works: list[Any]) -> None:
        """Wait for the receives of a stage's input or output gradient."""
        self._wait_transfers(works)

    def _wait_transfers(self, works: list[Any]) -> None:
        if self.p2p_timeout_s is None:
            compat.wait_pipeline_transfers(works)
            return
        from datetime import timedelta

        for work in works:
            work.wait(timedelta(seconds=self.p2p_timeout_s))

    def forward(self, action: Any, ctx: Any) -> None:
        """Wait for the stage's input, run its forward, compute the loss on the last stage."""
        stages = self._stages()
        index, mb = action.stage_index, action.microbatch_index
        stage = stages[index]
        compat.check_stage_unsharded(self.schedule, stage)
        if not stage.is_first and index - 1 not in stages:
            works = self.schedule.fwd_recv_ops.pop((index, mb), None)
            if works is None:
                raise RuntimeError(f"helix_pipeline: {action} runs before its input was received")
            self._wait_received(works)
        output = stage.forward_one_chunk(
            mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=self.return_outputs
        )
        compat.compute_stage_loss(self.schedule, stage, output, ctx.target_mbs, mb, self.loss_kwargs)
        if index + 1 in stages:
            following = stages[index + 1]
            self._hand_over("forward", lambda: following.set_local_fwd_input(output, mb))

    def backward(self, action: Any) -> Callable[[], None]:
        """Wait for the stage's output gradient; return the backward itself, to run anywhere."""
        stages = self._stages()
        index, mb = action.stage_index, action.microbatch_index
        stage = stages[index]
        compat.check_stage_unsharded(self.schedule, stage)
        if not stage.is_last and index + 1 not in stages:
            works = self.schedule.bwd_recv_ops.pop((index, mb), None)
            if works is None:
                raise RuntimeError(f"helix_pipeline: {action} runs before its output gradient was received")
            self._wait_received(works)
        loss = compat.stage_loss(self.schedule, stage, mb)
        self.schedule.backward_counter[index] += 1
        last_backward = self.schedule.backward_counter[index] == compat.schedule_microbatches(self.schedule)
        previous = stages.get(index - 1)

        def run() -> None:
            stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last_backward)
            if previous is not None:
                grads = stage.get_local_bwd_output(mb)
                self._hand_over("backward", lambda: previous.set_local_bwd_input(grads, mb))

        return run

    @contextlib.contextmanager
    def hand_overs_after(self) -> Iterator[None]:
        """Within: what a forward or backward hands to a stage on this rank (``set_local_fwd_input``,
        ``set_local_bwd_input``, where a boundary converts the tensor on the stages' mesh, perhaps
        with a collective) waits, and runs when the block ends without an error: the backward's,
        then the forward's. A forward and a backward run together on two threads, and their
        collectives on the one mesh would be issued in another order on each rank."""
        deferred: dict[str, Callable[[], None]] = {}
        self._deferred = deferred
        try:
            yield
        finally:
            self._deferred = None
        for kind in ("backward", "forward"):
            if kind in deferred:
                deferred[kind]()

    def _hand_over(self, kind: str, hand_over: Callable[[], None]) -> None:
        if self._deferred is None:
            hand_over()
        else:
            self._deferred[kind] = hand_over
