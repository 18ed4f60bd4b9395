"""The chunked GatedDeltaNet prefill (engine/gdn_prefill.py) gives the step function's outputs and
state to fp32 rounding, at every length around its block size and for hard inputs: strong decay
(g underflows to 0 in the step function), correlated keys, a state carried in."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gated_delta

from mtplx import fast_path
from mtplx.engine import gdn_prefill


def _exact(q, k, v, log_g, beta, state):
    """The recurrence in float64, position by position."""
    q, k, v, g, beta, S = (np.array(x).astype(np.float64) for x in (q, k, v, mx.exp(log_g), beta, state))
    ys = np.zeros(v.shape)
    for t in range(q.shape[1]):
        S = S * g[:, t][..., None, None]
        delta = (v[:, t] - (S * k[:, t][:, :, None, :]).sum(-1)) * beta[:, t][..., None]
        S = S + k[:, t][:, :, None, :] * delta[..., None]
        ys[:, t] = (S * q[:, t][:, :, None, :]).sum(-1)
    return ys, S


def _inputs(T, decay_shift=0.0, correlated=False, seed=0, B=1, H=4, D=32):
    mx.random.seed(seed)
    q, k = mx.random.normal((B, T, H, D)), mx.random.normal((B, T, H, D))
    if correlated:  # keys near one direction: the within-block solve is at its least well conditioned
        k = 0.3 * k + mx.random.normal((B, 1, H, D))
    q, k = gated_delta.normalize_qk(q, k, inv_scale=D**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, H, D))
    log_g = -mx.exp(mx.random.normal((B, T, H)) + decay_shift)
    beta = mx.sigmoid(mx.random.normal((B, T, H)) + 1)
    state = 0.1 * mx.random.normal((B, H, D, D))
    return q, k, v, log_g, beta, state


@pytest.mark.parametrize("T", [16, 63, 64, 65, 200])
@pytest.mark.parametrize("case", ["plain", "strong decay", "correlated keys, slow decay"])
def test_chunked_recurrence_equals_the_step_function(T, case):
    shift = {"plain": 0.0, "strong decay": 5.0, "correlated keys, slow decay": -4.0}[case]
    args = _inputs(T, decay_shift=shift, correlated=case.startswith("correlated"), seed=T)
    y, state = gdn_prefill.recurrence(*args)
    want_y, want_state = _exact(*args)
    assert y.shape == want_y.shape and state.shape == want_state.shape
    assert np.all(np.isfinite(np.array(y))) and np.all(np.isfinite(np.array(state)))
    assert np.abs(np.array(y) - want_y).max() <= 2e-5 * np.abs(want_y).max()
    assert np.abs(np.array(state) - want_state).max() <= 2e-5 * np.abs(want_state).max()
    # and the step function mlx-lm runs agrees with the float64 reference just as closely
    steps_y, _ = gated_delta.gated_delta_ops(*args[:3], mx.exp(args[3]), *args[4:])
    assert np.abs(np.array(steps_y) - want_y).max() <= 2e-5 * np.abs(want_y).max()


def test_a_split_prefill_carries_its_state():
    """Two calls (a prefill in two chunks, or a restore and the rest) equal one call."""
    q, k, v, log_g, beta, state = _inputs(150, seed=5, B=2)
    y, s = gdn_prefill.recurrence(q, k, v, log_g, beta, state)
    y1, s1 = gdn_prefill.recurrence(q[:, :70], k[:, :70], v[:, :70], log_g[:, :70], beta[:, :70], state)
    y2, s2 = gdn_prefill.recurrence(q[:, 70:], k[:, 70:], v[:, 70:], log_g[:, 70:], beta[:, 70:], s1)
    both = np.concatenate([np.array(y1), np.array(y2)], axis=1)
    assert np.abs(both - np.array(y)).max() <= 2e-5 * np.abs(np.array(y)).max()
    assert np.abs(np.array(s2) - np.array(s)).max() <= 2e-5 * np.abs(np.array(s)).max()


@pytest.mark.parametrize("chunked", [True, False])
def test_checkpoints_inside_one_forward_equal_forwards_that_end_there(hybrid_engine, chunked):
    """The bank's checkpoints no longer cut a prefill into forwards: each recurrent layer keeps its
    state at the stop. What it keeps equals the state of a forward that ended there (bitwise on
    the step path with the reference BLAS; else to fp32 rounding), and the chunk's output is unchanged."""
    from mtplx.engine import cache_state, gdn_capture
    from mtplx.state import snapshot

    runner = hybrid_engine.runner
    layers = [layer.linear_attn for layer in runner.inner.layers if hasattr(layer, "linear_attn")]
    was = layers[0].chunked
    tokens = list(range(20, 130))
    stops = [3, 40, 97]  # a short segment (the step function), longer ones, a ragged tail

    def close(a, b):  # bitwise on the step path where rows are (the reference BLAS), else to fp32 rounding
        a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
        if not chunked and fast_path.rows_bitwise(fast_path.activate()):
            return np.array_equal(a, b)
        return np.abs(a - b).max() <= 2e-5 * max(1.0, np.abs(b).max())

    def work():
        gdn_capture.install(runner.model, chunked)
        one = runner.new_trunk_cache()
        runner.hidden(tokens[:5], one)  # a restored prefix
        cache_state.set_stops(one, stops)
        hidden = runner.hidden(tokens[5:], one)
        kept = cache_state.take_stopped(one, stops)
        mx.eval(hidden, kept)
        split = runner.new_trunk_cache()
        runner.hidden(tokens[:5], split)
        pieces, begin = [], 5
        for stop in stops:
            pieces.append(runner.hidden(tokens[begin:5 + stop], split))
            want = snapshot.checkpoint_arrays(split)
            for got, ref in zip(kept[stop], want):
                assert (got is None) == (ref is None)
                assert got is None or all(close(g, r) for g, r in zip(got, ref))
            begin = 5 + stop
        pieces.append(runner.hidden(tokens[begin:], split))
        assert close(hidden, mx.concatenate(pieces, axis=1))
        assert all(getattr(c, "stops", ()) == () for c in one)

    try:
        hybrid_engine.call(work)
    finally:
        gdn_capture.install(runner.model, was)
