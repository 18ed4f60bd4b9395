"""A bank entry in RAM: the exact tokens computed, the model state for them, and its anchors.

State is held as independent copies (see engine/cache_state.py): attention KV for the whole
entry (cut to any restore point), recurrent arrays at the entry's end and at each captured
checkpoint, and the MTP head's own KV with the last hidden state.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from mtplx.bank.anchors import Anchor
from mtplx.bank.plan import EntryView, restorable_positions
from mtplx.engine import cache_state
from mtplx.engine.generation import TurnState


@dataclass
class Entry:
    tokens: tuple[int, ...]
    identity: str
    trunk: list  # list[LayerSnapshot] at len(tokens)
    checkpoints: dict[int, list]  # position -> per-layer recurrent arrays (None for KV layers)
    mtp: cache_state.LayerSnapshot | None
    last_hidden: mx.array | None  # hidden state at position len(tokens) - 1
    anchors: list[Anchor]
    session: str | None = None
    entry_id: str = field(default_factory=lambda: "e_" + uuid.uuid4().hex[:10])
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    hits: int = 0
    last_restore: int | None = None  # the position the latest restore from this entry cut at
    origin: str = "turn"  # "turn" (a request's own state) or "render_ahead" (prepared in idle time)
    token_array: object = None  # the tokens as an int array, made once for the planner

    def __post_init__(self):
        from mtplx.bank.anchors import as_tokens

        self.token_array = as_tokens(self.tokens)

    @property
    def recurrent(self) -> bool:
        return any(s.kind == "arrays" for s in self.trunk)

    @property
    def mtp_len(self) -> int | None:
        return None if self.mtp is None else self.mtp.offset

    @property
    def nbytes(self) -> int:
        n = sum(s.nbytes for s in self.trunk) + (self.mtp.nbytes if self.mtp else 0)
        n += sum(a.nbytes for arrays in self.checkpoints.values() for layer in arrays if layer for a in layer if a is not None)
        return n + (self.last_hidden.nbytes if self.last_hidden is not None else 0)

    def view(self) -> EntryView:
        if not hasattr(self, "_window"):  # the trunk never changes; views are made on every plan
            self._window = cache_state.window(self.trunk)
        restorable = restorable_positions(len(self.tokens), self.checkpoints, recurrent=self.recurrent,
                                          window=self._window)
        return EntryView(self.entry_id, self.tokens, self.identity, restorable, self.mtp_len,
                         self.last_hidden is not None, self.session, self.last_used, self.nbytes, tuple(self.anchors),
                         self.token_array)

    def restore(self, position: int, next_token: int | None) -> TurnState:
        """Fresh caches holding this entry's state at `position` (a point the planner chose)."""
        snap = cache_state.truncate_kv(self.trunk, position)
        if self.recurrent and position != len(self.tokens):
            arrays = self.checkpoints[position]
            snap = [s if a is None else cache_state.LayerSnapshot("arrays", tuple(a)) for s, a in zip(snap, arrays)]
        trunk = cache_state.restore(snap)
        mtp, pending = None, None
        if self.mtp is not None:
            keep = min(position, self.mtp.offset)
            mtp = cache_state.restore(cache_state.truncate_kv([self.mtp], keep))[0]
            if keep == position - 1:  # the entry's end: rebuild pair (h[p-1], x[p]) from the kept hidden
                pending = self.last_hidden
        self.hits += 1
        self.last_restore = position
        self.last_used = time.monotonic()
        return TurnState(trunk, mtp, list(self.tokens[:position]), position, mtp_pending=pending)


def recurrent_arrays(cache: list) -> list:
    """The recurrent layers' current arrays (copied list; arrays are replaced, never written)."""
    return [tuple(layer.cache) if isinstance(layer, ArraysCache) else None for layer in cache]


def entry_from_state(state: TurnState, identity: str, checkpoints: dict[int, list], anchors: list[Anchor],
                     last_hidden: mx.array | None, session: str | None) -> Entry:
    mtp = None
    if isinstance(state.mtp, KVCache):
        mtp = cache_state.snapshot([state.mtp])[0]
    kept = {p: a for p, a in checkpoints.items() if p < state.length}
    return Entry(tuple(state.tokens[: state.length]), identity, cache_state.snapshot(state.trunk), kept, mtp,
                 mx.array(last_hidden) if last_hidden is not None else None, anchors, session)
