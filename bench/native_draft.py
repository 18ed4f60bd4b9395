"""The draft chain in C against MLX's, side by side in one process (engine/native_draft.py).

    python bench/native_draft.py [--models tiny-dense tiny-hybrid] [--rounds 6] [--tokens 128] [--depth 3]

Per model, each round runs, in alternating order, with the head's drafts in C (its products shared
with the kernel's helper thread), in C without that helper (the chain before it: one thread alone,
a batch's rows in two groups on two threads) and in MLX:
- one greedy request alone (bench/concurrency.py's prompts), MTP at `--depth`, and AR once;
- the four prompts at once (one batch);
- the kernel alone: a live batch's four rows' chains in one call (stepping together) on one
  thread and with the kernel's helper sharing each product, against one call per row on one
  thread, and whether their drafts are the same.
Decode tok/s as bench/concurrency.py counts it (tokens after each first token, over the span from
the first FirstToken to the last Finished). Prints medians, C/MLX, and MTP/AR per chain. Outputs
are compared too: greedy drafts decide speed only. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mtplx import fast_path  # noqa: E402,F401  (before MLX: loads MKL in this process)
from concurrency import decoding, prompts, run  # noqa: E402
from mtplx.catalog import resolve  # noqa: E402
from mtplx.engine import native_draft  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402


def kernel_rows(engine, native, batch, depth: int, calls: int = 300) -> tuple[float, float, bool]:
    """On the engine thread: four rows of a live batch (a few rounds in), their chains in one call
    and one call per row; median ms of each, and whether the drafts agree."""
    import mlx.core as mx
    import numpy as np

    from mtplx.engine.batch import DecodeBatch

    gens = decoding(engine, batch, repeat=3, depth=depth)
    b = DecodeBatch(engine.runner, gens)
    try:
        for _ in range(3):
            for gen, result in zip(gens, b.step()):
                list(gen.take_round(*result))
        mx.eval(b.mtp.keys, b.mtp.values)
        keys, values = np.array(b.mtp.keys, copy=False), np.array(b.mtp.values, copy=False)
        rows = [(g.speculator.pending_hidden, g.speculator.pending_tokens, keys[i : i + 1], values[i : i + 1],
                 b.mtp.lengths[i], None) for i, g in enumerate(gens)]
        one_thread = native.chain_rows(rows, depth, helper=False)
        equal = one_thread == native.chain_rows(rows, depth) == [native.chain_rows([r], depth, helper=False)[0] for r in rows]
        times = {"together": [], "two threads": [], "apart": []}
        for _ in range(calls):
            for kind in times:
                t = time.perf_counter()
                if kind == "apart":
                    for r in rows:
                        native.chain_rows([r], depth, helper=False)
                else:
                    native.chain_rows(rows, depth, helper=kind == "two threads")
                times[kind].append(time.perf_counter() - t)
        return tuple(statistics.median(v) * 1e3 for v in times.values()) + (equal,)
    finally:
        b.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=3)
    args = ap.parse_args()
    for name in args.models:
        engine = Engine(resolve(name), EngineConfig(use_mtp=True, depth=args.depth), name=name).start()
        try:
            native = engine.call(engine.runner.native_draft)
            if native is None:
                print(f"{name}: no C chain here ({engine.runner.native_draft_reason})")
                continue
            batch = prompts(engine, 4)
            run(engine, batch, 16)  # warm up
            arms = ("c", "c, no helper", "mlx")
            tps = {(arm, kind): [] for arm in arms for kind in ("alone", "4 at once")}
            ar, same = [], True
            for r in range(args.rounds):
                outs = {}
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    engine.call(lambda: setattr(engine.runner, "_native_draft", None if arm == "mlx" else native))
                    # the kernel without its helper: one thread alone, a batch in two groups on two threads
                    native_draft.TEAM = arm != "c, no helper"
                    one, outs[arm, "alone"] = run(engine, batch[r % 4 : r % 4 + 1], args.tokens)
                    tps[arm, "alone"].append(one)
                    together, outs[arm, "4"] = run(engine, batch, args.tokens)
                    tps[arm, "4 at once"].append(together)
                engine.call(lambda: setattr(engine.runner, "_native_draft", native))
                native_draft.TEAM = True
                ar.append(run(engine, batch[r % 4 : r % 4 + 1], args.tokens, use_mtp=False)[0])
                same = same and all(outs[arm, kind] == outs["mlx", kind] for arm in arms for kind in ("alone", "4"))
            med = {key: statistics.median(v) for key, v in tps.items()}
            ar_tps = statistics.median(ar)
            print(f"\n{name}: depth {args.depth}, medians of {args.rounds} rounds, {args.tokens} greedy tokens")
            print(f"{'':<10} {'C tok/s':>9} {'no helper':>10} {'MLX tok/s':>10} {'C/MLX':>6} {'C/no helper':>12}")
            for kind in ("alone", "4 at once"):
                c, c1, m = med["c", kind], med["c, no helper", kind], med["mlx", kind]
                print(f"{kind:<10} {c:>9.0f} {c1:>10.0f} {m:>10.0f} {c / m:>6.2f} {c / c1:>12.2f}")
            print(f"AR alone {ar_tps:.0f} tok/s: MTP/AR with C {med['c', 'alone'] / ar_tps:.2f}, "
                  f"with MLX {med['mlx', 'alone'] / ar_tps:.2f}; 4 at once / alone: with C "
                  f"{med['c', '4 at once'] / med['c', 'alone']:.2f}, with C and no helper "
                  f"{med['c, no helper', '4 at once'] / med['c, no helper', 'alone']:.2f}, "
                  f"with MLX {med['mlx', '4 at once'] / med['mlx', 'alone']:.2f}")
            print(f"outputs the same with either chain: {same}")
            together, two, apart, equal = engine.call(lambda: kernel_rows(engine, native, batch, args.depth))
            print(f"the kernel, 4 rows' chains: one call {together:.3f} ms on one thread, {two:.3f} ms with its helper; "
                  f"one call per row {apart:.3f} ms ({apart / together:.2f}x one call), drafts the same: {equal}")
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
