"""dhelix's custom ops (``dhelix_compile.ops``): ``dhelix::exchange``, the P2P op the per-peer
decomposition emits, and ``dhelix::with_accumulated_grad``."""

from __future__ import annotations

import torch

from dhelix_compile.ops import exchange
from dhelix_compile.ops.exchange import P2P_EXCHANGE


def test_the_op_is_registered_under_its_schema_name() -> None:
    assert torch.ops.dhelix.exchange.default is P2P_EXCHANGE
    assert str(P2P_EXCHANGE._schema).startswith("dhelix::exchange(")


def test_exchange_on_the_fake_group_keeps_nothing_in_flight() -> None:
    """The fake process group's works never complete: the exchange must not hold its payloads
    (it did, and every later call scanned the growing list: a decomposed step's compute-only
    benchmark phase slowed by milliseconds per exchange)."""
    from cost_model.testing import fake_world

    c10d = torch.ops._c10d_functional
    with fake_world(2) as group:
        for _ in range(3):
            done, received = P2P_EXCHANGE(torch.ones(8), 1, 1, 7, group.group_name)
            c10d.wait_tensor(done)
            c10d.wait_tensor(received)
            assert received.shape == (8,)
    assert exchange._IN_FLIGHT_SENDS == []


def test_with_accumulated_grad_adds_the_parameters_grad_and_clears_it() -> None:
    """``dhelix::with_accumulated_grad`` (data_parallel's once-per-step all-reduce reads what the
    earlier micro-batches accumulated through it)."""
    from dhelix_compile.ops import WITH_ACCUMULATED_GRAD, accumulator_slot

    param = torch.nn.Parameter(torch.zeros(3))
    slot = accumulator_slot(param)
    grad = torch.ones(3)
    alone = WITH_ACCUMULATED_GRAD(grad, slot)  # nothing accumulated: a copy, never the input itself
    assert torch.equal(alone, grad) and alone.data_ptr() != grad.data_ptr()
    param.grad = torch.full((3,), 2.0)
    assert torch.equal(WITH_ACCUMULATED_GRAD(grad, slot), torch.full((3,), 3.0))
    assert param.grad is None
    del param  # the slot holds its parameter weakly
    assert torch.equal(WITH_ACCUMULATED_GRAD(grad, slot), grad)


def test_grad_total_adds_into_the_parameters_grad_buffer_and_hands_it_over() -> None:
    """``dhelix::grad_total``: helix's backward graphs return it instead of each micro-batch's
    gradient; autograd stores the result in the cleared ``.grad``."""
    from dhelix_compile.ops import GRAD_TOTAL, accumulator_slot

    param = torch.nn.Parameter(torch.zeros(2, 3))
    slot = accumulator_slot(param)
    grad = torch.ones(2, 3)
    first = GRAD_TOTAL(grad, slot)  # nothing accumulated: a copy, never the input itself
    assert torch.equal(first, grad) and first.data_ptr() != grad.data_ptr() and param.grad is None
    accumulated = torch.full((2, 3), 2.0)
    param.grad = accumulated
    total = GRAD_TOTAL(grad, slot)
    assert total is accumulated and torch.equal(total, torch.full((2, 3), 3.0))  # in place
    assert param.grad is None


def test_grad_total_leaves_grad_alone_where_adding_in_place_would_differ_from_autograd() -> None:
    from dhelix_compile.ops import GRAD_TOTAL, accumulator_slot

    cases = {
        "dtype": (torch.ones(2, 3, dtype=torch.bfloat16), torch.full((2, 3), 2.0), None),
        "stride": (torch.ones(2, 3), torch.full((3, 2), 2.0).t(), None),
        "hook": (torch.ones(2, 3), torch.full((2, 3), 2.0), lambda g: g),
        "view": (torch.ones(2, 3), torch.full((12,), 2.0)[6:].view(2, 3), None),  # a flat buffer's
    }
    for name, (grad, accumulated, hook) in cases.items():
        param = torch.nn.Parameter(torch.zeros(2, 3))
        if hook is not None:
            param.register_hook(hook)  # it must see this micro-batch's gradient alone
        param.grad = accumulated
        got = GRAD_TOTAL(grad, accumulator_slot(param))
        assert torch.equal(got, grad) and got.data_ptr() != grad.data_ptr(), name
        assert param.grad is accumulated and torch.equal(accumulated, torch.full_like(accumulated, 2.0)), name
