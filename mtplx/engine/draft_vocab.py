"""The draft vocabulary: which tokens the MTP head may propose, learned from what the model writes.

A draft step is one head layer plus the LM head over the whole vocabulary, and on a small model
the LM head is about half of it (tiny-dense: 4096 x 256 against a 256-wide layer). A model's
replies use a small share of its vocabulary, so drafts are projected onto the tokens this model
has been seen to generate. Nothing about the output changes: the verify still scores the whole
vocabulary, and a token outside the set is simply never drafted (the verify then supplies it).
Only acceptance can drop, so the set is used only once it demonstrably covers what the model
writes: after `warmup` generated tokens, once at most `on_rate` of the last `window` tokens were
ones never seen before, and until more than `off_rate` are (the gap keeps a sampling model near
the line from switching back and forth). Tokens seen since join the set at the next refresh, which
waits until they are a 64th of it: a refresh re-gathers the rows, 256 MB for 32k rows of a
4096-wide bf16 head.

Pure bookkeeping over token ids (no MLX); the runner projects onto `ids()`, the engine feeds
`observe()` with each finished reply and keeps the counts in $MTPLX_HOME across restarts. The
engine uses a set only where the LM head is most of a draft step (runner.lm_head_share): on the
embedded models (4,096 tokens, 256 wide) it is about half, and a set learned on one topic cost
more acceptance on the next than the step saved (bench/draft_vocab.py).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter, deque
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)

ROUND_TO = 256  # set sizes step in multiples of this: few distinct matmul shapes, rare refreshes
MAX_TOKENS = 32768  # a bigger set on a large vocabulary keeps the most frequent ones


class DraftVocab:
    def __init__(self, vocab_size: int, always: Iterable[int] = (), path: Path | None = None,
                 warmup: int = 1024, window: int = 1024, on_rate: float = 0.03, off_rate: float = 0.08):
        if vocab_size < 1 or warmup < 0 or window < 1 or not 0 <= on_rate <= off_rate <= 1:
            raise ValueError(f"bad draft vocabulary settings: vocab {vocab_size}, warmup {warmup}, "
                             f"window {window}, rates {on_rate} / {off_rate}")
        self.vocab_size, self.path = vocab_size, path
        self.always = sorted({t for t in always if 0 <= t < vocab_size})  # end-of-turn ids are never emitted as tokens
        self.warmup, self.on_rate, self.off_rate = warmup, on_rate, off_rate
        self.counts: Counter = Counter()
        self.context: Counter = Counter()  # prompt tokens (observe_prompt), not kept across restarts
        self.recent: deque = deque(maxlen=window)  # 1 where a generated token was new, else 0
        # Running totals, so /health reads them from another thread without iterating the above.
        self.seen, self._new = 0, 0
        self._ids: list[int] | None = None
        if path is not None:
            self._load(path)
        self._ids = self._compute()

    def ids(self) -> list[int] | None:
        """The token ids drafts are projected onto, ascending; None: the whole vocabulary."""
        return self._ids

    def observe(self, tokens: Iterable[int]) -> bool:
        """Count a finished reply's tokens; True when `ids()` changed (the runner re-projects)."""
        for t in tokens:
            if 0 <= t < self.vocab_size:
                self._remember(0 if t in self.counts else 1)
                self.counts[t] += 1
                self.seen += 1
        ids = self._compute()
        if ids == self._ids:
            return False
        self._ids = ids
        self.save()
        return True

    def observe_prompt(self, tokens: Iterable[int]) -> None:
        """Count a prompt's tokens: replies quote their context (code, names), so the set's padding
        takes the most frequent prompt tokens first. Never counted as generated: an agent's
        system prompt, resent every turn, would otherwise crowd out what the model writes."""
        self.context.update(t for t in tokens if 0 <= t < self.vocab_size)

    def _remember(self, new: int) -> None:
        if len(self.recent) == self.recent.maxlen:
            self._new -= self.recent[0]
        self.recent.append(new)
        self._new += new

    def new_rate(self) -> float | None:
        """The share of the recent tokens that had never been generated before."""
        n = len(self.recent)
        return self._new / n if n else None

    def _compute(self) -> list[int] | None:
        rate = self.new_rate()
        limit = self.on_rate if self._ids is None else self.off_rate
        if self.seen < self.warmup or rate is None or rate > limit:
            return None
        chosen = set(t for t, _ in self.counts.most_common(MAX_TOKENS)) | set(self.always)
        size = -(-len(chosen) // ROUND_TO) * ROUND_TO
        if size > self.vocab_size // 2:  # too little of the LM head saved to matter
            return None
        if self._ids is not None and len(chosen - set(self._ids)) < max(1, len(self._ids) // 64):
            return self._ids  # nearly covered: not worth a re-gather yet
        # Pad to the step size with the most frequent prompt tokens, then the lowest ids (BPE ids
        # roughly follow frequency).
        taken = chosen | set([t for t, _ in self.context.most_common(size) if t not in chosen][: size - len(chosen)])
        low = (t for t in range(self.vocab_size) if t not in taken)
        return sorted(taken | {next(low) for _ in range(size - len(taken))})

    # -- persistence ----------------------------------------------------------------------
    def as_dict(self) -> dict:
        return {"vocab_size": self.vocab_size, "counts": {str(t): n for t, n in self.counts.items()},
                "recent": list(self.recent)}

    def save(self) -> None:
        """Written whole under a temporary name, then renamed: a crash never leaves half a file.
        A failed write (full disk, a removed home) costs only what was learned since the last."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # a name of this process's own: two servers on one home learning the same model would
            # otherwise write one temporary file at once and rename a mix of both into place
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.as_dict()))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not save the draft vocabulary to %s: %s", self.path, exc)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            if data.get("vocab_size") != self.vocab_size:
                raise ValueError(f"vocab size {data.get('vocab_size')} is not {self.vocab_size}")
            counts = Counter({int(t): int(n) for t, n in data["counts"].items()})
            recent = [int(x) for x in data.get("recent", [])]
            if any(not 0 <= t < self.vocab_size or n < 1 for t, n in counts.items()) or set(recent) - {0, 1}:
                raise ValueError("token ids or counts out of range")
        except (FileNotFoundError, NotADirectoryError):
            return
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("discarding the draft vocabulary in %s (%s); it is learned again", path, exc)
            return
        self.counts = counts
        for new in recent[-self.recent.maxlen:]:
            self._remember(new)
        self.seen = sum(counts.values())
