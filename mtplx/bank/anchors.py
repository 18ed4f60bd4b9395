"""Anchor positions in a prompt: where a restore may land, found from the tokens alone.

Kinds: "head" (end of the system/tools turn), "message" (end of each complete ChatML turn),
"prompt_end", "generation_end", and a fixed "grid" fallback. The planner knows token lists and
anchors, never text or arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

HEAD, MESSAGE, PROMPT_END, GENERATION_END, GRID = "head", "message", "prompt_end", "generation_end", "grid"
KINDS = (HEAD, MESSAGE, PROMPT_END, GENERATION_END, GRID)


class Anchor(NamedTuple):  # a tuple, not a dataclass: prompts carry hundreds and planning is hot
    position: int  # tokens before the anchor
    kind: str


def as_tokens(tokens) -> np.ndarray:
    """Token ids as an int array (once per prompt: every scan after this runs in C)."""
    if isinstance(tokens, np.ndarray):
        return tokens
    return np.fromiter(tokens, dtype=np.int64, count=len(tokens))


@dataclass(frozen=True)
class Markers:
    """Token ids of the ChatML structure (None where the tokenizer lacks them)."""

    im_start: int | None
    im_end: int | None
    newline: int | None
    system: tuple[int, ...] = ()

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "Markers":
        vocab = tokenizer.get_vocab()
        nl = tokenizer.encode("\n", add_special_tokens=False)
        return cls(vocab.get("<|im_start|>"), vocab.get("<|im_end|>"), nl[0] if len(nl) == 1 else None,
                   tuple(tokenizer.encode("system", add_special_tokens=False)))


def turn_ends(prompt, markers: Markers) -> list[int]:
    """Positions just after each `<|im_end|>` (and its newline), i.e. complete-turn ends."""
    if markers.im_end is None:
        return []
    arr = as_tokens(prompt)
    ends = np.flatnonzero(arr == markers.im_end) + 1
    if markers.newline is not None and ends.size:
        inside = ends < len(arr)
        ends[inside] += arr[ends[inside]] == markers.newline
    return ends.tolist()


def head_end(prompt, markers: Markers, ends: list[int]) -> int | None:
    """End of the leading system turn, when the prompt opens with one."""
    if markers.im_start is None or len(prompt) == 0 or prompt[0] != markers.im_start or not ends:
        return None
    if tuple(int(t) for t in prompt[1 : 1 + len(markers.system)]) != markers.system:
        return None
    return ends[0]


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
