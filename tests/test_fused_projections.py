"""Stacked projections (engine/fused_projections.py): one matmul, the separate Linears' values,
and no second copy of the weights."""

from __future__ import annotations

import gc

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.qwen3 import MLP

from mtplx.engine import fused_projections


def _linears(*widths, dtype=mx.float32):
    layers = [nn.Linear(256, n, bias=False) for n in widths]
    for layer in layers:
        layer.weight = layer.weight.astype(dtype)
    mx.eval([layer.parameters() for layer in layers])
    return layers


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 5, 16, 40])
def test_one_matmul_gives_each_linears_values(dtype, rows):
    layers = _linears(256, 128, 128, dtype=dtype)
    x = mx.random.normal((1, rows, 256), key=mx.random.key(rows)).astype(dtype)
    expected = [layer(x) for layer in layers]
    mx.eval(expected)
    fused = fused_projections.fuse(layers)
    for got, want, layer in zip(fused(x), expected, layers):
        assert mx.array_equal(got, want).item()
        assert mx.array_equal(layer(x), want).item()  # the Linears still work on their row views


def test_the_stack_reuses_the_weights_memory():
    layers = _linears(2048, 1024, 1024)
    gc.collect()
    before = mx.get_active_memory()
    fused = fused_projections.fuse(layers)
    gc.collect()
    weights = sum(layer.weight.nbytes for layer in layers)
    assert mx.get_active_memory() - before < weights // 4  # the separate copies were released
    assert fused is not None


def test_what_cannot_be_stacked_keeps_its_own_calls():
    with_bias = nn.Linear(256, 64, bias=True)
    assert fused_projections.fuse(_linears(64) + [with_bias]) is None
    quantized = nn.QuantizedLinear(256, 64, bias=False)
    assert fused_projections.fuse(_linears(64) + [quantized]) is None
    assert fused_projections.fuse([nn.Linear(256, 64, bias=False), nn.Linear(128, 64, bias=False)]) is None
    assert fused_projections.swiglu_mlp(nn.Identity()) is None


def test_swiglu_mlp_equals_the_module():
    mlp = MLP(256, 640)
    mx.eval(mlp.parameters())
    x = mx.random.normal((1, 4, 256), key=mx.random.key(3))
    expected = mlp(x)
    mx.eval(expected)
    assert mx.array_equal(fused_projections.swiglu_mlp(mlp)(x), expected).item()
