"""gdn_step: a position's bits do not depend on how many positions or batch rows share the call,
compiled or not, in any input type; the values are mlx-lm's step to float32 rounding."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta

from mtplx.engine import gdn_step

B, S, H, D = 4, 5, 4, 64


def _inputs(dtype):
    mx.random.seed(7)
    q, k, v = (mx.random.normal((B, S, H, D)).astype(dtype) for _ in range(3))
    g, beta = mx.random.uniform(shape=(B, S, H)), mx.random.uniform(shape=(B, S, H))
    return q, k, v, g, beta, mx.random.normal((B, H, D, D))


def _run(step, q, k, v, g, beta, state):
    out = []
    for t in range(q.shape[1]):
        y, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        out += [y, state]
    mx.eval(out)
    return out


def _same(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_position_has_the_same_bits_alone_in_a_verify_and_in_a_batch(dtype):
    q, k, v, g, beta, state = _inputs(dtype)
    reference = _run(gdn_step.step, q, k, v, g, beta, state)
    compiled = _run(mx.compile(gdn_step.step), q, k, v, g, beta, state)
    assert all(_same(a, b) for a, b in zip(compiled, reference))
    two = _run(gdn_step.step, q[:, :2], k[:, :2], v[:, :2], g[:, :2], beta[:, :2], state)  # a shorter verify
    assert all(_same(a, b) for a, b in zip(two, reference))
    alone = _run(mx.compile(gdn_step.step), *(a[2:3] for a in (q, k, v, g, beta, state)))  # row 2 of the batch
    assert all(_same(a, b[2:3]) for a, b in zip(alone, reference))


def test_a_step_with_a_position_axis_has_the_same_bits():
    """compiled.py's layout: inputs split along the position axis keep it, the state gains it."""
    q, k, v, g, beta, state = _inputs(mx.float32)
    reference = _run(gdn_step.step, q, k, v, g, beta, state)
    out, st = [], state[:, None]
    for t in range(S):
        y, st = gdn_step.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], st)
        out += [y[:, 0], st[:, 0]]
    assert all(_same(a, b) for a, b in zip(out, reference))


def test_values_are_mlx_lms_step_to_float32_rounding():
    q, k, v, g, beta, state = _inputs(mx.float32)
    ours = _run(gdn_step.step, q, k, v, g, beta, state)
    theirs = _run(gated_delta._gated_delta_step_ops, q, k, v, g, beta, state)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        assert mx.abs(a - b).max().item() <= 1e-5 * max(1.0, mx.abs(b).max().item())


def test_the_reductions_arm_is_mlx_lms_step_bit_for_bit():
    q, k, v, g, beta, state = _inputs(mx.bfloat16)
    ours = _run(gdn_step._reductions, q, k, v, g, beta, state)
    theirs = _run(gated_delta._gated_delta_step_ops, q, k, v, g, beta, state)
    assert all(_same(a, b) for a, b in zip(ours, theirs))
