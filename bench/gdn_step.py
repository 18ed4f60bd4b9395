"""The GatedDeltaNet step as matmuls (mtplx/engine/gdn_step.py) vs mlx-lm's reductions, side by side.

    python bench/gdn_step.py [--model tiny-hybrid] [--rounds 4] [--depth 3] [--tokens 160] [--sessions 4]

1. The recurrence alone, in this process, compiled as the decode steps run it: ms per call for
   1 and 4 positions (an AR step, a depth-3 verify), one row and four, at tiny-hybrid's shapes.
2. The model: each round starts one child process per arm (MTPLX_GDN_STEP=reductions is the
   other arm; the choice is read at import, so every path of a process agrees), alternating
   which goes first. Each child measures AR and MTP decode of one greedy sequence (two prompts)
   and `--sessions` sequences decoding together, as bench/small_gemm.py counts them. Prints
   medians, the ratios matmuls/reductions, and whether the arms' greedy tokens agree (they may
   not everywhere: the arms' sums differ in the last bits). Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mtplx import fast_path  # noqa: E402  (before MLX: the fast path)

ARMS = ("reductions", "matmuls")
ONE = ["Read src/parser/events.py and explain what it does.",
       "Explain in a few paragraphs how a hash map handles collisions, with a short example."]


def recurrence_alone(reps: int = 300) -> None:
    import mlx.core as mx

    from mtplx.engine import gdn_step

    heads, dim = 4, 64
    print(f"recurrence alone ({heads} heads of {dim} x {dim}, compiled; ms per call, median of {reps}):")
    print(f"  {'rows':>4} {'positions':>9} {'reductions':>10} {'matmuls':>8} {'ratio':>6}")
    for rows in (1, 4):
        for positions in (1, 4):
            q, k, v = (mx.random.normal((rows, positions, heads, dim)) for _ in range(3))
            g, beta = mx.random.uniform(shape=(rows, positions, heads)), mx.random.uniform(shape=(rows, positions, heads))
            state = mx.random.normal((rows, heads, dim, dim))
            mx.eval(q, k, v, g, beta, state)
            times = {}
            for name, fn in (("reductions", gdn_step._reductions), ("matmuls", gdn_step._matmuls)):
                def run(q, k, v, g, beta, state, fn=fn):
                    out = []
                    for t in range(positions):
                        y, state = fn(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
                        out += [y, state]
                    return out
                compiled = mx.compile(run)
                mx.eval(compiled(q, k, v, g, beta, state))
                samples = []
                for _ in range(reps):
                    start = time.perf_counter()
                    mx.eval(compiled(q, k, v, g, beta, state))
                    samples.append(time.perf_counter() - start)
                times[name] = statistics.median(samples) * 1000
            print(f"  {rows:>4} {positions:>9} {times['reductions']:10.3f} {times['matmuls']:8.3f} "
                  f"{times['matmuls'] / times['reductions']:6.2f}")


def child(args) -> None:
    """One arm's round: prints one JSON line."""
    from concurrency import prompts, run
    from mtplx.catalog import resolve
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams

    engine = Engine(resolve(args.model), EngineConfig(depth=args.depth)).start()
    try:
        tok = engine.checkpoint.tokenizer
        singles = [tuple(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)) for q in ONE]
        batch = prompts(engine, args.sessions)

        def decode(ids, mtp: bool, n: int):
            request = GenerationRequest(ids, SamplingParams(max_tokens=n, ignore_eos=True), use_mtp=mtp,
                                        depth=args.depth, source="bench")
            return engine.submit(request).result()

        decode(singles[0], True, 16), decode(singles[0], False, 16), run(engine, batch, 16)  # compile every shape
        out: dict = {"ar": [], "mtp": [], "tokens": {}}
        for p, ids in enumerate(singles):
            for mtp in (True, False):
                fin = decode(ids, mtp, args.tokens)
                out["mtp" if mtp else "ar"].append(fin.stats.decode_tps)
                out["tokens"][f"{p}-{mtp}"] = list(fin.token_ids)
        out["together"] = run(engine, batch, args.tokens)[0]
        print(json.dumps(out))
    finally:
        engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-hybrid")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    print(f"compute: {fast_path.label(True, 'float32', fast_path.activate())}")
    recurrence_alone()
    results: dict = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
            env = {**os.environ, "MTPLX_GDN_STEP": "reductions" if arm == "reductions" else "matmuls"}
            cmd = [sys.executable, __file__, "--child", arm, "--model", args.model, "--depth", str(args.depth),
                   "--tokens", str(args.tokens), "--sessions", str(args.sessions)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                sys.exit(f"{arm} child failed:\n{done.stderr[-3000:]}")
            results[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    med = {arm: {key: statistics.median(x for run in runs for x in (run[key] if isinstance(run[key], list) else [run[key]]))
                 for key in ("ar", "mtp", "together")} for arm, runs in results.items()}
    print(f"\n{args.model}: depth {args.depth}, {args.tokens} greedy tokens, medians of {args.rounds} rounds "
          f"(tok/s; {len(ONE)} prompts per round for one sequence)")
    print(f"  {'arm':<10} {'AR':>8} {'MTP':>8} {'MTP/AR':>7} {f'{args.sessions} at once':>11} {'vs MTP alone':>12}")
    for arm in ARMS:
        m = med[arm]
        print(f"  {arm:<10} {m['ar']:8.1f} {m['mtp']:8.1f} {m['mtp'] / m['ar']:7.2f} {m['together']:11.1f} "
              f"{m['together'] / m['mtp']:12.2f}")
    a, b = med["matmuls"], med["reductions"]
    print(f"  matmuls/reductions: AR {a['ar'] / b['ar']:.2f}x, MTP {a['mtp'] / b['mtp']:.2f}x, "
          f"{args.sessions} at once {a['together'] / b['together']:.2f}x")
    same_mtp = all(run["tokens"][f"{p}-True"] == run["tokens"][f"{p}-False"]
                   for runs in results.values() for run in runs for p in range(len(ONE)))
    same_arm = results["matmuls"][0]["tokens"] == results["reductions"][0]["tokens"]
    print(f"  greedy tokens: MTP == AR in every run {same_mtp}; matmuls == reductions {same_arm}")


if __name__ == "__main__":
    main()
