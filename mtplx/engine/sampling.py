"""Sampling settings and the distributions speculation needs.

Temperature 0 is greedy. Otherwise logits are scaled, filtered (top-k, top-p, min-p) and
normalised; the *same* transform is applied to draft logits, so rejection sampling against the
filtered target distribution is exact.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx

from mtplx.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 512
    stop: tuple[str, ...] = field(default_factory=tuple)
    repetition_penalty: float = 1.0  # 1.0 = off
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time it was generated
    ignore_eos: bool = False  # generate max_tokens whatever the model says (fixed-length benchmarks)
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, bias in [-100, 100]) pairs
    logprobs: int | None = None  # report each drawn token's log-probability and this many alternatives

    def __post_init__(self):
        checks = [
            (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and 0 <= self.temperature <= 100, "temperature", "a finite number in [0, 100]"),
            (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0"),
            (isinstance(self.min_p, (int, float)) and 0 <= self.min_p < 1, "min_p", "in [0, 1)"),
            (self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and -(2**63) <= self.seed < 2**64), "seed", "an integer in [-2**63, 2**64)"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty <= 10, "repetition_penalty", "in (0, 10]"),
            (isinstance(self.presence_penalty, (int, float)) and -2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]"),
            (isinstance(self.frequency_penalty, (int, float)) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]"),
            (all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16, "stop", "up to 16 non-empty strings"),
            (isinstance(self.ignore_eos, bool), "ignore_eos", "a boolean"),
            (isinstance(self.logit_bias, tuple) and len(self.logit_bias) <= 1024
             and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and isinstance(b, (int, float))
                     and math.isfinite(b) and -100 <= b <= 100 for t, b in self.logit_bias),
             "logit_bias", "up to 1,024 (token id, bias in [-100, 100]) pairs"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                       and 0 <= self.logprobs <= 20), "logprobs", "None or an integer in [0, 20]"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise RequestError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """A penalty makes each position's distribution depend on the tokens before it in the
        reply, drafts included: such requests decode autoregressively."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """The filtered sampling distribution over the last axis (float32), for temperature > 0."""
    logits = logits.astype(mx.float32) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = mx.sort(logits, axis=-1)[..., -params.top_k][..., None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if params.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_p = mx.take_along_axis(probs, order, axis=-1)
        before = mx.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
        keep_sorted = before < params.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
    if params.min_p > 0:
        probs = mx.where(probs < params.min_p * probs.max(axis=-1, keepdims=True), 0.0, probs)
    return probs / probs.sum(axis=-1, keepdims=True)


def apply_repetition_penalty(logits: mx.array, context: list[int], penalty: float) -> mx.array:
    if penalty == 1.0 or not context:
        return logits
    ids = mx.array(sorted(set(context)))
    picked = logits[..., ids]
    logits[..., ids] = mx.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def apply_penalties(logits: mx.array, params: SamplingParams, prompt, generated: list[int]) -> mx.array:
    """The request's penalties on one position's logits: the repetition penalty over prompt and
    reply (as mlx-lm and vLLM apply it), presence and frequency over the reply (OpenAI's and
    vLLM's: logit - presence * [seen] - frequency * count)."""
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, list(prompt) + generated, params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and generated:
        counts = Counter(generated)
        ids = mx.array(list(counts))
        times = mx.array(list(counts.values()), dtype=mx.float32)
        logits = logits.astype(mx.float32)
        logits[..., ids] = logits[..., ids] - (params.presence_penalty + params.frequency_penalty * times)
    return logits


class Sampler:
    """Draws tokens for one request; seeded requests draw the same tokens every time."""

    def __init__(self, params: SamplingParams):
        self.params = params
        # A negative (int64) seed is taken as its two's-complement bits: every allowed seed is a distinct key.
        seed = params.seed % 2**64 if params.seed is not None else mx.random.randint(0, 2**31 - 1, ()).item()
        self.key = mx.random.key(seed)

    def _next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def draw(self, probs: mx.array) -> int:
        return int(mx.random.categorical(mx.log(probs), key=self._next_key()).item())

    def uniform(self) -> float:
        return float(mx.random.uniform(key=self._next_key()).item())

    def pick(self, logits: mx.array) -> int:
        """One token from raw logits (greedy at temperature 0)."""
        if self.params.greedy:
            return int(mx.argmax(logits, axis=-1).item())
        return self.draw(probabilities(logits, self.params))
