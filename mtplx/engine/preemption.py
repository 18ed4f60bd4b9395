"""Background prefill that steps aside between layers when a request arrives.

Render-ahead computes in idle time, a chunk per idle step; a forward cannot stop halfway once
evaluated, so a request arriving during a chunk used to wait for all of it (31-36 ms for a 32-token
chunk of tiny-hybrid with its MTP head at 3k tokens of context, more for a real model). Inside a
`preemptible(check)` block each trunk layer first evaluates its input and asks `check()` whether
a request waits; if one does it raises `SteppedAside` and the caller puts the caches back where
the chunk began (`marks` / `roll_back`) and retries the chunk later. The wait becomes about one
layer; the chunk's partial work is lost, at most one chunk.

Only background work runs in such a block; a request's own forwards never pay the per-layer sync.
The hook sits in each decoder layer's class (a subclass made per class, as gdn_capture switches
GatedDeltaNet's) and in the compiled step loop, so it holds for any mlx-lm family.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mtplx.state.cache_layers import flat

# The check of the background prefill running on this thread. Per thread: a process may hold
# several engines (the TUI's and a replay arm's, tests), each with its own thread, and one
# engine's render-ahead must never make another's request step aside.
_local = threading.local()
_subclasses: dict[type, type] = {}


class SteppedAside(Exception):
    """A background forward stopped between layers: a request is waiting."""


@contextlib.contextmanager
def preemptible(check: Callable[[], bool]):
    previous, _local.check = getattr(_local, "check", None), check
    try:
        yield
    finally:
        _local.check = previous


def active() -> bool:
    """Whether this thread runs a background prefill that may step aside."""
    return getattr(_local, "check", None) is not None


def between_layers(x: mx.array | None) -> None:
    """Called with each layer's input: inside `preemptible`, compute it and step aside if asked."""
    check = getattr(_local, "check", None)
    if check is None:
        return
    if isinstance(x, mx.array):
        mx.eval(x)
    if check():
        raise SteppedAside


def install(layers: list) -> None:
    """Give every layer the hook (same parameters, same outputs)."""
    for layer in layers:
        cls = type(layer)
        if cls in _subclasses.values():
            continue
        if cls not in _subclasses:
            def __call__(self, *args, _base=cls, **kwargs):
                between_layers(args[0] if args else None)
                return _base.__call__(self, *args, **kwargs)

            _subclasses[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
        layer.__class__ = _subclasses[cls]


def marks(cache: list) -> list:
    """What `roll_back` needs to put each layer's cache back as it is now (layers as
    cache_layers.flat walks them: a CacheList's caches one by one)."""
    return [_mark(layer) for layer in flat(cache)]


def _mark(layer):
    if isinstance(layer, KVCache):
        return layer.offset
    if isinstance(layer, ArraysCache):
        return list(layer.cache), layer.lengths, layer.left_padding
    if isinstance(layer, RotatingKVCache):
        # New wrappers of its ring: a one-token update writes the ring's own wrapper in place, and
        # MLX then copies the buffer these still hold instead of reusing it.
        keys, values = (None, None) if layer.keys is None else (mx.array(layer.keys), mx.array(layer.values))
        return keys, values, layer.offset, layer._idx
    return None


def roll_back(cache: list, marked: list) -> None:
    """Undo a forward stopped partway: layers it reached are put back, the others never moved."""
    for layer, mark in zip(flat(cache), marked):
        if isinstance(layer, KVCache):
            layer.trim(layer.offset - mark)
        elif isinstance(layer, ArraysCache):
            layer.cache, layer.lengths, layer.left_padding = list(mark[0]), mark[1], mark[2]
            layer.stops, layer.stopped = (), {}
        elif isinstance(layer, RotatingKVCache):
            layer.keys, layer.values, layer.offset, layer._idx = mark
