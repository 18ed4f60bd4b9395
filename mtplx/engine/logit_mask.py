"""A history-free rule (no tools: the call token banned; a logit bias) as one vector added to logits.

Such a rule sets or shifts given ids' logits the same way at every position whatever came
before, so its effect is `logits + v` with `v = rule(0)`: -inf where it bans, the bias where it
shifts, 0 elsewhere (x + 0 is x). As a vector it costs one add per use, where the ban was a copy of
the logits and a write per id; and it narrows: a draft over the draft vocabulary (draft_vocab.py)
takes `v` at those ids. Before, a turn without tools drafted from the whole LM head (the rule read
all of it), which on a real checkpoint's 150k-row head is most of a draft step.
"""

from __future__ import annotations

import mlx.core as mx


class LogitMask:
    def __init__(self, rule):
        if not rule.history_free:
            raise ValueError("only a history-free rule is the same vector at every position")
        self.rule = rule
        self._vectors: dict[int, mx.array] = {}  # by vocabulary width
        self._narrow: tuple = (None, None)  # (the ids array it was taken at, v at them)

    def vector(self, width: int) -> mx.array:
        if width not in self._vectors:
            vector = self.rule.apply(mx.zeros((width,), dtype=mx.float32), ())
            mx.eval(vector)
            self._vectors[width] = vector
        return self._vectors[width]

    def __call__(self, logits: mx.array) -> mx.array:
        """The rule applied to logits of any leading shape (last axis: the whole vocabulary)."""
        return logits + self.vector(logits.shape[-1]).astype(logits.dtype)

    def over(self, ids: mx.array, width: int) -> mx.array:
        """`v` at the vocabulary rows `ids` (the runner's draft ids) of a `width`-row vocabulary."""
        if self._narrow[0] is not ids:
            self._narrow = (ids, self.vector(width)[ids])
        return self._narrow[1]

    def on_drafts(self, logits: mx.array, runner) -> mx.array:
        """The rule on `runner.draft_logits`: over the draft vocabulary where the runner drafts
        from one (any leading shape)."""
        if runner.draft_ids is None:
            return self(logits)
        return logits + self.over(runner.draft_ids, runner.vocab_rows).astype(logits.dtype)

    def draft_vector(self, runner) -> mx.array:
        """`v` over the rows drafts are chosen from: the draft vocabulary's, or the whole LM head's."""
        if runner.draft_ids is None:
            return self.vector(runner.vocab_rows)
        return self.over(runner.draft_ids, runner.vocab_rows)
