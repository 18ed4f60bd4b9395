"""The cost model of MTP speculation: measured step costs in, the speedup of each depth out.

A round at depth k drafts k tokens (k MTP head steps, each with its logits and argmax) and runs
one trunk forward over k+1 tokens; it yields tau(k) = 1 + a_1 + ... + a_k tokens, where a_i is
the share of rounds whose first i drafts were all kept (`accepted_by_depth / drafted_by_depth`
of a depth >= k run: greedy drafts are the same chain whatever the depth, so one run at the
deepest depth gives every shallower tau). An autoregressive step costs c(1) + h, so

    MTP/AR(k) = tau(k) * (c(1) + h) / (k * draft + c(k+1) + h)

where h is the engine's own time per decode step outside the forward and the pick (events, text,
stops): `host_per_step` reads it from an AR request's statistics. A draft step measured alone
pays a host sync the real round does not (its drafts chain lazily into the verify), so `measure`
also times whole Speculator rounds, and the prediction uses round(k) + h where it has it.
Costs are measured on the engine thread, with a cache holding `prompt`, through the same runner
calls decoding makes (compiled steps, one MKL thread); the caches are rolled back after each.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from mtplx.state.cache_layers import flat

MAX_DEPTH = 4
# A deeper depth must be predicted more than this much faster to be chosen. Its gain rests on the
# acceptance of the deepest drafts, which varies most with what is being written (the tuner's
# prompts are not the user's), and its verify multiplies rows in a batch of sessions, a cost this
# single-sequence model leaves out. Seen here: the hybrid's depth 4, predicted 1.4% faster than
# depth 3, served at 0.99-1.09x over four benchmark runs while depth 3 served at 1.02-1.37x.
SHALLOWER_WITHIN = 0.05


@dataclass(frozen=True)
class StepCosts:
    forward: dict[int, float]  # seconds of a trunk forward over t tokens (with logits and argmax), t = 1..MAX_DEPTH+1
    draft: float  # seconds of one MTP head step (with logits and argmax)
    host: float = 0.0  # seconds per decode step outside the forwards (see host_per_step)
    # seconds of one whole round at depth k as the Speculator runs it (drafts chained lazily into
    # the verify, one sync); when given, the prediction uses it instead of k * draft + c(k+1)
    rounds: dict[int, float] = field(default_factory=dict)

    def __post_init__(self):
        missing = [t for t in range(1, MAX_DEPTH + 2) if t not in self.forward]
        if missing or self.draft <= 0 or self.host < 0 or any(v <= 0 for v in self.forward.values()):
            raise ValueError(f"step costs need positive c(1..{MAX_DEPTH + 1}) and draft cost and host >= 0, got {self}")

    def with_host(self, host: float) -> "StepCosts":
        return replace(self, host=max(0.0, host))

    def round_s(self, k: int) -> float:
        return self.rounds.get(k, k * self.draft + self.forward[k + 1]) + self.host

    def chained_draft(self, k: int) -> float | None:
        """A draft step's share of a measured round: (round(k) - c(k+1)) / k."""
        return (self.rounds[k] - self.forward[k + 1]) / k if k in self.rounds else None

    def tau(self, k: int, acceptance: list[float]) -> float:
        if len(acceptance) < k:
            raise ValueError(f"acceptance by depth has {len(acceptance)} entries, depth {k} needs {k}")
        return 1.0 + sum(acceptance[:k])

    def speedup(self, k: int, acceptance: list[float]) -> float:
        """Predicted MTP/AR decode speed at depth k."""
        return self.tau(k, acceptance) * (self.forward[1] + self.host) / self.round_s(k)

    def best_depth(self, acceptance: list[float]) -> int | None:
        """The shallowest depth predicted within SHALLOWER_WITHIN of the fastest, or None when no
        depth beats autoregressive decoding."""
        depths = range(1, min(MAX_DEPTH, len(acceptance)) + 1)
        speed = {k: self.speedup(k, acceptance) for k in depths}
        fastest = max(speed.values(), default=0.0)
        if fastest <= 1.0:
            return None
        return min(k for k in depths if speed[k] * (1 + SHALLOWER_WITHIN) >= fastest)


def host_per_step(stats) -> float:
    """Seconds per AR step outside the forward and the pick, from a finished AR request's stats."""
    if stats.mode != "ar" or not stats.completion_tokens:
        raise ValueError(f"host time per step needs an AR request with tokens, got mode {stats.mode!r}")
    return max(0.0, (stats.decode_s - stats.verify_s - stats.sample_s) / stats.completion_tokens)


def median_of(runs: list[StepCosts]) -> StepCosts:
    """Each cost the median over several measurements (host from the first; set it after)."""
    med = statistics.median
    return StepCosts({t: med(r.forward[t] for r in runs) for t in runs[0].forward}, med(r.draft for r in runs),
                     rounds={k: med(r.rounds[k] for r in runs) for k in runs[0].rounds})


def measure(runner, prompt: list[int], reps: int = 15) -> StepCosts:
    """Median step costs after `prompt` is cached. Call on the engine thread."""
    cache = runner.new_trunk_cache()
    hidden = runner.hidden(prompt, cache)
    head = runner.new_mtp_cache()
    if head is not None:
        runner.extend_head(hidden[:, :-2], prompt[1:-1], head)
    mx.eval(hidden, [c.state for c in cache], head.state if head is not None else [])
    times: dict = {t: [] for t in range(1, MAX_DEPTH + 2)} | {"draft": []} | {("round", k): [] for k in range(1, MAX_DEPTH + 1)}
    with runner.small_forwards():
        for _ in range(reps):  # interleaved, so a noisy moment hits every size alike
            for t in range(1, MAX_DEPTH + 2):
                saved = _recurrent(cache)
                start = time.perf_counter()
                mx.eval(mx.argmax(runner.logits(runner.hidden(prompt[-t:], cache)), axis=-1))
                times[t].append(time.perf_counter() - start)
                _roll_back(cache, saved, t)
            if head is None:
                continue
            start = time.perf_counter()
            mx.eval(mx.argmax(runner.logits(runner.draft_hidden(hidden[:, -2:-1], prompt[-1:], head)), axis=-1))
            times["draft"].append(time.perf_counter() - start)
            head.trim(1)
            for k in range(1, MAX_DEPTH + 1):
                times[("round", k)].append(_round(runner, cache, head, hidden[:, -2:-1], prompt[-1], k))
    if head is None:
        return StepCosts({t: statistics.median(times[t]) for t in range(1, MAX_DEPTH + 2)}, float("inf"))
    return StepCosts({t: statistics.median(times[t]) for t in range(1, MAX_DEPTH + 2)}, statistics.median(times["draft"]),
                     rounds={k: statistics.median(times[("round", k)]) for k in range(1, MAX_DEPTH + 1)})


def _round(runner, cache: list, head, pending: mx.array, first: int, k: int) -> float:
    """Seconds of one real Speculator round at depth k (greedy), then both caches rolled back."""
    from mtplx.engine.sampling import Sampler, SamplingParams
    from mtplx.engine.speculation import Speculator
    from mtplx.engine.stats import GenerationStats

    state = SimpleNamespace(trunk=cache, mtp=head, tokens=[], length=0)
    speculator = Speculator(runner, Sampler(SamplingParams(seed=0)), state, pending, first,
                            GenerationStats(mode="mtp", depth=k))
    saved = _recurrent(cache)
    start = time.perf_counter()
    speculator.round(k)
    elapsed = time.perf_counter() - start
    _roll_back(cache, saved, state.length)
    head.trim(1)  # the pending pair the round fed (its k-1 draft entries are trimmed by the round)
    return elapsed


def _recurrent(cache: list) -> list:
    return [list(c.cache) if isinstance(c, ArraysCache) else None for c in flat(cache)]


def _roll_back(cache: list, saved: list, t: int) -> None:
    for layer, arrays in zip(flat(cache), saved):
        if isinstance(layer, KVCache):
            layer.trim(t)
        elif arrays is not None:
            layer.cache = arrays
