"""The CUDA backend's short-block attention (engine/gpu_attention.py) is pure MLX ops, so its
arithmetic is checked here on any backend against MLX's fused kernel."""

from __future__ import annotations

import mtplx  # noqa: F401  (the fast path before MLX)
import mlx.core as mx
import numpy as np
import pytest

from mtplx.engine import gpu_attention


def _qkv(L, S, dtype, Hq=8, Hkv=2, D=64):
    mx.random.seed(7)
    q, k, v = (mx.random.normal(shape).astype(dtype) for shape in ((1, Hq, L, D), (1, Hkv, S, D), (1, Hkv, S, D)))
    return q, k, v


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 2e-5), (mx.bfloat16, 3e-2)])
@pytest.mark.parametrize("mask", ["causal", "bool", "additive", None])
@pytest.mark.parametrize("L,S", [(2, 37), (4, 300), (16, 1025)])
def test_short_blocks_match_mlx_attention(dtype, tol, mask, L, S):
    q, k, v = _qkv(L, S, dtype)
    if mask == "bool":
        keep = mx.array(np.random.default_rng(0).random((1, 1, L, S)) > 0.3)
        mask = keep | (mx.arange(S) == S - 1)  # every row keeps a key
    elif mask == "additive":
        mask = mx.array(np.random.default_rng(1).normal(size=(1, 8, L, S)).astype(np.float32)).astype(dtype)
    ours = gpu_attention.attention(q, k, v, scale=0.125, mask=mask)
    theirs = gpu_attention._mlx_attention(q, k, v, scale=0.125, mask=mask)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert mx.allclose(ours.astype(mx.float32), theirs.astype(mx.float32), atol=tol, rtol=tol).item()


def test_one_query_and_prefill_chunks_keep_mlx_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_attention, "_mlx_attention", lambda *a, **kw: calls.append(a[0].shape[2]) or a[0])
    for L in (1, 2, 16, 17, 256):
        q, k, v = _qkv(L, 300, mx.float32)
        gpu_attention.attention(q, k, v, scale=0.125, mask="causal" if L > 1 else None)
    assert calls == [1, 17, 256]


def test_not_wanted_on_the_cpu_or_when_switched_off(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    assert not gpu_attention.wanted()
    monkeypatch.setenv(gpu_attention.ENV, "off")
    assert not gpu_attention.wanted()
