"""MLX's CPU attention vs mtplx's (mtplx/engine/cpu_attention.py), side by side in one process.

    python bench/attention.py [--model tiny-dense] [--runs 5]

Three arms: MLX's own kernel; mtplx's vectorised MLX path ("vector": grouped heads as GEMM rows,
a polynomial exponent); and mtplx as it runs ("mtplx": the same, with prefill calls of more than
KERNEL_FROM queries in the C kernel, mtplx/native/attention.c). All are timed interleaved, call
by call, so the machine's noise hits them alike:
- the attention call alone, at the shapes mtplx runs: prefill chunks (16-64 queries over 1k-8k
  keys), MTP verifies (3 and 5 queries), an AR step (1 query);
- on the model (the CPU fast path, MKL): a 16- and a 64-token prefill chunk at 2k and 8k tokens
  of context (what render-ahead runs), a cold 3k-token prompt to its first token (the engine's
  256-token chunks), and greedy decoding, AR and MTP at depth 2 and 4.
Prints medians and the ratios MLX / mtplx and vector / mtplx (above 1: mtplx faster). Speed is
never asserted.
"""

from __future__ import annotations

import argparse
import random
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

ARMS = {"mlx": cpu_attention._mlx_attention, "vector": cpu_attention.attention, "mtplx": cpu_attention.attention}
KERNEL_FROM = cpu_attention.KERNEL_FROM


def use(arm: str) -> None:
    mx.fast.scaled_dot_product_attention = ARMS[arm]
    cpu_attention.KERNEL_FROM = KERNEL_FROM if arm == "mtplx" else 1 << 30


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(label: str, runs: int, make) -> None:
    """`make(arm)` returns a callable to time once under that arm; interleaved, medians."""
    got = {arm: [] for arm in ARMS}
    for _ in range(runs):
        for arm in ARMS:
            use(arm)
            fn = make(arm)
            got[arm].append(timed(fn))
    a, b, c = (statistics.median(got[arm]) * 1000 for arm in ARMS)
    print(f"{label:<50} {a:9.2f} {b:9.2f} {c:9.2f} {a / c:9.2f}x {b / c:9.2f}x", flush=True)


def calls(runs: int) -> None:
    for queries, keys in [(256, 3000), (64, 1000), (32, 2000), (16, 8000), (5, 2000), (3, 200), (1, 2000)]:
        q, k, v = mx.random.normal((1, 4, queries, 64)), mx.random.normal((1, 2, keys, 64)), mx.random.normal((1, 2, keys, 64))
        mx.eval(q, k, v)

        def make(arm):
            return lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"))
        make("mlx")()
        side_by_side(f"attention: {queries} queries over {keys} keys (ms)", runs * 4, make)


def chunks(engine: Engine, runs: int) -> None:
    runner = engine.runner
    rng = random.Random(0)
    for context in (2000, 8000):
        tokens = [rng.randrange(20, 4000) for _ in range(context + 65)]

        def base():
            cache, mtp = runner.new_trunk_cache(), runner.new_mtp_cache()
            for b in range(0, context, 512):
                end = min(b + 512, context)
                h = runner.hidden(tokens[b:end], cache)
                runner.draft_hidden(h, tokens[b + 1:end + 1], mtp)
                mx.eval([c.state for c in cache] + [mtp.state])
            return cache, mtp

        for size in (16, 64):
            state = engine.call(base)

            def make(arm, size=size, state=state):
                def run():
                    cache, mtp = state
                    with runner.small_forwards():
                        h = runner.hidden(tokens[context:context + size], cache)
                        runner.draft_hidden(h, tokens[context + 1:context + size + 1], mtp)
                        mx.eval([c.state for c in cache] + [mtp.state])
                    for c in [*cache, mtp]:
                        c.trim(size)
                return lambda: engine.call(run)
            side_by_side(f"model: a {size}-token chunk at {context} context (ms)", runs, make)


def cold_prompt(engine: Engine, runs: int, length: int = 3000) -> None:
    rng = random.Random(1)

    def make(arm):
        prompt = tuple(rng.randrange(20, 4000) for _ in range(length))  # new tokens each time: nothing to reuse
        request = GenerationRequest(prompt, SamplingParams(max_tokens=1), use_mtp=False)
        return lambda: engine.submit(request).result()
    side_by_side(f"model: cold {length}-token prompt to first token (ms)", runs, make)


def decoding(engine: Engine, runs: int, tokens: int = 96) -> None:
    tok = engine.checkpoint.tokenizer
    prompt = tuple(tok.apply_chat_template([{"role": "user", "content": "Explain src/ledger/events.py in detail."}],
                                           add_generation_prompt=True))
    for mode in ("ar", 2, 4):
        def make(arm, mode=mode):
            request = GenerationRequest(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True),
                                        use_mtp=mode != "ar", depth=None if mode == "ar" else mode)
            return lambda: engine.submit(request).result()
        side_by_side(f"model: {tokens} tokens, {'AR' if mode == 'ar' else f'MTP depth {mode}'} (ms, whole request)",
                     runs, make)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    engine = Engine(resolve(args.model), EngineConfig(), name=args.model).start()
    try:
        print(f"{'':<50} {'MLX':>9} {'vector':>9} {'mtplx':>9} {'MLX/mtplx':>10} {'vec/mtplx':>10}")
        calls(args.runs)
        chunks(engine, args.runs)
        cold_prompt(engine, args.runs)
        decoding(engine, args.runs)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
