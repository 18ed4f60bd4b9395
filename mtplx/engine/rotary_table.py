"""RoPE from a table of cos/sin rows, for the compiled short steps (compiled.py).

On the CPU, `mx.fast.rope` has no kernel: every call rebuilds its angles from the position
(arange, exp, multiply, cos, sin: about ten dispatched ops per attention layer per step), and a
decode step or a draft is dispatch-bound. The angles depend only on the position, so they are
computed once per position into a table, with the very operations of that fallback in the same
order, and a step reads its rows and rotates: the result is bit-identical to `mx.fast.rope`
(tests/test_compiled_steps.py compares whole steps; tests/test_rotary_table.py the rotation at
partial widths, scales and offsets, in fp32 and bf16).

Only the non-interleaved layout that Qwen-family models use (`traditional=False`) is built here;
`for_rope` returns None for anything else and the caller keeps nn.RoPE.
"""

from __future__ import annotations

import math
import threading

import mlx.core as mx
import mlx.nn as nn

FIRST_ROWS = 4096  # rows of a new table; it doubles when a position passes its end


class RotaryTable:
    def __init__(self, dims: int, base: float, scale: float):
        self.dims, self.half, self.base, self.scale = dims, dims // 2, base, scale
        self.rows = mx.zeros((0, 2, self.half), dtype=mx.float32)
        # (thread, lengths, length) -> rows: every layer of a batch's forward asks the same (tables
        # are shared per RoPE setting, so two engines in one process must not share a lazy gather)
        self._ragged = (None, None)

    def _grow(self, needed: int) -> None:
        size = max(FIRST_ROWS, self.rows.shape[0])
        while size < needed:
            size *= 2
        inv = mx.exp(-mx.arange(self.half).astype(mx.float32) * (math.log(self.base) / self.half))
        theta = (mx.arange(size).astype(mx.float32) * self.scale)[:, None] * inv[None, :]
        self.rows = mx.stack([mx.cos(theta), mx.sin(theta)], axis=1)
        mx.eval(self.rows)

    def at(self, offset, length: int, lengths: list[int] | None = None) -> mx.array:
        """Rows for positions offset .. offset + length - 1: (length, 2, half) for one sequence
        (`offset` an int), or (B, 1, length, 2, half) for a ragged batch (`offset` the per-row
        array, `lengths` its values)."""
        end = (max(lengths) if lengths is not None else offset) + length
        if end > self.rows.shape[0]:
            self._grow(end)
        if lengths is None:
            return self.rows[offset:end]
        key = (threading.get_ident(), tuple(lengths), length)
        if self._ragged[0] != key:
            positions = offset[:, None] + mx.arange(length)[None, :]
            self._ragged = (key, self.rows[positions][:, None])
        return self._ragged[1]

    def rotate(self, x: mx.array, rows: mx.array) -> mx.array:
        """x (..., L, D) rotated by `rows` from `at` (inside a compiled function: a few fused ops)."""
        cos, sin = rows[..., 0, :].astype(x.dtype), rows[..., 1, :].astype(x.dtype)
        x1, x2 = x[..., : self.half], x[..., self.half : self.dims]
        parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
        if self.dims < x.shape[-1]:
            parts.append(x[..., self.dims :])
        return mx.concatenate(parts, axis=-1)


_TABLES: dict[tuple, RotaryTable] = {}


def for_rope(rope) -> RotaryTable | None:
    """The shared table for an nn.RoPE's settings, or None where it is not the plain layout."""
    if type(rope) is not nn.RoPE or rope.traditional:
        return None
    key = (rope.dims, float(rope.base), float(rope.scale))
    if key not in _TABLES:
        _TABLES[key] = RotaryTable(*key)
    return _TABLES[key]
