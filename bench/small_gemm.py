"""The small-row kernel on and off, side by side in one process: AR, MTP and several sessions at once.

    python bench/small_gemm.py [--models tiny-dense tiny-hybrid] [--depth 3] [--rounds 6] [--tokens 160] [--sessions 4]
                               [--compare kernel|threads|wide|prefetch]

`--compare threads` keeps the kernel on and switches its helper thread instead (big products
shared in column chunks, small_gemm.set_threads); `--compare wide` switches between its AVX-512
and AVX2 tiles (small_gemm.set_wide; only where it was built with AVX-512; other bits, so on == off
token for token is not expected there); `--compare prefetch` switches, in the small-row kernel and
in the C draft chain both, the fetch of the next block of weight rows while a block computes (the
same bits: on == off token for token).

mtplx/small_gemm.py puts a C sgemm for 1-32 rows ahead of MKL. Its switch (small_gemm.set_enabled)
hands those products back to MKL, so both arms run on one engine and one set of weights. Rounds
alternate the order of the arms (the machine's speed swings minute to minute). Per model, medians
of: AR and MTP decode tok/s of one greedy sequence (two prompts), the aggregate tok/s of
`--sessions` sequences decoding together (tokens after each first token, over the span from the
first FirstToken to the last Finished, as bench/concurrency.py counts), and the ratios on/off, MTP/AR
and together/alone per arm. Also whether MTP == AR and on == off token for token. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mtplx import fast_path, small_gemm  # noqa: E402  (before MLX: the fast path and the kernel)
from mtplx.catalog import resolve  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402
from concurrency import prompts, run  # noqa: E402

ONE = ["Read src/parser/events.py and explain what it does.",
       "Explain in a few paragraphs how a hash map handles collisions, with a short example."]


def measure(model: str, args) -> None:
    engine = Engine(resolve(model), EngineConfig(depth=args.depth)).start()
    try:
        tok = engine.checkpoint.tokenizer
        singles = [tuple(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
                   for q in ONE]
        batch = prompts(engine, args.sessions)

        def decode(ids, mtp: bool, n: int):
            request = GenerationRequest(ids, SamplingParams(max_tokens=n, ignore_eos=True), use_mtp=mtp,
                                        depth=args.depth, source="bench")
            return engine.submit(request).result()

        def switch(on: bool) -> None:
            if args.compare == "prefetch":
                small_gemm.set_prefetch(fast_path.KERNEL, on)
                if (draft := engine.call(engine.runner.native_draft)) is not None:
                    draft.set_prefetch(on)
            elif args.compare == "threads":
                small_gemm.set_threads(fast_path.KERNEL, on)
            elif args.compare == "wide":
                small_gemm.set_wide(fast_path.KERNEL, on)
            else:
                small_gemm.set_enabled(fast_path.KERNEL, on)

        speeds: dict = {}
        tokens: dict = {}
        for on in (False, True):  # warm-up: every step shape compiled under both arms
            switch(on)
            decode(singles[0], True, 16), decode(singles[0], False, 16), run(engine, batch, 16)
        for r in range(args.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                switch(on)
                for p, ids in enumerate(singles):
                    for mtp in (True, False):
                        fin = decode(ids, mtp, args.tokens)
                        speeds.setdefault((on, "mtp" if mtp else "ar"), []).append(fin.stats.decode_tps)
                        tokens.setdefault((on, mtp, p), fin.token_ids)
                speeds.setdefault((on, "together"), []).append(run(engine, batch, args.tokens)[0])
        small_gemm.set_enabled(fast_path.KERNEL, True)
        small_gemm.set_threads(fast_path.KERNEL, small_gemm.threads_wanted())
        small_gemm.set_wide(fast_path.KERNEL, small_gemm.wide())
        if args.compare == "prefetch":
            switch(True)
        med = {k: statistics.median(v) for k, v in speeds.items()}
        print(f"{model}: depth {args.depth}, {args.tokens} greedy tokens, medians of {args.rounds} rounds "
              f"({len(singles)} prompts per round for one sequence)")
        print(f"  {args.compare:<7} {'AR':>8} {'MTP':>8} {'MTP/AR':>7} {f'{args.sessions} at once':>11} {'vs MTP alone':>12}")
        for on in (False, True):
            print(f"  {'on' if on else 'off':<7} {med[(on, 'ar')]:8.1f} {med[(on, 'mtp')]:8.1f} "
                  f"{med[(on, 'mtp')] / med[(on, 'ar')]:7.2f} {med[(on, 'together')]:11.1f} "
                  f"{med[(on, 'together')] / med[(on, 'mtp')]:12.2f}")
        print(f"  on/off: AR {med[(True, 'ar')] / med[(False, 'ar')]:.2f}x, MTP {med[(True, 'mtp')] / med[(False, 'mtp')]:.2f}x, "
              f"{args.sessions} at once {med[(True, 'together')] / med[(False, 'together')]:.2f}x")
        same_mtp = all(tokens[(on, True, p)] == tokens[(on, False, p)] for on in (False, True) for p in range(len(singles)))
        same_arm = all(tokens[(True, m, p)] == tokens[(False, m, p)] for m in (True, False) for p in range(len(singles)))
        print(f"  greedy tokens: MTP == AR {same_mtp}; {args.compare} on == off {same_arm}")
    finally:
        engine.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--compare", choices=["kernel", "threads", "wide", "prefetch"], default="kernel",
                    help="what the two arms switch: the kernel itself, its helper thread (kernel on), "
                         "its AVX-512 tiles against its AVX2 ones, or the weight prefetch (both C kernels)")
    args = ap.parse_args()
    if fast_path.KERNEL is None:
        sys.exit(f"the small-row kernel is not active here: {fast_path.activate().kernel_reason}")
    if args.compare == "wide" and not small_gemm.wide():
        sys.exit("the small-row kernel has no AVX-512 tiles here (an AVX2-only CPU, or MTPLX_AVX512=off)")
    for model in args.models:
        measure(model, args)


if __name__ == "__main__":
    main()
