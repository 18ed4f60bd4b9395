"""A bank entry: the exact tokens computed, the model state for them, and its anchors.

State is held as independent copies (mtplx/state/snapshot.py): attention KV for the whole entry
(cut to any restore point), recurrent arrays at the entry's end and at each captured checkpoint,
and the MTP head's own KV with the last hidden state. An entry is data: the engine's
bank_executor takes it from live caches and restores caches from it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from mtplx.bank.anchors import Anchor, as_tokens
from mtplx.bank.plan import EntryView, restorable_positions
from mtplx.state import snapshot
from mtplx.state.snapshot import LayerSnapshot


@dataclass
class Entry:
    tokens: tuple[int, ...]
    identity: str
    trunk: list[LayerSnapshot]  # at len(tokens)
    checkpoints: dict[int, list]  # position -> per-layer recurrent arrays (None for KV layers)
    mtp: LayerSnapshot | None
    last_hidden: object | None  # an mx.array: the hidden state at position len(tokens) - 1
    anchors: list[Anchor]
    session: str | None = None
    entry_id: str = field(default_factory=lambda: "e_" + uuid.uuid4().hex[:10])
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    hits: int = 0
    last_restore: int | None = None  # the position the latest restore from this entry cut at
    origin: str = "turn"  # "turn" (a request's own state), "render_ahead" (prepared in idle time) or "shared_prompt" (engine/shared_prompt.py)
    token_array: object = None  # the tokens as an int array, made once for the planner

    def __post_init__(self):
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
            self._window = snapshot.window(self.trunk)
        restorable = restorable_positions(len(self.tokens), self.checkpoints, recurrent=self.recurrent,
                                          window=self._window)
        return EntryView(self.entry_id, self.tokens, self.identity, restorable, self.mtp_len,
                         self.last_hidden is not None, self.session, self.last_used, self.nbytes, tuple(self.anchors),
                         self.token_array)

    def used(self, position: int | None) -> None:
        """A restore read this entry: at `position` for a request (counted as a hit), or None for
        idle work (render-ahead), which keeps the entry recent without showing as a turn's hit."""
        self.last_used = time.monotonic()
        if position is not None:
            self.hits += 1
            self.last_restore = position
