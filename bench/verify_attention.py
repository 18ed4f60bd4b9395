"""A verify's attention through MLX's kernel vs mtplx's vectorised path, side by side in one process.

    python bench/verify_attention.py [--models tiny-dense tiny-hybrid] [--contexts 100 300 700] [--rounds 120]

On the CPU fast path, attention calls of 2-16 queries below the few-row C entry (a verify, four
sessions' batched verify) take cpu_attention.vectorised at any context; the other arm keeps MLX's
kernel for them (`cpu_attention.SHORT = False`). Two figures:
- the call alone, at a verify's and a 4-row batch's shapes (4 query heads on 2 key heads): medians
  of the two arms called alternately;
- MTP rounds at depth 3 on the model: rows prefilled at the given context, then round after round
  on the same rows with the arm switched every round (one row alone, and four rows as one batch),
  so both arms decode the same text at the same context (which grows by the rounds' tokens:
  ~700 over the default 120 rounds of each arm); the median of the per-round ratios.
AR decode (one query) keeps MLX's kernel under both arms. Prints ratios MLX / vectorised (above 1:
the vectorised path faster); speed is never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtplx.catalog import resolve  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402

import mlx.core as mx  # noqa: E402  (after mtplx: its fast path loads MKL first)

from mtplx.engine import cpu_attention  # noqa: E402

ARMS = ("mlx", "vectorised")
FILLER = " ".join(f"line {i}: the ledger keeps every event in order, and the replay reads it back." for i in range(1500))
QUESTIONS = ["Explain src/ledger/events.py and how the replay uses it", "List the tests of the parser module",
             "Why does the build fail on the release branch?", "Rename the helper in utils and update every caller"]


def use(arm: str) -> None:
    cpu_attention.SHORT = arm == "vectorised"


def calls(engine: Engine, reps: int) -> list[tuple[str, dict]]:
    """The attention call alone, both arms alternately, under the engine's small-step settings."""
    def measure():
        rows = []
        with engine.runner.small_forwards():
            for B, L, S in ((1, 4, 100), (1, 4, 300), (1, 4, 700), (4, 4, 100), (4, 4, 300)):
                q, k, v = mx.random.normal((B, 4, L, 64)), mx.random.normal((B, 2, S, 64)), mx.random.normal((B, 2, S, 64))
                mx.eval(q, k, v)
                got = {arm: [] for arm in ARMS}
                for _ in range(reps):
                    for arm in ARMS:
                        use(arm)
                        t = time.perf_counter()
                        mx.eval(cpu_attention.attention(q, k, v, scale=0.125, mask="causal"))
                        got[arm].append(time.perf_counter() - t)
                rows.append((f"{B} row(s) x {L} queries over {S} keys", {a: statistics.median(got[a][5:]) for a in ARMS}))
        use("vectorised")
        return rows
    return engine.call(measure)


def rounds(engine: Engine, context: int, count: int) -> dict[int, tuple[dict, float]]:
    """Per row count: ({arm: median round s}, median of per-round mlx/vectorised ratios)."""
    from mtplx.engine.batch import DecodeBatch
    from mtplx.engine.generation import Generation, StartPoint

    tok = engine.checkpoint.tokenizer

    def prompt(i: int) -> tuple[int, ...]:
        ids = tok.apply_chat_template([{"role": "system", "content": FILLER}, {"role": "user", "content": QUESTIONS[i]}],
                                      add_generation_prompt=True)
        return tuple(ids[-(context + 7 * i):])

    def measure():
        out = {}
        for rows in (1, 4):
            gens = []
            for i in range(rows):
                gen = Generation(engine.runner, GenerationRequest(prompt(i), SamplingParams(max_tokens=8 * count, ignore_eos=True)),
                                 use_mtp=True, depth=3, chunk_size=engine.config.chunk_size, eos_ids=engine.eos_ids,
                                 submitted_at=0.0)
                for _ in gen.prefill(StartPoint(), (), None):
                    pass
                list(gen.first_token())
                gens.append(gen)
            batch = DecodeBatch(engine.runner, gens) if rows > 1 else None
            times = {arm: [] for arm in ARMS}
            for _ in range(count):
                for arm in ARMS:
                    use(arm)
                    t = time.perf_counter()
                    if batch is None:
                        list(gens[0].step())
                    else:
                        for gen, result in zip(gens, batch.step()):
                            list(gen.take_round(*result))
                    times[arm].append(time.perf_counter() - t)
            if batch is not None:
                batch.release()
            use("vectorised")
            kept = {arm: t[10:] for arm, t in times.items()}
            out[rows] = ({arm: statistics.median(t) for arm, t in kept.items()},
                         statistics.median(a / b for a, b in zip(kept["mlx"], kept["vectorised"])))
        return out
    return engine.call(measure)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[100, 300, 700])
    ap.add_argument("--rounds", type=int, default=120)
    args = ap.parse_args()
    for name in args.models:
        engine = Engine(resolve(name), EngineConfig(use_mtp=True), name=name).start()
        try:
            compute = str(engine.runner.checkpoint.extras.get("compute"))
            if not compute.startswith("cpu fp32"):
                print(f"{name}: not on the CPU fp32 path ({compute}): nothing to compare")
                continue
            print(f"\n{name}: the call alone (median ms, MLX / vectorised)")
            for label, t in calls(engine, 200):
                print(f"  {label:<40} {t['mlx'] * 1e3:7.3f} {t['vectorised'] * 1e3:7.3f}   {t['mlx'] / t['vectorised']:.2f}x")
            print(f"{name}: MTP rounds at depth 3 (median ms, MLX / vectorised, median of per-round ratios)")
            for context in args.contexts:
                for rows, (t, paired) in rounds(engine, context, args.rounds).items():
                    print(f"  {context:>5} tokens of context, {rows} row(s) {t['mlx'] * 1e3:7.2f} {t['vectorised'] * 1e3:7.2f}   "
                          f"{paired:.3f}x")
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
