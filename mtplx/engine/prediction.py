"""Predicted output (OpenAI's `prediction`): text the client expects most of the reply to repeat,
such as a file rewritten with a small edit. It serves as drafts: where the reply follows it, a
verify takes up to DEPTH of its tokens in one trunk forward, where MTP would draft a few.
Acceptance is the speculator's (exact), so a prediction changes speed only, never the output.

Alignment is pure over token lists. The reply is followed along the prediction while it matches.
Where it leaves the prediction (the edit), the last NGRAM tokens are looked up in the rest of it,
and drafting resumes where the reply rejoins. Until then MTP drafts, as without a prediction.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

DEPTH = 16  # predicted tokens one verify may take
NGRAM = 3  # reply tokens that must match to rejoin the prediction (fewer match by chance)


class Prediction:
    def __init__(self, ids: Sequence[int]):
        self.ids = tuple(int(i) for i in ids)
        self.at: int | None = 0  # where in the prediction the reply's next token should be
        self.seen = 0  # reply tokens accounted for by `at`
        self._where: dict[tuple[int, ...], list[int]] | None = None  # each NGRAM's ends, built once

    def drafts(self, reply: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens the prediction says come after `reply` (none when the reply is
        off the prediction)."""
        new = list(reply[self.seen:])
        self.seen = len(reply)
        if self.at is not None and tuple(new) == self.ids[self.at:self.at + len(new)]:
            self.at += len(new)
        else:
            self.at = self._rejoin(reply, self.at or 0)
        if self.at is None:
            return []
        return list(self.ids[self.at:self.at + min(limit, DEPTH)])

    def _rejoin(self, reply: Sequence[int], after: int) -> int | None:
        """Where the prediction continues the reply's last NGRAM tokens: the first match at or
        after `after` (the reply moves forward through the prediction), else the first anywhere;
        None when they are not in it. An index of the prediction's n-grams, built on the first
        miss, keeps each lookup constant-time however long the prediction (a whole file)."""
        if len(reply) < NGRAM:
            return None
        if self._where is None:
            self._where = {}
            for i in range(len(self.ids) - NGRAM + 1):
                self._where.setdefault(self.ids[i:i + NGRAM], []).append(i + NGRAM)
        found = self._where.get(tuple(reply[-NGRAM:]))
        if not found:
            return None
        return found[bisect_left(found, after)] if found[-1] >= after else found[0]
