"""Short-step attention on MLX's CUDA backend (mtplx/engine/gpu_attention.py) on and off.

    python bench/gpu_attention.py [--models tiny-dense tiny-hybrid] [--tokens 128]

Needs MLX's CUDA backend (mlx-cuda-13; on a lent H200 it must be carried in, see the project's
GPU notes). Each arm runs in a child process (MTPLX_GPU_ATTENTION=off is the other arm; the route
is installed at model load). A child warms up on one prompt, then decodes four fresh prompts
greedily, AR and MTP at depth 3, and times a 4-token forward of the model at six cache lengths it
has not seen. Fresh lengths are the point: on CUDA, MLX builds its multi-query attention per
shape. Prints tok/s, MTP/AR and whether MTP's tokens equal AR's (on CUDA they need not: a 1-row
and a (k+1)-row product round differently, docs/engine.md). Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Write a short story about a lighthouse keeper.",
           "Explain how a hash map works, with an example in Python code.",
           "List five facts about the moon and explain each one briefly please.",
           "Describe a walk through a forest in autumn, in detail.",
           "What is the difference between a process and a thread?"]


def child(name: str, tokens: int) -> None:
    sys.path.insert(0, str(ROOT))
    import mtplx  # noqa: F401  (before MLX)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mtplx.catalog import resolve
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams

    arm = os.environ.get("MTPLX_GPU_ATTENTION", "on")
    engine = Engine(resolve(name), EngineConfig(), name=name).start()
    tok = engine.checkpoint.tokenizer
    print(f"{name} [{arm}] device {mx.default_device()}", flush=True)
    engine.submit(GenerationRequest(tuple(tok.encode(PROMPTS[0])), SamplingParams(max_tokens=64),
                                    use_mtp=True, depth=3)).result()  # warm-up: first compiles
    for text in PROMPTS[1:]:
        prompt = tuple(tok.encode(text))
        rates, outputs = [], []
        for kw in (dict(use_mtp=False), dict(use_mtp=True, depth=3)):
            start = time.perf_counter()
            result = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=tokens), **kw)).result()
            rates.append(len(result.token_ids) / (time.perf_counter() - start))
            outputs.append(result.token_ids)
        print(f"{name} [{arm}] prompt of {len(prompt)} tokens: AR {rates[0]:.0f} tok/s, MTP d3 {rates[1]:.0f} tok/s, "
              f"MTP/AR {rates[1] / rates[0]:.2f}, same tokens {outputs[0] == outputs[1]}", flush=True)
    engine.stop()
    model = engine.checkpoint.model
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(tok.encode(PROMPTS[2]))]), cache=cache))
    times = []
    for _ in range(6):
        start = time.perf_counter()
        mx.eval(model(mx.array([[5] * 4]), cache=cache))
        times.append((time.perf_counter() - start) * 1000)
    print(f"{name} [{arm}] 4-token forward at 6 new cache lengths (ms): " + " ".join(f"{t:.1f}" for t in times), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.tokens)
    for name in args.models:
        for arm in ("on", "off"):
            env = dict(os.environ, MTPLX_GPU_ATTENTION=arm)
            subprocess.run([sys.executable, __file__, "--child", name, "--tokens", str(args.tokens)], env=env, check=False)


if __name__ == "__main__":
    main()
