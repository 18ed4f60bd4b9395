"""The MTP head's prompt KV after a long prompt: in one go vs caught up between plain steps.

    python bench/head_catch_up.py [--models tiny-dense tiny-hybrid] [--runs 5] [--tokens 64]

With MTP the prefill leaves the head's KV over the prompt (and the trunk's last layer under it)
lazy, so the first token comes sooner; it is computed after that token. In one go it stops the
stream for all of it; caught up (generation.CATCH_UP), it is computed a few prefill chunks at a
time with a plain step between, and drafting starts once it is done. One engine, a cold ~3k-token
agent prompt per request (a fresh nonce), the two arms alternated: the longest gap between two
token events after the first, the time from the first token to the last, and the head's KV time.
Greedy outputs must be equal under both arms. Speed is never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mtplx.catalog import resolve  # noqa: E402
from mtplx.chat import render  # noqa: E402
from mtplx.engine import generation  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402
from mtplx.events import FirstToken, Finished, Tokens  # noqa: E402

ARMS = {"in one go": False, "caught up": True}


def answer(engine: Engine, prompt: tuple[int, ...], tokens: int) -> dict:
    stamps, first = [], None
    for event in engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True),
                                                 use_mtp=True, depth=3)):
        if isinstance(event, FirstToken):
            first = time.perf_counter()
        elif isinstance(event, Tokens) and event.token_ids:
            stamps.append(time.perf_counter())
        elif isinstance(event, Finished):
            end, done = time.perf_counter(), event
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"gap": max(gaps), "span": end - first, "head": done.stats.mtp_prefill_s, "tokens": done.token_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    import turns

    for name in args.models:
        (messages, tools), _ = turns.prompts(AutoTokenizer.from_pretrained(str(resolve(name))))
        engine = Engine(resolve(name), EngineConfig(), name=name).start()
        try:
            got = {arm: [] for arm in ARMS}
            equal = 0
            for _ in range(args.runs):
                prompt = tuple(render(engine.checkpoint.tokenizer, turns.with_nonce(messages), tools))
                outs = []
                for arm, on in ARMS.items():
                    generation.CATCH_UP = on
                    got[arm].append(answer(engine, prompt, args.tokens))
                    outs.append(got[arm][-1]["tokens"])
                equal += outs[0] == outs[1]
            generation.CATCH_UP = True
            print(f"\n{name}: cold {len(prompt)}-token prompt, {args.tokens} tokens, MTP depth 3, medians of {args.runs}")
            print(f"{'arm':<10} {'longest gap':>12} {'first->last':>12} {'head KV':>9}")
            for arm, rows in got.items():
                med = {k: statistics.median(r[k] for r in rows) * 1e3 for k in ("gap", "span", "head")}
                print(f"{arm:<10} {med['gap']:10.1f}ms {med['span']:10.1f}ms {med['head']:7.1f}ms")
            print(f"greedy outputs equal under both arms: {equal}/{args.runs}")
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
