"""A prompt cache's layers as mtplx handles them, one cache object at a time.

mlx-lm gives some families a layer made of several caches (`CacheList`): DeepSeek-V3.2 and GLM-5
keep their attention's latent KV and their sparse-attention indexer's keys side by side, LongCat
two attentions, Falcon-H1 and Baichuan-M1 a recurrent state next to attention KV. Rolling back,
snapshotting and restoring treat each of those caches as a layer of its own (`leaves`); a snapshot
marks where a list began so a restore rebuilds it (snapshot.py).
"""

from __future__ import annotations

from typing import Iterator

from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache


def flat(cache) -> Iterator:
    """Each layer of `cache` in order; a CacheList as itself, then each of its caches."""
    for layer in cache:
        yield layer
        if isinstance(layer, CacheList):
            yield from flat(layer.caches)


def leaves(cache) -> Iterator:
    """Every cache object of `cache`, CacheLists opened."""
    return (layer for layer in flat(cache) if not isinstance(layer, CacheList))


def has_recurrent(cache) -> bool:
    """Whether some layer keeps a recurrent state (GatedDeltaNet, Mamba, short convolutions): a
    state that exists only at the points where it was captured, never cut back from a later one."""
    return any(isinstance(c, ArraysCache) for c in leaves(cache))


def has_window(cache) -> bool:
    """Whether some layer is a sliding window (its ring drops tokens past the window)."""
    return any(isinstance(c, RotatingKVCache) for c in leaves(cache))
