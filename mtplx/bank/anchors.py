"""Anchor positions in a prompt: where a restore may land, found from the tokens alone.

Kinds: "head" (end of the system/tools turn), "system" (inside it, where the system text ends and
a tool list begins: bank/system_end.py), "message" (end of each complete turn, by the
template's own turn markers, or where the next role token opens a message: see markers.py), "prompt_end", "generation_end", and a fixed "grid"
fallback. The planner knows token lists and
anchors, never text or arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mtplx.bank.markers import Markers  # noqa: F401  (re-exported: callers import it from here)

HEAD, MESSAGE, PROMPT_END, GENERATION_END, GRID = "head", "message", "prompt_end", "generation_end", "grid"
SYSTEM = "system"
KINDS = (HEAD, SYSTEM, MESSAGE, PROMPT_END, GENERATION_END, GRID)


class Anchor(NamedTuple):  # a tuple, not a dataclass: prompts carry hundreds and planning is hot
    position: int  # tokens before the anchor
    kind: str


def as_tokens(tokens) -> np.ndarray:
    """Token ids as an int array (once per prompt: every scan after this runs in C)."""
    if isinstance(tokens, np.ndarray):
        return tokens
    return np.fromiter(tokens, dtype=np.int64, count=len(tokens))


def turn_starts(prompt, markers: Markers) -> list[int]:
    """Positions where a turn opens (for role-token templates, where a message's span starts; one
    may equal len(prompt): a prompt ending in a closing token opens the reply right after it)."""
    arr = as_tokens(prompt)
    if not markers.roles:
        return [] if markers.turn_start is None else np.flatnonzero(arr == markers.turn_start).tolist()
    hit = np.isin(arr, markers.opens)
    for a, b in markers.joined:  # the second token of one opening is no opening of its own
        hit[1:] &= ~((arr[:-1] == a) & (arr[1:] == b))
    starts = set(np.flatnonzero(hit).tolist())
    if markers.after:
        starts.update((np.flatnonzero(np.isin(arr, markers.after)) + 1).tolist())
    return sorted(starts)


def turn_ends(prompt, markers: Markers) -> list[int]:
    """Positions just after each turn's closing token (and its newline), i.e. complete-turn ends.
    A role-token template closes a turn where the next one opens (the first opener after BOS
    closes nothing)."""
    if markers.roles:
        return [p for p in turn_starts(prompt, markers) if p > markers.preamble]
    if markers.turn_end is None:
        return []
    arr = as_tokens(prompt)
    ends = np.flatnonzero(arr == markers.turn_end) + 1
    if markers.newline is not None and ends.size:
        inside = ends < len(arr)
        ends[inside] += arr[ends[inside]] == markers.newline
    return ends.tolist()


def head_end(prompt, markers: Markers, ends: list[int]) -> int | None:
    """End of the leading system turn, when the prompt opens with one (after at most a BOS token).
    A role-token template's bare system prompt ends where the first message opens."""
    if markers.roles:
        starts = turn_starts(prompt, markers) if markers.system_bare else []
        return starts[0] if starts and starts[0] > markers.preamble else None
    if markers.turn_start is None or not markers.system or len(prompt) < 2 or not ends:
        return None
    first = 0 if prompt[0] == markers.turn_start else 1 if prompt[1] == markers.turn_start else None
    if first is None or tuple(int(t) for t in prompt[first + 1 : first + 1 + len(markers.system)]) != markers.system:
        return None
    return next((e for e in ends if e > first), None)


def prompt_anchors(prompt, markers: Markers, *, min_restore: int = 32, grid: int = 1024) -> list[Anchor]:
    """Every anchor of a prompt, sorted by position (one kind per position, the most specific)."""
    arr = as_tokens(prompt)
    ends = turn_ends(arr, markers)
    head = head_end(arr, markers, ends)
    found: dict[int, str] = {p: GRID for p in range(grid, len(prompt), grid)}
    found.update({p: MESSAGE for p in ends if p <= len(prompt)})
    if head is not None and head >= min_restore:
        found[head] = HEAD
    # The last prompt token is left for the forward that yields the first generated token, so an
    # identical resend restores at len - 1: that is where the prompt-end state is kept.
    found[len(prompt) - 1] = PROMPT_END
    return [Anchor(p, k) for p, k in sorted(found.items()) if p >= min_restore or k == PROMPT_END]
