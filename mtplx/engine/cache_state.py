"""Copying, trimming and rolling back mlx-lm prompt caches without aliasing.

Two traps shape this module: `ArraysCache.state` returns the live list (its arrays are replaced,
not written, so copying the list is enough), and `KVCache.state` returns the live buffer that
`update_and_fetch` writes in place (so a snapshot slices to the offset and never shares it).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache


@dataclass
class LayerSnapshot:
    kind: str  # "kv" or "arrays"
    arrays: tuple  # (keys, values) or the recurrent arrays
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a is not None)


def snapshot(cache: list) -> list[LayerSnapshot]:
    """An independent copy of every layer's state (evaluated, so later writes cannot leak in)."""
    out = []
    for layer in cache:
        if isinstance(layer, KVCache):
            if layer.keys is None:
                out.append(LayerSnapshot("kv", (None, None), 0))
            else:
                n = layer.offset
                out.append(LayerSnapshot("kv", (mx.array(layer.keys[..., :n, :]), mx.array(layer.values[..., :n, :])), n))
        elif isinstance(layer, ArraysCache):
            out.append(LayerSnapshot("arrays", tuple(layer.cache)))
        else:
            raise TypeError(f"cannot snapshot cache layer of type {type(layer).__name__}")
    mx.eval([a for s in out for a in s.arrays if a is not None])
    return out


def restore(snap: list[LayerSnapshot]) -> list:
    """Fresh cache objects holding copies of a snapshot (the snapshot stays reusable)."""
    cache = []
    for s in snap:
        if s.kind == "kv":
            layer = KVCache()
            if s.arrays[0] is not None:
                # A new buffer: update_and_fetch will write into it, never into the snapshot.
                layer.keys, layer.values = mx.array(s.arrays[0]), mx.array(s.arrays[1])
                layer.offset = s.offset
        else:
            layer = ArraysCache(size=len(s.arrays))
            layer.cache = list(s.arrays)
        cache.append(layer)
    return cache


def truncate_kv(snap: list[LayerSnapshot], length: int) -> list[LayerSnapshot]:
    """A snapshot of attention layers cut to `length` tokens (recurrent layers kept as they are:
    callers only cut where a recurrent checkpoint was taken at that same length)."""
    out = []
    for s in snap:
        if s.kind == "kv" and s.arrays[0] is not None and s.offset > length:
            out.append(LayerSnapshot("kv", (s.arrays[0][..., :length, :], s.arrays[1][..., :length, :]), length))
        else:
            out.append(s)
    return out


def set_capture(cache: list, on: bool) -> None:
    for layer in cache:
        if isinstance(layer, ArraysCache):
            layer.capture = on
            if not on:
                layer.positions = None


def keep_verified(cache: list, fed: int, kept: int) -> None:
    """After a capturing verify that fed `fed` tokens, keep only the first `kept` of them."""
    drop = fed - kept
    for layer in cache:
        if isinstance(layer, KVCache):
            if drop:
                layer.trim(drop)
        elif isinstance(layer, ArraysCache):
            if drop:
                layer.cache[0], layer.cache[1] = layer.positions[kept - 1]
            layer.positions = None
            layer.capture = False


def recurrent_copy(cache: list) -> list:
    """The recurrent layers' arrays (list copies), for snapshot-and-replay rollback."""
    return [list(layer.cache) if isinstance(layer, ArraysCache) else None for layer in cache]


def rewind(cache: list, recurrent: list, drop: int) -> None:
    """Undo the last `drop` tokens: trim attention, put recurrent arrays back as copied."""
    for layer, arrays in zip(cache, recurrent):
        if isinstance(layer, KVCache):
            layer.trim(drop)
        elif arrays is not None:
            layer.cache = list(arrays)

