"""A quantized checkpoint on the CPU: packed (MLX's quantized matmul) vs unpacked to fp32 at load.

    python bench/dequantize.py [--models tiny-dense tiny-hybrid] [--bits 4] [--depth 3] [--rounds 4] [--tokens 128]

Each model is converted as a user converts it (`mtplx convert --bits N`: trunk N-bit, embedding
and LM head 8-bit, MTP head kept) into a temporary directory, then loaded twice in this process:
with MTPLX_CPU_DEQUANTIZE=off (its layers stay packed, as on Metal) and with the default (unpacked
to fp32 on the CPU fast path, engine/compute.py). Rounds alternate the order of the arms (the
machine's speed swings minute to minute); each round decodes the same prompts greedily, AR and
MTP, on both, and prefills a ~1,000-token prompt cold (no bank). Printed, medians over rounds:
decode tok/s per arm and mode, prefill tok/s, unpacked/packed, MTP/AR per arm, the resident weight
bytes of each arm, and whether each arm's MTP equals its AR token for token. The two arms' outputs may differ: the same weight values are summed in another order.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtplx import fast_path  # noqa: E402,F401  (before MLX: the fast path)
from mtplx.catalog import resolve  # noqa: E402
from mtplx.convert import convert  # noqa: E402
from mtplx.engine.compute import DEQUANTIZE_ENV  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402

PROMPTS = ["Read src/parser/events.py and explain what it does.",
           "Explain in a few paragraphs how a hash map handles collisions, with a short example."]


def start(path: Path, depth: int, unpack: bool) -> Engine:
    before = os.environ.get(DEQUANTIZE_ENV)
    os.environ[DEQUANTIZE_ENV] = "on" if unpack else "off"  # read once, when the checkpoint loads
    try:
        return Engine(path, EngineConfig(depth=depth), name=path.name).start()
    finally:
        os.environ.pop(DEQUANTIZE_ENV) if before is None else os.environ.__setitem__(DEQUANTIZE_ENV, before)


def weight_bytes(engine: Engine) -> int:
    from mlx.utils import tree_flatten

    modules = [m for m in (engine.checkpoint.model, engine.checkpoint.mtp) if m is not None]
    return sum(v.nbytes for m in modules for _, v in tree_flatten(m.parameters()))


def decode(engine: Engine, prompt: tuple, tokens: int, mtp: bool, depth: int) -> tuple[float, tuple]:
    fin = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True),
                                          use_mtp=mtp, depth=depth, source="bench")).result()
    return fin.stats.completion_tokens / fin.stats.decode_s, fin.token_ids


def prefill(engine: Engine, prompt: tuple) -> float:
    fin = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=1), use_mtp=False, source="bench")).result()
    return len(prompt) / fin.stats.prefill_s


def measure(model: str, args) -> None:
    with tempfile.TemporaryDirectory(prefix="mtplx-dequantize-") as tmp:
        path = Path(tmp) / f"{model}-{args.bits}bit"
        convert(resolve(model), path, bits=args.bits, group_size=64)
        arms = {"packed": start(path, args.depth, False), "unpacked": start(path, args.depth, True)}
        try:
            tok = arms["packed"].checkpoint.tokenizer
            prompts = [tuple(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
                       for p in PROMPTS]
            long = tuple(tok.apply_chat_template([{"role": "user", "content": " ".join(PROMPTS * 40)}],
                                                 add_generation_prompt=True))
            for engine in arms.values():  # warm-up: every step shape compiled
                decode(engine, prompts[0], 16, False, args.depth)
                decode(engine, prompts[0], 32, True, args.depth)
            speed = {(arm, mode): [] for arm in arms for mode in ("ar", "mtp", "prefill")}
            equal = {arm: True for arm in arms}
            for r in range(args.rounds):
                order = list(arms) if r % 2 == 0 else list(reversed(arms))
                for arm in order:
                    for p in prompts:
                        ar, ar_ids = decode(arms[arm], p, args.tokens, False, args.depth)
                        mtp, mtp_ids = decode(arms[arm], p, args.tokens, True, args.depth)
                        speed[(arm, "ar")].append(ar)
                        speed[(arm, "mtp")].append(mtp)
                        equal[arm] &= ar_ids == mtp_ids
                    speed[(arm, "prefill")].append(prefill(arms[arm], long))
            med = {k: statistics.median(v) for k, v in speed.items()}
            print(f"\n{model}, {args.bits}-bit conversion, depth {args.depth}, {args.tokens} tokens x {len(prompts)} prompts, "
                  f"prefill of {len(long)} tokens, medians of {args.rounds} rounds")
            print(f"{'arm':<9} {'compute':<58} {'weights MB':>10} {'prefill tok/s':>13} {'AR tok/s':>9} {'MTP tok/s':>9} "
                  f"{'MTP/AR':>6} {'MTP==AR':>7}")
            for arm, engine in arms.items():
                print(f"{arm:<9} {engine.checkpoint.extras['compute']:<58} {weight_bytes(engine) / 1e6:10.1f} "
                      f"{med[(arm, 'prefill')]:13.1f} {med[(arm, 'ar')]:9.1f} {med[(arm, 'mtp')]:9.1f} {med[(arm, 'mtp')] / med[(arm, 'ar')]:6.2f} "
                      f"{str(equal[arm]):>7}")
            print(f"unpacked/packed: prefill {med[('unpacked', 'prefill')] / med[('packed', 'prefill')]:.2f}x, "
                  f"AR {med[('unpacked', 'ar')] / med[('packed', 'ar')]:.2f}x, "
                  f"MTP {med[('unpacked', 'mtp')] / med[('packed', 'mtp')]:.2f}x")
        finally:
            for engine in arms.values():
                engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    for model in args.models:
        measure(model, args)


if __name__ == "__main__":
    main()
