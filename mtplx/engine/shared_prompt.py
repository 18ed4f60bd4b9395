"""Requests that wait to share a prompt another request is computing.

Why: agents start several turns at once over one new prompt head (Claude Code's or OpenCode's
parallel subagents: one system prompt and tool list, each its own task). The bank holds a turn
only once it is computed, so each of them planned its restore before any had computed anything,
and all prefilled the same head side by side: n times the work, and each first token late by
that much. Instead, a queued request whose prompt shares at least SHARE_FROM tokens (beyond what
that request restored from the bank) with a request still prefilling waits until that prefill has
passed the shared part (it would have computed that much itself). Once the other turn has
computed the shared part (its prefill is past it, or it decodes), the request is admitted: the
engine first keeps that turn's prompt up to there in the bank (bank_executor.share_running), and
the request restores it at its last restorable point inside the shared part and prefills only
its own rest.

Pure functions over token lists (no MLX); the engine holds the queue and the sequences.
"""

from __future__ import annotations

from typing import Sequence

SHARE_FROM = 256  # shared tokens worth waiting for: less is a few prefill chunks, cheaper than waiting


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share (slice comparisons, a binary search: C speed
    for agent-length prompts)."""
    lo, hi = 0, min(len(a), len(b))
    if tuple(a[:hi]) == tuple(b[:hi]):
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo], a[:hi + 1] != b[:hi + 1]
        mid = (lo + hi + 1) // 2
        if tuple(a[:mid]) == tuple(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def wait_for(prompt: Sequence[int], other: Sequence[int], other_restored: int, share_from: int = SHARE_FROM) -> int:
    """How much of `other`'s prompt (being prefilled; it restored `other_restored` tokens from the
    bank, which a request over `prompt` can restore as well) that request should wait for: their
    shared prefix, or 0 where that is not worth waiting for."""
    shared = common_prefix(prompt, other)
    return shared if shared - other_restored >= share_from else 0
