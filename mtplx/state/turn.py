"""A turn's live caches and where a request starts from: the data the engine computes with and
the bank restores into. Plain dataclasses, no MLX calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class TurnState:
    """The caches of one request. `length` tokens of `tokens` are in the trunk cache; the MTP
    cache holds pairs for positions below `length` minus the pending pairs."""

    trunk: list
    mtp: object | None
    tokens: list[int]
    length: int = 0
    mtp_pending: object | None = None  # hidden at length-1 whose MTP pair awaits the next token


@dataclass(frozen=True)
class StartPoint:
    """Where a request starts: a state restored (or kept live) holding `cached` prompt tokens."""

    state: TurnState | None = None
    source: str = "cold"
    anchor: str | None = None
    ceiling: int | None = None
    shortfall: str | None = None
    entry_id: str | None = None  # the bank entry restored from
    render_ahead: str | None = None  # what idle-time preparation had done for this prompt (bank_executor)
    entry_origin: str | None = None  # what made the entry restored from (Entry.origin)

    @property
    def cached(self) -> int:
        return self.state.length if self.state else 0


# Called at each checkpoint position during prefill with the layers' state there that cannot be cut
# back from a later one (snapshot.checkpoint_arrays: per layer a tuple of recurrent arrays or a
# sliding-window layer's tokens, or None for full attention).
CheckpointHook = Callable[[int, list], None]
