"""Per-request generation statistics, counted while the request runs: speculation acceptance by
depth and by segment, the time split, and how the request shared the engine with others (the
scheduler counts those: its wait for admission, its rounds in a batch, the other requests' work
between its rounds). `freeze` gives the typed record the Finished event carries."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtplx.engine.segments import SEGMENTS
from mtplx.events import RequestStats


@dataclass
class GenerationStats:
    mode: str = "ar"  # "ar" or "mtp"
    depth: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    verify_calls: int = 0
    drafted_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    drafted_by_segment: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SEGMENTS, 0))
    accepted_by_segment: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SEGMENTS, 0))
    tokens_by_segment: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SEGMENTS, 0))
    prefill_s: float = 0.0
    mtp_prefill_s: float = 0.0  # the MTP head's KV over the prompt, computed after the first token
    draft_s: float = 0.0
    verify_s: float = 0.0
    sample_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float | None = None
    predicted_drafted: int = 0  # predicted-output tokens verified (engine/prediction.py)
    predicted_accepted: int = 0  # ... and kept
    # Sharing the engine: why a turn beside others was slower than alone (scheduler.py counts them)
    queued_s: float = 0.0  # submitted -> admitted (max_batch or the memory budget full)
    rounds: int = 0  # decode rounds after the first token (MTP verifies or AR steps)
    batched_rounds: int = 0  # ... of which as one row of a batch
    batch_rows: int = 0  # the rows of its batch, summed over those rounds
    others_s: float = 0.0  # while it decoded: the engine's time on other requests (their prompt
    #   chunks, other decode groups), between its rounds

    def __post_init__(self):
        if not self.drafted_by_depth:
            self.drafted_by_depth = [0] * self.depth
            self.accepted_by_depth = [0] * self.depth

    def record_verify(self, drafted_segments: list[str], accepted: int) -> None:
        """One verify over len(drafted_segments) drafts, of which the first `accepted` were kept."""
        self.verify_calls += 1
        for i, segment in enumerate(drafted_segments):
            self.drafted_by_depth[i] += 1
            self.drafted_by_segment[segment] += 1
            if i < accepted:
                self.accepted_by_depth[i] += 1
                self.accepted_by_segment[segment] += 1

    @property
    def tau(self) -> float | None:
        """Tokens produced per verify forward (accepted drafts + the one the verify samples)."""
        if not self.verify_calls:
            return None
        return (sum(self.accepted_by_depth) + self.predicted_accepted + self.verify_calls) / self.verify_calls

    @property
    def acceptance_by_depth(self) -> list[float | None]:
        return [a / d if d else None for a, d in zip(self.accepted_by_depth, self.drafted_by_depth)]

    @property
    def rows_mean(self) -> float | None:
        """Requests decoding together with it per round, itself included (1.0: always alone)."""
        if not self.rounds:
            return None
        return (self.batch_rows + self.rounds - self.batched_rounds) / self.rounds

    @property
    def decode_tps(self) -> float | None:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else None

    @property
    def prefill_tps(self) -> float | None:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_s if self.prefill_s > 0 and computed > 0 else None

    def freeze(self) -> RequestStats:
        """The statistics as they stand, for the Finished event (a copy: this goes on counting)."""
        counted = {k: tuple(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
                   for k, v in vars(self).items()}
        return RequestStats(**counted, tau=self.tau, acceptance_by_depth=tuple(self.acceptance_by_depth),
                            decode_tps=self.decode_tps, prefill_tps=self.prefill_tps, rows_mean=self.rows_mean)
