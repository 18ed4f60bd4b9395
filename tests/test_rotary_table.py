"""RoPE from a cos/sin table (engine/rotary_table.py) equals mx.fast.rope bit for bit."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtplx.engine import rotary_table
from mtplx.engine.batch_cache import RaggedKVCache


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("head_dim,dims,base,scale", [(64, 64, 10000.0, 1.0), (64, 16, 10_000_000.0, 1.0),
                                                      (128, 128, 1_000_000.0, 0.3)])
def test_rotation_equals_fast_rope(dtype, head_dim, dims, base, scale):
    table = rotary_table.RotaryTable(dims, base, scale)
    x = mx.random.normal((1, 6, 5, head_dim), key=mx.random.key(0)).astype(dtype)
    for offset in (0, 7, 1000, 5000):  # 5000 grows the table past its first rows
        expected = mx.fast.rope(x, dims, traditional=False, base=base, scale=scale, offset=offset)
        got = table.rotate(x, table.at(offset, 5))
        assert got.dtype == expected.dtype and mx.array_equal(got, expected).item()
    assert table.rows.shape[0] >= 5005


def test_ragged_rows_take_each_rows_own_positions():
    table = rotary_table.RotaryTable(64, 10000.0, 1.0)
    cache = RaggedKVCache(None, None, [3, 40])
    x = mx.random.normal((2, 4, 2, 64), key=mx.random.key(1))
    got = table.rotate(x, table.at(cache.offset, 2, cache.lengths))
    for b, offset in enumerate(cache.lengths):
        expected = mx.fast.rope(x[b : b + 1], 64, traditional=False, base=10000.0, scale=1.0, offset=offset)
        assert mx.array_equal(got[b : b + 1], expected).item()


def test_only_the_plain_layout_gets_a_table():
    assert rotary_table.for_rope(nn.RoPE(64, traditional=True)) is None
    assert rotary_table.for_rope(nn.RoPE(64)) is rotary_table.for_rope(nn.RoPE(64))  # shared per setting
    assert rotary_table.for_rope(object()) is None
