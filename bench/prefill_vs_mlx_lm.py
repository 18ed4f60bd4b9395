"""Cold TTFT of the engine vs mlx-lm's `stream_generate` on the same weights, side by side.

    python bench/prefill_vs_mlx_lm.py [--model tiny-dense] [--tokens 447]

Each row is the best of 3 cold requests (max_tokens=1): MTP on/off and chunk sizes 256/2048,
and mlx-lm on the trunk-only copy bench/peer_server.py makes. Prints each as a ratio to mlx-lm.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from mtplx.catalog import resolve  # noqa: E402
from mtplx.chat import render  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402
from mtplx.synth.agent import Sizes, conversation  # noqa: E402
from mtplx.synth.corpus import Corpus  # noqa: E402
from peer_server import trunk_copy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--tokens", type=int, default=1500, help="Prompt length cap (the conversation may be shorter).")
    args = parser.parse_args()
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler
    from transformers import AutoTokenizer

    conv = conversation(301, Corpus(), Sizes(120, 200), 1)
    prompt = render(AutoTokenizer.from_pretrained(str(resolve(args.model))), conv["messages"][:3], conv["tools"])
    prompt = prompt[: args.tokens]
    times = {}
    for label, config in [("mtplx mtp, chunk 256", EngineConfig()), ("mtplx ar, chunk 256", EngineConfig(use_mtp=False)),
                          ("mtplx mtp, chunk 2048", EngineConfig(chunk_size=2048)),
                          ("mtplx ar, chunk 2048", EngineConfig(use_mtp=False, chunk_size=2048))]:
        engine = Engine(resolve(args.model), config, name=args.model).start()
        try:
            times[label] = min(engine.submit(GenerationRequest(tuple(prompt), SamplingParams(max_tokens=1))).result()
                               .stats.ttft_s for _ in range(3))
        finally:
            engine.stop()
    model, tokenizer = load(str(trunk_copy(args.model)))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=1, sampler=make_sampler(0.0)):
            best = min(best, time.perf_counter() - t0)
            break
    times["mlx-lm stream_generate"] = best
    print(f"{args.model}, cold prompt of {len(prompt)} tokens, TTFT best of 3:")
    for label, t in times.items():
        print(f"  {label:<24} {t:.3f} s  {t / best:.2f}x mlx-lm")
    mx.clear_streams()


if __name__ == "__main__":
    main()
