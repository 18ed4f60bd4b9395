"""Decode steps handed to the device layer by layer vs built whole, side by side in one process.

    python bench/layer_pipeline.py [--models tiny-dense tiny-hybrid] [--rounds 12] [--depth 1] [--tokens 200]

MLX's eval on the CPU blocks its caller until all but ~100 of a graph's ops are dispatched, so a
decode step built whole and then evaluated pays Python's graph building and the compute one after
the other. engine/compiled.py hands each layer's output to `mx.async_eval` as it is built
(compiled.PIPELINE; MTPLX_LAYER_PIPELINE=off turns it off). This bench decodes the same greedy
prose answer with it on and off, alternating arms every round in one process (the machine's speed
swings minute to minute), MTP at `--depth` and AR, and prints median tok/s, the on/off ratios and
MTP/AR per arm. Every arm must give the same tokens (and MTP those of AR). Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtplx.catalog import resolve  # noqa: E402  (mtplx before MLX: the fast path)
from mtplx.engine import compiled  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.generation import Generation, StartPoint  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402

QUESTION = "Explain in a few paragraphs how a hash map handles collisions, with a short example."
ARMS = {"layer by layer": True, "built whole": False}


def decode(engine: Engine, prompt: tuple, mtp: bool, depth: int, tokens: int) -> tuple[float, tuple]:
    """Greedy decode tok/s after the prefill (the engine thread, no server in between) and the tokens."""
    gen = Generation(engine.runner, GenerationRequest(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)),
                     use_mtp=mtp, depth=depth, chunk_size=engine.config.chunk_size, eos_ids=engine.eos_ids,
                     submitted_at=time.monotonic())
    for _ in gen.prefill(StartPoint(), (), None):
        pass
    t = time.perf_counter()
    for _ in gen.decode(lambda: False):
        pass
    return len(gen.generated) / (time.perf_counter() - t), tuple(gen.generated)


def measure(name: str, args) -> None:
    engine = Engine(resolve(name), EngineConfig(use_mtp=True), name=name).start()
    try:
        tok = engine.checkpoint.tokenizer
        prompt = tuple(tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True))
        speeds = {(arm, mode): [] for arm in ARMS for mode in ("mtp", "ar")}
        outputs = set()
        for r in range(args.rounds + 1):
            for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]):
                compiled.PIPELINE = ARMS[arm]
                for mode in ("mtp", "ar"):
                    tps, ids = engine.call(lambda: decode(engine, prompt, mode == "mtp", args.depth, args.tokens))
                    outputs.add(ids)
                    if r:  # the first round compiles every step shape
                        speeds[(arm, mode)].append(tps)
    finally:
        compiled.PIPELINE = True
        engine.stop()
    med = {k: statistics.median(v) for k, v in speeds.items()}
    on, off = ARMS
    print(f"\n{name}: greedy decode tok/s, {args.tokens} tokens, medians of {args.rounds} alternating rounds")
    print(f"{'':<16}{'MTP d' + str(args.depth):>10}{'AR':>10}{'MTP/AR':>8}")
    for arm in ARMS:
        print(f"{arm:<16}{med[(arm, 'mtp')]:>10.1f}{med[(arm, 'ar')]:>10.1f}{med[(arm, 'mtp')] / med[(arm, 'ar')]:>8.2f}")
    print(f"{on} / {off}: MTP {med[(on, 'mtp')] / med[(off, 'mtp')]:.2f}x, AR {med[(on, 'ar')] / med[(off, 'ar')]:.2f}x")
    print(f"tokens: {'the same in every arm, MTP == AR' if len(outputs) == 1 else 'DIFFER between arms'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    for name in args.models:
        measure(name, args)


if __name__ == "__main__":
    main()
