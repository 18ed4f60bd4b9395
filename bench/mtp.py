"""MTP speculation vs autoregressive decoding, side by side in one process.

    python bench/mtp.py [--models tiny-dense tiny-hybrid] [--prompts 6] [--tokens 128]

Per depth: acceptance by depth, tau (tokens per verify), decode tok/s of MTP and of AR on the same
engine, their ratio, the measured cost of one trunk forward over k+1 tokens vs over 1 token
(c(k+1)/c(1), at the prompts' context), and the cost-model ceiling tau * c(1) / c(k+1) (drafting
not counted). Also mtplx AR vs mlx-lm's own `stream_generate` on the same model and prompts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtplx.catalog import resolve  # noqa: E402
from mtplx.chat import render  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402
from mtplx.synth.agent import Sizes, conversation  # noqa: E402
from mtplx.synth.corpus import Corpus  # noqa: E402


def prompts(tokenizer, n: int) -> list[tuple[int, ...]]:
    corpus, out = Corpus(), []
    for i in range(n):
        convo = conversation(6_000_000 + i, corpus, Sizes(6, 30), max_user_turns=1)
        k = next(j for j, m in enumerate(convo["messages"]) if m["role"] == "assistant")
        out.append(tuple(render(tokenizer, convo["messages"][:k], convo["tools"])))
    return out


def forward_cost(engine: Engine, prompt, t: int, reps: int = 20) -> float:
    """Median seconds of one trunk forward over t tokens after the prompt is cached."""
    import mlx.core as mx

    runner = engine.runner
    cache = runner.new_trunk_cache()
    mx.eval(runner.hidden(list(prompt), cache))
    from mtplx.state import snapshot

    base = snapshot.snapshot(cache)
    times = []
    for _ in range(reps):
        c = snapshot.restore(base)
        start = time.perf_counter()
        mx.eval(runner.logits(runner.hidden(list(prompt[-t:]), c)))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(engine, ps, tokens, mtp, depth=1):
    tps, drafted, accepted, verifies = [], None, None, 0
    for p in ps:
        fin = engine.submit(GenerationRequest(p, SamplingParams(max_tokens=tokens, ignore_eos=True), use_mtp=mtp,
                                              depth=depth, source="bench")).result()
        s = fin.stats
        tps.append(s.decode_tps)
        if mtp:
            drafted = [a + b for a, b in zip(drafted or [0] * depth, s.drafted_by_depth)]
            accepted = [a + b for a, b in zip(accepted or [0] * depth, s.accepted_by_depth)]
            verifies += s.verify_calls
    tau = (sum(accepted) + verifies) / verifies if mtp and verifies else None
    return statistics.mean(tps), drafted, accepted, tau


def mlx_lm_tps(engine, ps, tokens) -> float:
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tok = engine.checkpoint.model, engine.checkpoint.tokenizer
    out = []
    for p in ps:
        last = None
        for last in stream_generate(model, tok, list(p), max_tokens=tokens, sampler=make_sampler(0.0)):
            pass
        out.append(last.generation_tps)
    return statistics.mean(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    for model in args.models:
        engine = Engine(resolve(model), EngineConfig(), name=model).start()
        try:
            ps = prompts(engine.checkpoint.tokenizer, args.prompts)
            run(engine, ps[:1], 16, False)  # warm-up
            ar, *_ = run(engine, ps, args.tokens, False)
            c1 = engine.call(lambda: forward_cost(engine, ps[0], 1))
            print(f"\n{model}: {args.prompts} prompts x {args.tokens} tokens (greedy), AR {ar:.1f} tok/s, "
                  f"one forward over 1 token {c1 * 1000:.1f} ms")
            print(f"{'depth':>5} {'acceptance by depth':<28} {'tau':>5} {'MTP tok/s':>9} {'MTP/AR':>7} "
                  f"{'c(k+1)/c(1)':>11} {'ceiling':>8}")
            for depth in range(1, 5):
                tps, drafted, accepted, tau = run(engine, ps, args.tokens, True, depth)
                ck = engine.call(lambda: forward_cost(engine, ps[0], depth + 1))
                acc = " ".join(f"{a / d:.2f}" for a, d in zip(accepted, drafted))
                print(f"{depth:>5} {acc:<28} {tau:5.2f} {tps:9.1f} {tps / ar:7.2f} {ck / c1:11.2f} {tau * c1 / ck:8.2f}")
            ref = engine.call(lambda: mlx_lm_tps(engine, ps, args.tokens))
            print(f"mtplx AR {ar:.1f} tok/s vs mlx-lm stream_generate {ref:.1f} tok/s: ratio {ar / ref:.2f}")
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
