"""The bank's planner: pure functions over token lists and entry metadata. No MLX, no I/O.

A restore point p is usable from an entry when
- the entry's tokens and the prompt agree on the first p tokens, and p < len(prompt) (the last
  prompt token must be computed to yield the first generated token);
- the entry holds the full model state at p: attention KV can be cut anywhere, recurrent
  (GatedDeltaNet) state exists only at the positions the entry captured, and a sliding-window
  layer (a ring buffer) only at the entry's end once it has dropped a token
  (`restorable_positions`);
- for MTP requests, the MTP head's history covers pairs < p: a pair (h[p-1], x[p]) uses the
  entry's token at p, so p must lie inside the match, or be the entry's end with the last hidden
  state kept to rebuild that pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mtplx.bank.anchors import Anchor, GRID, HEAD, MESSAGE, PROMPT_END, SYSTEM, as_tokens


@dataclass(frozen=True)
class EntryView:
    entry_id: str
    tokens: tuple[int, ...]
    identity: str
    restorable: tuple[int, ...] | None  # positions with full state; None: any (attention-only)
    mtp_len: int | None  # MTP pairs held; None: no MTP state
    has_last_hidden: bool = False
    session: str | None = None
    last_used: float = 0.0
    nbytes: int = 0
    anchors: tuple[Anchor, ...] = ()
    token_array: np.ndarray | None = field(default=None, compare=False, repr=False)  # tokens, prepared once

    @property
    def array(self) -> np.ndarray:
        return self.token_array if self.token_array is not None else as_tokens(self.tokens)

    def anchor_at(self, position: int) -> str | None:
        for a in self.anchors:
            if a.position == position:
                return a.kind
        return None


@dataclass(frozen=True)
class RestorePlan:
    entry_id: str | None  # None: cold
    position: int  # prompt tokens restored
    anchor: str | None  # anchor kind at the restore point, when one is recorded there
    match: int  # longest agreement with any candidate entry, in tokens
    captures: tuple[int, ...] = ()  # prefill span ends at which to capture state
    note: str | None = None  # why position < match, when it is


def restorable_positions(length: int, checkpoints, *, recurrent: bool, window: int | None) -> tuple[int, ...] | None:
    """Where an entry of `length` tokens holds the exact full state (None: anywhere).

    Attention KV cuts anywhere; recurrent state exists at captured checkpoints and the end. A
    sliding-window layer of `window` tokens never drops one while length <= window (a cold
    prefill to any earlier point holds the same tokens); past that its ring buffer has rotated and
    an earlier point's state exists only at a checkpoint, which captures it with the rest."""
    if window is not None and length > window:
        return tuple(sorted({*checkpoints, length}))
    if not recurrent:
        return None
    return tuple(sorted({*checkpoints, length}))


def common_prefix(a, b) -> int:
    """Length of the shared prefix of two token sequences (vectorised)."""
    x, y = as_tokens(a), as_tokens(b)
    n = min(len(x), len(y))
    diff = np.flatnonzero(x[:n] != y[:n])
    return int(diff[0]) if diff.size else n


def _best_point(entry: EntryView, match: int, limit: int, need_mtp: bool) -> int:
    end = len(entry.tokens)

    def mtp_ok(p: int) -> bool:
        if not need_mtp:
            return True
        if entry.mtp_len is None:
            return False
        return (p <= entry.mtp_len and p < match) or (p == end and entry.has_last_hidden and entry.mtp_len >= p - 1)

    if entry.restorable is None:
        for p in (limit, min(limit, match - 1, entry.mtp_len if entry.mtp_len is not None else limit)):
            if p > 0 and mtp_ok(p):
                return p
        return 0
    for p in sorted(entry.restorable, reverse=True):
        if p <= limit and mtp_ok(p):
            return p
    return 0


def plan_restore(prompt, anchors: list[Anchor], entries: list[EntryView], identity: str, *,
                 need_mtp: bool, recurrent: bool, min_restore: int = 32) -> RestorePlan:
    """Pick the entry and point to restore from, and the states this prefill must capture."""
    prompt = as_tokens(prompt)
    best: tuple[int, float, EntryView | None] = (0, 0.0, None)
    best_match = 0
    for entry in entries:
        if entry.identity != identity:
            continue
        match = common_prefix(entry.array, prompt)
        best_match = max(best_match, match)
        point = _best_point(entry, match, min(match, len(prompt) - 1), need_mtp)
        if point >= min_restore and (point, entry.last_used) > best[:2]:
            best = (point, entry.last_used, entry)
    position, _, chosen = best
    captures = ()
    if recurrent:  # attention-only models keep their whole KV and can be cut anywhere
        captures = tuple(a.position for a in anchors if position < a.position < len(prompt)
                         and a.kind in (HEAD, SYSTEM, MESSAGE, PROMPT_END, GRID))
    note = None
    if chosen is not None and position < best_match - 1 and best_match < len(prompt):
        note = f"no restorable state between {position} and the match at {best_match}"
    kind = None
    if chosen is not None:  # what the restore point is: an anchor, else a captured checkpoint (recurrent
        # state exists only there) or, attention-only, simply the longest common prefix
        kind = chosen.anchor_at(position) or ("checkpoint" if recurrent else "prefix")
    return RestorePlan(chosen.entry_id if chosen else None, position, kind, best_match, captures, note)


def superseded(new: EntryView, entries: list[EntryView]) -> list[str]:
    """Entries the new one makes redundant: same identity, tokens a strict prefix of the new
    entry's, and every restorable position of theirs restorable in the new one too."""
    out = []
    for e in entries:
        if e.entry_id == new.entry_id or e.identity != new.identity or len(e.tokens) >= len(new.tokens):
            continue
        if new.tokens[: len(e.tokens)] != e.tokens:
            continue
        if new.restorable is None or (e.restorable is not None and set(e.restorable) <= set(new.restorable)):
            if (e.mtp_len is None) == (new.mtp_len is None):
                out.append(e.entry_id)
    return out


def plan_eviction(entries: list[EntryView], budget_bytes: int, protected: set[str] = frozenset()) -> list[str]:
    """Least recently used entries to drop until the total fits the budget."""
    total = sum(e.nbytes for e in entries)
    out = []
    for e in sorted(entries, key=lambda e: e.last_used):
        if total <= budget_bytes:
            break
        if e.entry_id in protected:
            continue
        out.append(e.entry_id)
        total -= e.nbytes
    return out


def plan_room(stored: list[tuple[str, int]], size: int, budget_bytes: int, free_bytes: int,
              floor_bytes: int) -> list[str] | None:
    """SSD entries to drop, least recently used first (`stored` is in that order, with each
    file's bytes), so that a new file of `size` bytes keeps the tier within its budget and the
    disk above its free floor. None when it cannot fit even with every entry dropped: then none
    is dropped for it (a full disk is not emptied for a file that will not fit anyway)."""
    total, out = sum(n for _, n in stored), []

    def fits() -> bool:
        return total + size <= budget_bytes and free_bytes - size >= floor_bytes

    for entry_id, nbytes in stored:
        if fits():
            break
        out.append(entry_id)
        total, free_bytes = total - nbytes, free_bytes + nbytes  # a deleted file frees its bytes
    return out if fits() else None


def thin_checkpoints(positions: list[int], keep: int, pinned: set[int]) -> list[int]:
    """At most `keep` recurrent checkpoints: pinned ones (head, newest message), the oldest, and
    the rest taken nearest the frontier, where the next divergence most likely falls."""
    positions = sorted(set(positions))
    if len(positions) <= keep:
        return positions
    chosen = set(p for p in positions if p in pinned)
    chosen.add(positions[0])
    for p in reversed(positions):
        if len(chosen) >= keep:
            break
        chosen.add(p)
    return sorted(chosen)


@dataclass(frozen=True)
class MessageSpan:
    index: int
    role: str
    start: int  # token offset where the message's turn starts in the prompt
    end: int


@dataclass
class MissReport:
    ceiling: int
    achieved: int
    cause: str | None = None


def attribute_miss(prompt, spans: list[MessageSpan], achieved: int, ceiling: int, best_entry_tokens: tuple | None,
                   *, other_identity: bool, evicted_match: int, note: str | None, think_id: int | None) -> MissReport:
    """Name why a warm turn restored less than its reuse ceiling."""
    report = MissReport(ceiling, achieved)
    if achieved >= ceiling:
        return report
    if best_entry_tokens is None:
        report.cause = "identity mismatch (entries exist for another model, template or MTP mode)" if other_identity \
            else ("evicted" if evicted_match >= ceiling else "no entry")
        return report
    match = common_prefix(best_entry_tokens, prompt)
    best_entry_tokens = tuple(best_entry_tokens)
    if match < ceiling:
        if evicted_match > match:
            report.cause = f"evicted (an entry matching {evicted_match} tokens was dropped for the budget)"
            return report
        span = next((s for s in spans if s.start <= match < s.end), None)
        if span is None:
            report.cause = f"prompt diverges at token {match}"
        elif span.role == "system":
            report.cause = "system or tools changed"
        elif think_id is not None and match < len(best_entry_tokens) and best_entry_tokens[match] == think_id:
            report.cause = f"assistant[{span.index}].reasoning stripped"
        else:
            report.cause = f"{span.role}[{span.index}] re-rendered differently at token {match}"
        return report
    report.cause = note or f"no checkpoint at or below the match ({match}); restored at {achieved}"
    return report
