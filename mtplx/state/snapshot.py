"""Independent snapshots of mlx-lm prompt caches: taken, cut back and restored without aliasing.

Two traps shape this module: `ArraysCache.state` returns the live list (its arrays are replaced,
not written, so copying the list is enough), and `KVCache.state` returns the live buffer that
`update_and_fetch` writes in place (so a snapshot slices to the offset and never shares it).

A layer made of several caches (mlx-lm's `CacheList`: DeepSeek-V3.2's latent KV and indexer keys)
is snapshotted as a "list" marker holding how many caches follow, then each of them
(cache_layers.py); every function here sees the same flat sequence, so they stay aligned.

Sliding-window layers (`RotatingKVCache`, Gemma 2/3) are kept as their tokens in temporal order
(keys, values, and [max_size, keep]): the state the cache itself puts its buffer in before every
multi-token update, which is how a cold prefill leaves it. Such a layer can be cut back only while
it has never dropped a token; past that, an earlier point's state exists only where a prefill took
a checkpoint of it (`checkpoint_arrays`; plan.restorable_positions says where).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from mtplx.state.cache_layers import flat


@dataclass
class LayerSnapshot:
    kind: str  # "kv", "arrays", "rotating" or "list"
    arrays: tuple  # (keys, values), the recurrent arrays, (keys, values, [max_size, keep]), or () for "list"
    offset: int = 0  # tokens held; for "list": how many of the following snapshots it is made of

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a is not None)


def snapshot(cache: list, upto: int | None = None) -> list[LayerSnapshot]:
    """An independent copy of every layer's state (evaluated, so later writes cannot leak in).
    `upto`: full-attention layers copy only their first `upto` tokens (a prefix of a cache that
    goes on; its other layers' state at that point comes from a checkpoint: at_checkpoint)."""
    out = []
    for layer in flat(cache):
        if isinstance(layer, CacheList):
            out.append(LayerSnapshot("list", (), len(layer.caches)))
        elif isinstance(layer, KVCache):
            if layer.keys is None:
                out.append(LayerSnapshot("kv", (None, None), 0))
            else:
                n = layer.offset if upto is None else min(layer.offset, upto)
                out.append(LayerSnapshot("kv", (mx.array(layer.keys[..., :n, :]), mx.array(layer.values[..., :n, :])), n))
        elif isinstance(layer, ArraysCache):
            out.append(LayerSnapshot("arrays", tuple(layer.cache)))
        elif isinstance(layer, RotatingKVCache):
            out.append(_rotating_snapshot(layer))
        else:
            raise TypeError(f"cannot snapshot cache layer of type {type(layer).__name__}")
    mx.eval([a for s in out for a in s.arrays if a is not None])
    return out


def _rotating_snapshot(layer: RotatingKVCache) -> LayerSnapshot:
    window = mx.array([layer.max_size, layer.keep], dtype=mx.int32)
    if layer.keys is None:
        return LayerSnapshot("rotating", (None, None, window), 0)
    # The cache's own temporal order (what its next multi-token update starts from), sliced to a
    # fresh array so later in-place writes into the live ring buffer cannot reach the snapshot.
    keys, values = layer._temporal_order(layer.keys), layer._temporal_order(layer.values)
    n = min(keys.shape[2], layer.offset)
    return LayerSnapshot("rotating", (mx.array(keys[..., :n, :]), mx.array(values[..., :n, :]), window), layer.offset)


def window(snap: list[LayerSnapshot]) -> int | None:
    """The smallest sliding window among a snapshot's layers (None: no sliding-window layer)."""
    sizes = [int(s.arrays[2][0].item()) for s in snap if s.kind == "rotating"]
    return min(sizes) if sizes else None


def restore(snap: list[LayerSnapshot]) -> list:
    """Fresh cache objects holding copies of a snapshot (the snapshot stays reusable)."""
    cache, lists = [], []  # lists: [CacheList marker's size, its caches so far], innermost last
    for s in snap:
        if s.kind == "list":
            lists.append((s.offset, []))
            continue
        if s.kind == "kv":
            layer = KVCache()
            if s.arrays[0] is not None:
                # A new buffer: update_and_fetch will write into it, never into the snapshot.
                layer.keys, layer.values = mx.array(s.arrays[0]), mx.array(s.arrays[1])
                layer.offset = s.offset
        elif s.kind == "rotating":
            max_size, keep = (int(v) for v in s.arrays[2].tolist())
            layer = RotatingKVCache(max_size=max_size, keep=keep)
            if s.arrays[0] is not None:
                layer.keys, layer.values = mx.array(s.arrays[0]), mx.array(s.arrays[1])
                layer.offset, layer._idx = s.offset, s.arrays[0].shape[2]  # temporal order: writes go after the last
        else:
            layer = ArraysCache(size=len(s.arrays))
            layer.cache = list(s.arrays)
        while lists and len(lists[-1][1]) + 1 == lists[-1][0]:  # the last cache of a list closes it
            layer = CacheList(*lists.pop()[1], layer)
        (lists[-1][1] if lists else cache).append(layer)
    return cache


def truncate_kv(snap: list[LayerSnapshot], length: int) -> list[LayerSnapshot]:
    """A snapshot of attention layers cut to `length` tokens (recurrent layers kept as they are:
    callers only cut where a recurrent checkpoint was taken at that same length). A sliding-window
    layer is cut only while it holds every token from the first (it never dropped one)."""
    out = []
    for s in snap:
        if s.kind == "rotating" and s.arrays[0] is not None and s.offset > length:
            if s.arrays[0].shape[2] != s.offset:
                raise ValueError(f"sliding-window layer holds {s.arrays[0].shape[2]} of {s.offset} tokens: "
                                 f"no exact state at {length}")
            out.append(LayerSnapshot("rotating", (s.arrays[0][..., :length, :], s.arrays[1][..., :length, :], s.arrays[2]),
                                     length))
        elif s.kind == "kv" and s.arrays[0] is not None and s.offset > length:
            out.append(LayerSnapshot("kv", (s.arrays[0][..., :length, :], s.arrays[1][..., :length, :]), length))
        else:
            out.append(s)
    return out


def checkpoint_arrays(cache: list) -> list:
    """A checkpoint of every layer whose state cannot be cut back from a later one: recurrent
    arrays, and a sliding-window layer's tokens in temporal order (an independent copy, with
    [max_size, keep]: once its ring has dropped a token, the state of an earlier point exists
    only where one was taken); None for full attention, which cuts anywhere."""
    out = []
    for layer in flat(cache):
        if isinstance(layer, ArraysCache):
            out.append(tuple(layer.cache))
        elif isinstance(layer, RotatingKVCache):
            out.append(_rotating_snapshot(layer).arrays)
        else:
            out.append(None)
    mx.eval([a for arrays in out if arrays for a in arrays if a is not None])
    return out


def at_checkpoint(snap: list[LayerSnapshot], arrays: list, position: int) -> list[LayerSnapshot]:
    """`snap` (taken later) with its recurrent and sliding-window layers replaced by a checkpoint
    taken at `position` (checkpoint_arrays); its full-attention layers are left to truncate_kv."""
    out = []
    for s, a in zip(snap, arrays):
        if a is None:
            out.append(s)
        elif s.kind == "rotating":
            out.append(LayerSnapshot("rotating", tuple(a), position))
        else:
            out.append(LayerSnapshot("arrays", tuple(a)))
    return out
