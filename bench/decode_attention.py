"""Decode-side attention: the C kernel's few-row entry vs MLX's path, side by side in one process.

    python bench/decode_attention.py [--models tiny-dense tiny-hybrid] [--contexts 1000 3000 7000] [--rounds 2]
                                     [--parts calls model batch]

1. The call alone: 4 query heads over 2 key heads of 64, one query (a decode step) and four (a
   depth-3 verify) over 300 to 8k keys, ms per call: MLX's path as mtplx routes it without the
   entry (`cpu_attention.FEW = False`) and the entry (which also pays its sync, `_fused`).
2. The model: step costs (engine/step_costs.py: a trunk forward over 1, 2 and 4 tokens, a draft
   step, whole MTP rounds at depths 1-4) after a prompt of each context length, with the entry
   forced on (FEW_FROM_KEYS = 0) and off, alternating, medians over `--rounds`. The default
   threshold (cpu_attention.FEW_FROM_KEYS) sits where the two cross.
3. A batch: four rows decoding together at each context (one long row beside three short ones,
   and four long rows), its attention row by row through the entry (what mtplx does past the
   threshold: each row exactly as alone) against one masked call over the longest row, alternating.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mtplx import fast_path  # noqa: E402  (before MLX: the fast path)


def calls_alone(reps: int = 200) -> None:
    import mlx.core as mx

    from mtplx.engine import cpu_attention as ca

    print("one attention call (4 heads over 2 key heads of 64; ms, median of %d):" % reps)
    print(f"  {'keys':>5} {'queries':>7} {'mlx':>7} {'few':>7} {'ratio':>6}")
    saved = ca.FEW_FROM_KEYS
    ca.FEW_FROM_KEYS = 0
    try:
        for keys in (300, 700, 1500, 3000, 8000):
            buffer = mx.random.normal((1, 2, keys + 256, 64))  # a cache: the keys are a slice of it
            k, v = buffer[:, :, :keys], (buffer * 0.5)[:, :, :keys]
            mx.eval(k, v)
            for queries in (1, 4):
                q = mx.random.normal((1, 4, queries, 64))
                mx.eval(q)
                mask = "causal" if queries > 1 else None
                times = {}
                for name, few in (("mlx", False), ("few", True)):
                    ca.FEW = few
                    mx.eval(ca.attention(q, k, v, scale=0.125, mask=mask))
                    samples = []
                    for _ in range(reps):
                        start = time.perf_counter()
                        mx.eval(ca.attention(q, k, v, scale=0.125, mask=mask))
                        samples.append(time.perf_counter() - start)
                    times[name] = statistics.median(samples) * 1000
                print(f"  {keys:>5} {queries:>7} {times['mlx']:7.3f} {times['few']:7.3f} {times['few'] / times['mlx']:6.2f}")
    finally:
        ca.FEW, ca.FEW_FROM_KEYS = True, saved


def model_costs(model: str, contexts: list[int], rounds: int) -> None:
    from mtp import prompts
    from mtplx.catalog import resolve
    from mtplx.engine import cpu_attention as ca
    from mtplx.engine import step_costs
    from mtplx.engine.engine import Engine, EngineConfig

    engine = Engine(resolve(model), EngineConfig(), name=model).start()
    saved = ca.FEW_FROM_KEYS
    try:
        tokens = [t for p in prompts(engine.checkpoint.tokenizer, 40) for t in p]
        print(f"\n{model}: step costs after a prompt of n tokens (ms; medians of {rounds} rounds, arms alternating)")
        print(f"  {'n':>5} {'arm':<4} {'c(1)':>6} {'c(2)':>6} {'c(4)':>6} {'draft':>6} {'round d1':>8} {'d2':>6} {'d3':>6} {'d4':>6}")
        for n in contexts:
            runs: dict = {False: [], True: []}
            for r in range(rounds):
                for few in ((False, True) if r % 2 == 0 else (True, False)):
                    ca.FEW, ca.FEW_FROM_KEYS = few, 0
                    runs[few].append(engine.call(lambda: step_costs.measure(engine.runner, tokens[:n], reps=10)))
            med = {few: step_costs.median_of(cs) for few, cs in runs.items()}
            for few in (False, True):
                c = med[few]
                print(f"  {n:>5} {'few' if few else 'mlx':<4} " + " ".join(f"{c.forward[t] * 1000:6.2f}" for t in (1, 2, 4))
                      + f" {c.draft * 1000:6.2f} " + " ".join(f"{c.rounds[k] * 1000:{8 if k == 1 else 6}.2f}" for k in (1, 2, 3, 4)))
            on, off = med[True], med[False]
            print(f"  {n:>5} few/mlx: c(1) {on.forward[1] / off.forward[1]:.2f}, c(4) {on.forward[4] / off.forward[4]:.2f}, "
                  f"draft {on.draft / off.draft:.2f}, round d3 {on.rounds[3] / off.rounds[3]:.2f}")
    finally:
        ca.FEW, ca.FEW_FROM_KEYS = True, saved
        engine.stop()


def batch_costs(model: str, contexts: list[int], rounds: int) -> None:
    """Four rows decoding as one batch (MTP, depth 2, greedy) at each context: row by row through
    the entry (cpu_attention.RAGGED_ROWS, what mtplx does past FEW_FROM_KEYS) against one masked
    call over the longest row (before), blocks of 6 rounds alternating, for one long row beside
    three short ones and for four long rows."""
    from concurrency import decoding, prompts
    from mtplx.catalog import resolve
    from mtplx.engine import cpu_attention as ca
    from mtplx.engine.batch import DecodeBatch
    from mtplx.engine.engine import Engine, EngineConfig

    engine = Engine(resolve(model), EngineConfig(use_mtp=True, depth=2), name=model).start()
    print(f"\n{model}: four rows batched (MTP depth 2), decode tok/s, row by row / one masked call "
          f"(medians of {6 * rounds} blocks of 6 rounds)")
    try:
        batch = prompts(engine, 4)

        def measure(repeat: int) -> list[tuple]:
            out = []
            long = decoding(engine, [batch[0] * repeat] + batch[1:], repeat=1, max_tokens=10**6)
            even = decoding(engine, batch, repeat=repeat, max_tokens=10**6)
            for label, gens in (("one long, three short", long), ("four long", even)):
                merged, speeds = DecodeBatch(engine.runner, gens), {True: [], False: []}
                for block in range(6 * rounds):
                    for rows in ((True, False) if block % 2 else (False, True)):
                        ca.RAGGED_ROWS = rows
                        before, t = sum(len(g.generated) for g in gens), time.perf_counter()
                        for _ in range(6):
                            for gen, result in zip(gens, merged.step()):
                                list(gen.take_round(*result))
                        speeds[rows].append((sum(len(g.generated) for g in gens) - before) / (time.perf_counter() - t))
                merged.release()
                out.append((label, [g.state.length for g in gens], statistics.median(speeds[True]),
                            statistics.median(speeds[False])))
            return out

        for n in contexts:
            for label, lengths, rows, masked in engine.call(lambda: measure(max(1, n // len(batch[0])))):
                print(f"  {label:<22} at {lengths}: {rows:7.0f} / {masked:7.0f} = {rows / masked:.2f}x")
    finally:
        ca.RAGGED_ROWS = True
        engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[1000, 3000, 7000])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", nargs="+", choices=["calls", "model", "batch"], default=["calls", "model", "batch"],
                    help="which of the three sections to run")
    args = ap.parse_args()
    blas = fast_path.activate()
    print(f"compute: {fast_path.label(True, 'float32', blas)}")
    from mtplx.engine import cpu_attention as ca

    if ca.kernel()[0] is None:
        sys.exit(f"the attention kernel is not available here: {ca.kernel()[1]}")
    if "calls" in args.parts:
        calls_alone()
    for model in args.models if "model" in args.parts else ():
        model_costs(model, args.contexts, args.rounds)
    for model in args.models if "batch" in args.parts else ():
        batch_costs(model, args.contexts, args.rounds)


if __name__ == "__main__":
    main()
