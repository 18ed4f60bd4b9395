"""mtplx's CPU attention (mtplx/engine/cpu_attention.py) against MLX's kernel: the same values
(to fp32 rounding) for every mask kind and grouping the models use, and MLX's own kernel where a
call is small."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtplx.engine import cpu_attention


def _inputs(heads, kv_heads, queries, keys, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((2, heads, queries, 64)), mx.random.normal((2, kv_heads, keys, 64)) * 2,
            mx.random.normal((2, kv_heads, keys, 64)))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("queries,keys", [(16, 1500), (5, 4000), (64, 64)])
def test_matches_mlx_for_every_mask(heads, kv_heads, queries, keys):
    q, k, v = _inputs(heads, kv_heads, queries, keys)
    keep = mx.arange(keys)[None, :] <= mx.arange(keys - queries, keys)[:, None]  # causal, as a boolean mask
    # a batch's left padding (row 1 starts 3 keys late): its first queries may see no key at all
    padded = mx.broadcast_to(keep, (2, 1, queries, keys)) & (mx.arange(keys) >= mx.array([0, 3]).reshape(2, 1, 1, 1))
    additive = mx.where(keep, 0.0, -1e9)
    per_head = mx.broadcast_to(keep, (2, heads, queries, keys))
    for mask in ("causal", None, keep, padded, additive, per_head):
        want = cpu_attention._mlx_attention(q, k, v, scale=0.125, mask=mask)
        got = cpu_attention.attention(q, k, v, scale=0.125, mask=mask)
        assert got.shape == want.shape
        assert mx.allclose(got, want, atol=2e-6, rtol=1e-5, equal_nan=True).item(), (type(mask), mx.max(mx.abs(got - want)).item())


def test_the_exponent_is_accurate_over_the_softmax_range():
    scores = mx.concatenate([mx.linspace(-120, 0, 100_000), mx.array([-mx.inf, 0.0])])[None]
    got, want = cpu_attention.softmax(scores), mx.softmax(scores, axis=-1)
    assert mx.allclose(got, want, atol=1e-12, rtol=1e-5).item()
    assert got[0, -2].item() == 0.0  # a masked score weighs nothing


def test_small_calls_and_sinks_use_mlx_kernel():
    q, k, v = _inputs(4, 2, 1, 3000)
    assert mx.array_equal(cpu_attention.attention(q, k, v, scale=0.125), cpu_attention._mlx_attention(q, k, v, scale=0.125)).item()
    q, k, v = _inputs(4, 2, 3, 100)  # a verify at short context: below SMALL
    assert mx.array_equal(cpu_attention.attention(q, k, v, scale=0.125, mask="causal"),
                          cpu_attention._mlx_attention(q, k, v, scale=0.125, mask="causal")).item()
