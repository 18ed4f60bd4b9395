"""MTP speculation vs autoregressive decoding vs mlx-lm, and the cost model that explains them.

    python bench/mtp.py [--models tiny-dense tiny-hybrid] [--prompts 6] [--tokens 128] [--runs 3]

Each run, on one engine and in one process, prompt by prompt (each prompt through every arm, so
machine noise hits all arms alike):
mtplx AR decode, MTP decode at depths 1-4 (greedy, fixed length), mlx-lm's `stream_generate` on the
same weights with the same fast path (as it runs: MKL on its default threads; and with MKL held to
one thread, as mtplx runs its decode steps), and the measured step costs of engine/step_costs.py:
c(t), a trunk forward over t tokens at the prompts' context, and one MTP head draft step.

Printed, medians over the runs: acceptance by depth, tau, c(k+1)/c(1), the cost of a whole round
and a draft step's share of it, the cost-model prediction tau * (c(1) + h) / (round(k) + h) (h: an
AR step's time outside forward and pick) next to the measured MTP/AR decode ratio, and AR vs mlx-lm.
Speed is printed, never asserted. Give the load average with any figure quoted (2 shared cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtplx.catalog import resolve  # noqa: E402
from mtplx.chat import render  # noqa: E402
from mtplx.engine import step_costs  # noqa: E402
from mtplx.engine.compute import blas_threads  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402
from mtplx.synth.agent import Sizes, conversation  # noqa: E402
from mtplx.synth.corpus import Corpus  # noqa: E402

DEPTHS = range(1, step_costs.MAX_DEPTH + 1)


def prompts(tokenizer, n: int) -> list[tuple[int, ...]]:
    corpus, out = Corpus(), []
    for i in range(n):
        convo = conversation(6_000_000 + i, corpus, Sizes(6, 30), max_user_turns=1)
        k = next(j for j, m in enumerate(convo["messages"]) if m["role"] == "assistant")
        out.append(tuple(render(tokenizer, convo["messages"][:k], convo["tools"])))
    return out


def decode(engine, p, tokens, mtp, depth=1) -> dict:
    """One prompt's decode: tokens, seconds, and (AR) host time per step or (MTP) acceptance counts."""
    s = engine.submit(GenerationRequest(p, SamplingParams(max_tokens=tokens, ignore_eos=True), use_mtp=mtp,
                                        depth=depth, source="bench")).result().stats
    out = {"n": s.completion_tokens, "s": s.decode_s}
    if mtp:
        return out | {"drafted": list(s.drafted_by_depth), "accepted": list(s.accepted_by_depth), "verifies": s.verify_calls}
    return out | {"host": step_costs.host_per_step(s)}


def mlx_lm(engine, p, tokens) -> dict:
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    last = None
    for last in stream_generate(engine.checkpoint.model, engine.checkpoint.tokenizer, list(p), max_tokens=tokens,
                                sampler=make_sampler(0.0)):
        pass
    return {"n": last.generation_tokens, "s": last.generation_tokens / last.generation_tps}


def one_run(engine, ps, tokens) -> dict:
    """Every arm on every prompt, prompt by prompt (a noisy moment hits all arms of a prompt alike)."""
    def one_thread(p):
        with blas_threads(1):
            return mlx_lm(engine, p, tokens)

    arms = {"ar": lambda p: decode(engine, p, tokens, False)}
    arms |= {depth: (lambda p, d=depth: decode(engine, p, tokens, True, d)) for depth in DEPTHS}
    arms |= {"mlx-lm": lambda p: engine.call(lambda: mlx_lm(engine, p, tokens)),
             "mlx-lm 1 thread": lambda p: engine.call(lambda: one_thread(p))}
    got = {arm: [] for arm in arms}
    for p in ps:
        for arm, fn in arms.items():
            got[arm].append(fn(p))
    row = {arm: {"tps": sum(g["n"] for g in gs) / sum(g["s"] for g in gs)} for arm, gs in got.items()}
    row["host"] = statistics.median(g["host"] for g in got["ar"])
    for depth in DEPTHS:
        drafted = [sum(g["drafted"][i] for g in got[depth]) for i in range(depth)]
        accepted = [sum(g["accepted"][i] for g in got[depth]) for i in range(depth)]
        verifies = sum(g["verifies"] for g in got[depth])
        row[depth] |= {"acceptance": [a / d if d else 0.0 for a, d in zip(accepted, drafted)],
                       "tau": (sum(accepted) + verifies) / verifies}
    row["costs"] = engine.call(lambda: step_costs.measure(engine.runner, list(ps[0])))
    return row


def report(model: str, rows: list[dict], args) -> None:
    med = statistics.median
    c1 = med(r["costs"].forward[1] for r in rows)
    draft = med(r["costs"].draft for r in rows)
    ar = med(r["ar"]["tps"] for r in rows)
    costs = step_costs.median_of([r["costs"] for r in rows]).with_host(med(r["host"] for r in rows))
    deepest = [med(r[max(DEPTHS)]["acceptance"][i] for r in rows) for i in range(max(DEPTHS))]
    print(f"\n{model}: {args.prompts} prompts x {args.tokens} tokens (greedy), medians of {len(rows)} runs; "
          f"c(1) {c1 * 1000:.2f} ms, draft step {draft * 1000:.2f} ms ({draft / c1:.2f} c(1)), "
          f"host per AR step h {costs.host * 1000:.2f} ms")
    print(f"{'depth':>5} {'acceptance by depth':<24} {'tau':>5} {'c(k+1)/c(1)':>11} {'round/c(1)':>10} "
          f"{'chained draft/c(1)':>18} {'predicted':>9} {'measured':>8} {'MTP tok/s':>9}")
    for k in DEPTHS:
        acc = " ".join(f"{med(r[k]['acceptance'][i] for r in rows):.2f}" for i in range(k))
        ck = med(r["costs"].forward[k + 1] for r in rows)
        predicted = costs.speedup(k, deepest)
        measured = med(r[k]["tps"] / r["ar"]["tps"] for r in rows)
        print(f"{k:>5} {acc:<24} {med(r[k]['tau'] for r in rows):5.2f} {ck / c1:11.2f} {costs.rounds[k] / c1:10.2f} {costs.chained_draft(k) / c1:18.2f} "
              f"{predicted:9.2f} {measured:8.2f} {med(r[k]['tps'] for r in rows):9.1f}")
    print("  round = one whole Speculator round, timed; chained draft = (round - c(k+1)) / k; "
          "predicted = tau(k) * (c(1) + h) / (round(k) + h),\n  tau(k) from the depth-4 acceptance; measured = MTP/AR tok/s")
    ref, ref1 = med(r["mlx-lm"]["tps"] for r in rows), med(r["mlx-lm 1 thread"]["tps"] for r in rows)
    print(f"  AR {ar:.1f} tok/s; mlx-lm stream_generate {ref:.1f} tok/s (MKL default threads), {ref1:.1f} (one MKL thread); "
          f"AR/mlx-lm {med(r['ar']['tps'] / r['mlx-lm']['tps'] for r in rows):.2f} and "
          f"{med(r['ar']['tps'] / r['mlx-lm 1 thread']['tps'] for r in rows):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for model in args.models:
        engine = Engine(resolve(model), EngineConfig(), name=model).start()
        try:
            ps = prompts(engine.checkpoint.tokenizer, args.prompts)
            decode(engine, ps[0], 16, False)  # warm-up: compiles every step shape
            for depth in DEPTHS:
                decode(engine, ps[0], 32, True, depth)
            rows = []
            for run in range(args.runs):
                rows.append(one_run(engine, ps, args.tokens))
                print(f"{model}: run {run + 1}/{args.runs} done (load average {os.getloadavg()[0]:.2f})",
                      file=sys.stderr, flush=True)
            print(f"\nload average (1, 5, 15 min) at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
                  f"{time.strftime('%H:%M:%S', time.gmtime())} UTC")
            report(model, rows, args)
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
