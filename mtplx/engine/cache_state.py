"""Rolling a live mlx-lm prompt cache back after a verify: capture, keep the verified tokens,
or put the copied recurrent arrays back. Snapshots (copies that outlive the cache) are in
mtplx/state/snapshot.py.

`ArraysCache.state` is the live list and its arrays are replaced, never written, so copying the
list is enough to keep a recurrent layer's state. Layers are walked as cache_layers.flat gives
them (a CacheList's caches one by one), so per-layer records line up with snapshots.
"""

from __future__ import annotations

from mlx_lm.models.cache import ArraysCache, KVCache

from mtplx.state.cache_layers import flat


def set_capture(cache: list, on: bool) -> None:
    for layer in flat(cache):
        if isinstance(layer, ArraysCache):
            layer.capture = on
            if not on:
                layer.positions = None


def set_stops(cache: list, stops: list[int]) -> None:
    """Positions inside the next forward (0 < p < its length) where each recurrent layer keeps
    its state (gdn_capture.CapturingGatedDeltaNet)."""
    for layer in flat(cache):
        if isinstance(layer, ArraysCache):
            layer.stops, layer.stopped = tuple(stops), {}


def take_stopped(cache: list, stops: list[int]) -> dict[int, list]:
    """{stop: the recurrent arrays there, a layer's (conv tail, state) or None for attention
    layers} after a forward run with `set_stops`; clears the stops."""
    out = {p: [layer.stopped[p] if isinstance(layer, ArraysCache) else None for layer in flat(cache)] for p in stops}
    for layer in flat(cache):
        if isinstance(layer, ArraysCache):
            layer.stops, layer.stopped = (), {}
    return out


def keep_verified(cache: list, fed: int, kept: int) -> None:
    """After a capturing verify that fed `fed` tokens, keep only the first `kept` of them."""
    drop = fed - kept
    for layer in flat(cache):
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
    return [list(layer.cache) if isinstance(layer, ArraysCache) else None for layer in flat(cache)]


def rewind(cache: list, recurrent: list, drop: int) -> None:
    """Undo the last `drop` tokens: trim attention, put recurrent arrays back as copied."""
    for layer, arrays in zip(flat(cache), recurrent):
        if isinstance(layer, KVCache):
            layer.trim(drop)
        elif arrays is not None:
            layer.cache = list(arrays)

