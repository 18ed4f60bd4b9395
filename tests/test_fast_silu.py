"""The vector SiLU (mtplx/engine/fast_silu.py): accurate, the same bits in every path, installed
for the whole process and named in the model identity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtplx import fast_path
from mtplx.engine import fast_silu

ROOT = Path(__file__).resolve().parents[1]


def _silu64(g: np.ndarray) -> np.ndarray:
    g = g.astype(np.float64)
    return g / (1.0 + np.exp(-g))


def test_within_two_ulps_or_so_of_float64():
    rng = np.random.default_rng(0)
    g = np.concatenate([rng.normal(size=100_000) * 8, np.linspace(-87, 87, 40_001)]).astype(np.float32)
    out = np.array(fast_silu.swiglu(mx.array(g), mx.ones(g.shape)))
    ref = _silu64(g)
    rel = np.abs(out - ref) / np.maximum(np.abs(ref), 1e-300)
    assert rel.max() < 3e-7, (rel.max(), g[rel.argmax()])
    # the ends: underflow to (-)0, overflow of e^-g, and NaN propagate as silu does
    ends = np.array(fast_silu.swiglu(mx.array([-200.0, 200.0, 0.0, float("nan")]), mx.ones((4,))))
    assert ends[0] == 0 and ends[1] == 200 and ends[2] == 0 and np.isnan(ends[3])


def test_same_bits_whatever_the_shape_or_the_compile_around_it():
    """A row's values may not depend on how many rows share the call, or on whether the call is
    traced into a layer step's compile (decode, verify) or runs as its own kernels (prefill)."""
    rng = np.random.default_rng(1)
    gate = mx.array(rng.normal(size=(4, 5, 640)).astype(np.float32) * 6)
    x = mx.array(rng.normal(size=(4, 5, 640)).astype(np.float32))
    alone = np.array(fast_silu.swiglu(gate[2:3, 1:2], x[2:3, 1:2]))
    batched = np.array(fast_silu.swiglu(gate, x))[2:3, 1:2]
    in_step = np.array(mx.compile(lambda g, v: fast_silu.swiglu(g, v) + 0.0)(gate, x))[2:3, 1:2]
    mx.disable_compile()
    try:
        op_by_op = np.array(fast_silu.swiglu(gate, x))[2:3, 1:2]
    finally:
        mx.enable_compile()
    for other in (batched, in_step, op_by_op):
        assert np.array_equal(alone.view(np.uint32), other.view(np.uint32))


def test_other_dtypes_keep_mlx_lm_swiglu():
    gate, x = mx.array([0.5, -1.0], dtype=mx.bfloat16), mx.ones((2,), dtype=mx.bfloat16)
    assert mx.array_equal(fast_silu.swiglu(gate, x), fast_silu.mlx_lm_swiglu(gate, x))


def _run(code: str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, **env}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not fast_path.vector_silu_wanted(), reason="vector SiLU not used on this machine")
def test_a_loaded_model_uses_it_and_its_identity_says_so():
    code = ("import json, mtplx, mlx.core as mx\nfrom mtplx.catalog import resolve\n"
            "from mtplx.engine.checkpoint import load_checkpoint\nfrom mtplx.engine import fast_silu\n"
            "import mlx_lm.models.qwen3 as q\n"
            "ck = load_checkpoint(resolve('tiny-dense'))\n"
            "print(json.dumps({'identity': ck.identity, 'compute': ck.extras['compute'],\n"
            "  'patched': q.swiglu is fast_silu.swiglu}))")
    on, off = _run(code), _run(code, MTPLX_VECTOR_SILU="off")
    assert on["patched"] and on["compute"].endswith(" + vector silu")
    assert not off["patched"] and "silu" not in off["compute"]
    # entries computed with one SiLU never restore into a process computing with the other
    assert on["identity"] != off["identity"]


def test_silu_alone_is_as_accurate_and_as_shape_independent():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.normal(size=50_000) * 8, np.linspace(-87, 87, 20_001)]).astype(np.float32)
    out = np.array(fast_silu.silu(mx.array(x)))
    ref = _silu64(x)
    assert (np.abs(out - ref) / np.maximum(np.abs(ref), 1e-300)).max() < 3e-7
    block = mx.array(rng.normal(size=(3, 6, 512)).astype(np.float32) * 5)
    alone = np.array(fast_silu.silu(block[1:2, 4:5]))
    for other in (np.array(fast_silu.silu(block))[1:2, 4:5], np.array(mx.compile(fast_silu.silu)(block))[1:2, 4:5]):
        assert np.array_equal(alone.view(np.uint32), other.view(np.uint32))


def test_the_hybrids_recurrent_layers_take_it_where_the_model_does(hybrid_engine):
    """Every path of a GatedDeltaNet layer (prefill, capturing verify, compiled step) reads the
    layer's own switch, set from the same compute path as the MLPs'."""
    on = " + vector silu" in hybrid_engine.checkpoint.extras["compute"]
    layers = [layer.linear_attn for layer in hybrid_engine.runner.model.layers if hasattr(layer, "linear_attn")]
    assert layers and all(layer.vector_silu == on for layer in layers)
