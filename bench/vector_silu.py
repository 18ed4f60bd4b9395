"""The MLP's SiLU: MLX's CPU sigmoid vs mtplx's vector SiLU (engine/fast_silu.py), side by side.

    python bench/vector_silu.py [--models tiny-dense tiny-hybrid] [--rounds 6]

One process, per model two engines on the same weights: A computes the MLP's SiLU with MLX's
sigmoid (built with MTPLX_VECTOR_SILU=off), B with the vector SiLU. Each round runs every arm on
A then on B, back to back, so the machine's load hits both alike:
- the SwiGLU alone at a decode step's, a 4-row verify's and a prefill chunk's shapes;
- the trunk's compiled forward of an AR step (1 row x 1 token), a verify (1 x 4) and a 4-row
  batch's verify (4 x 4), logits and argmax included: one runner holds two compiled forwards,
  one per SiLU, over the same caches, called alternately (rolled back after each call);
- a cold ~3k-token prompt to its first token (while A's prompt runs, mlx-lm's modules are handed
  MLX's SwiGLU back: the prefill goes through them, the decode steps through each engine's own
  compiled layers);
- decode tok/s of one session alone (median over 4 prompts) and of 4 sessions at once (MTP on,
  greedy, 128 tokens each; bench/concurrency.py's measure).
Printed: medians of the rounds and the median of the per-round B/A ratios. Speed is printed,
never asserted; give the load average with any figure quoted (2 shared cores).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mtplx import fast_path  # noqa: E402,F401  (before MLX: the fast path's BLAS)
from mtplx.catalog import resolve  # noqa: E402
from mtplx.chat import render  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402

import concurrency  # noqa: E402
import turns  # noqa: E402


@contextlib.contextmanager
def mlx_sigmoid():
    """mlx-lm's modules call MLX's SwiGLU inside the block (the arm A prefill)."""
    from mtplx.engine import fast_silu

    swapped = [m for name, m in list(sys.modules.items())
               if name.startswith("mlx_lm.models.") and getattr(m, "swiglu", None) is fast_silu.swiglu]
    for m in swapped:
        m.swiglu = fast_silu.mlx_lm_swiglu
    try:
        yield
    finally:
        for m in swapped:
            m.swiglu = fast_silu.swiglu


def swiglu_us(fn, shape, reps: int) -> float:
    import mlx.core as mx

    g, x = mx.random.normal(shape) * 4, mx.random.normal(shape)
    mx.eval(g, x)
    for _ in range(3):
        mx.eval(fn(g, x))
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn(g, x))
    return (time.perf_counter() - t) / reps * 1e6


def step_pair(engine: Engine, rows: int, tokens: int, calls: int = 120) -> tuple[float, float]:
    """Median seconds of the trunk's compiled forward (+ logits, argmax) with MLX's SwiGLU and
    with the vector one, alternated call by call on the same caches (engine B's runner)."""
    import mlx.core as mx
    from mlx_lm.models import activations
    from mlx_lm.models.cache import make_prompt_cache

    from mtplx.engine import batch_cache, cache_state, compiled, fast_silu
    from mtplx.engine.batch_cache import RaggedKVCache

    def measure():
        r = engine.runner
        recurrent = [layer.linear_attn for layer in r.model.layers if hasattr(layer, "linear_attn")]

        def build(vector: bool):
            activations.swiglu = fast_silu.swiglu if vector else fast_silu.mlx_lm_swiglu
            for layer in recurrent:
                layer.vector_silu = vector
            try:
                return compiled.build(r.inner)
            finally:
                activations.swiglu = fast_silu.swiglu
                for layer in recurrent:
                    layer.vector_silu = True

        forwards = (build(False), build(True))
        caches = []
        for b in range(rows):  # rows of different lengths, as sessions are
            cache = make_prompt_cache(r.checkpoint.model)
            with r.small_forwards():
                r.hidden(mx.array([[7] * (200 + 9 * b)]), cache)
                mx.eval([c.state for c in cache])
            caches.append(cache)
        cache = caches[0] if rows == 1 else batch_cache.merge(caches)
        fed = mx.full((rows, tokens), 5, dtype=mx.int32)
        times: tuple[list, list] = ([], [])
        for i in range(calls + 10):
            for arm, forward in enumerate(forwards):
                saved = cache_state.recurrent_copy(cache)
                with r.small_forwards():
                    t = time.perf_counter()
                    mx.eval(mx.argmax(r.logits(forward(fed, cache)), axis=-1))
                    elapsed = time.perf_counter() - t
                if i >= 10:
                    times[arm].append(elapsed)
                cache_state.rewind(cache, saved, tokens)
                for layer in cache:
                    if isinstance(layer, RaggedKVCache):
                        layer.trim_rows([tokens] * rows)
                mx.eval([c.state for c in cache])
        return statistics.median(times[0]), statistics.median(times[1])

    return engine.call(measure)


def cold_ttft(engine: Engine, cold) -> float:
    msgs, tools = cold
    tok = engine.checkpoint.tokenizer
    msgs = [dict(msgs[0], content=f"[run {uuid.uuid4().hex[:12]}] " + msgs[0]["content"]), *msgs[1:]]
    request = GenerationRequest(tuple(render(tok, msgs, tools)), SamplingParams(max_tokens=2), source="bench")
    return engine.submit(request).result().stats.ttft_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    from mtplx.engine import fast_silu

    for name in args.models:
        os.environ[fast_path.VECTOR_SILU_ENV] = "off"
        a = Engine(resolve(name), EngineConfig(use_mtp=True), name=f"{name} A").start()
        os.environ[fast_path.VECTOR_SILU_ENV] = "on"
        b = Engine(resolve(name), EngineConfig(use_mtp=True), name=f"{name} B").start()
        os.environ.pop(fast_path.VECTOR_SILU_ENV)
        try:
            if not b.checkpoint.extras["compute"].endswith(" + vector silu"):
                print(f"{name}: the vector SiLU does not run here ({b.checkpoint.extras['compute']})")
                continue
            batch = concurrency.prompts(a, 4)
            cold, _ = turns.prompts(a.checkpoint.tokenizer)
            for e in (a, b):
                concurrency.run(e, batch, 16)
            shapes = {"1x640 (AR step)": (1, 1, 640), "16x640 (4-row verify)": (4, 4, 640), "256x640 (prefill chunk)": (1, 256, 640)}
            rows: dict[str, list] = {}
            for r in range(args.rounds):
                got = {}
                for label, shape in shapes.items():
                    reps = 50 if shape[1] > 100 else 300
                    got[f"swiglu {label} us"] = (swiglu_us(fast_silu.mlx_lm_swiglu, shape, reps),
                                                 swiglu_us(fast_silu.swiglu, shape, reps))
                for label, (n, t) in {"AR step": (1, 1), "verify, 1 row": (1, 4), "verify, 4 rows": (4, 4)}.items():
                    got[f"forward {label} ms"] = tuple(x * 1e3 for x in step_pair(b, n, t))
                with mlx_sigmoid():
                    cold_a = cold_ttft(a, cold)
                got["cold ~3k TTFT s"] = (cold_a, cold_ttft(b, cold))
                got["alone tok/s"] = tuple(statistics.median(concurrency.run(e, [p], 128)[0] for p in batch) for e in (a, b))
                got["4 at once tok/s"] = tuple(concurrency.run(e, batch, 128)[0] for e in (a, b))
                for k, v in got.items():
                    rows.setdefault(k, []).append(v)
                print(f"{name}: round {r + 1}/{args.rounds} (load average {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
            print(f"\n{name}: A = MLX's sigmoid, B = vector SiLU; medians of {args.rounds} rounds "
                  f"(load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
            print(f"{'figure':<34} {'A':>10} {'B':>10} {'B vs A (per-round median)':>26}")
            for k, vs in rows.items():
                ma, mb = statistics.median(v[0] for v in vs), statistics.median(v[1] for v in vs)
                faster = k.endswith("tok/s")
                ratio = statistics.median((v[1] / v[0]) if faster else (v[0] / v[1]) for v in vs)
                print(f"{k:<34} {ma:>10.3f} {mb:>10.3f} {ratio:>20.2f}x {'faster' if ratio >= 1 else 'slower'}")
            ratio_a = statistics.median(v[0] for v in rows["4 at once tok/s"]) / statistics.median(v[0] for v in rows["alone tok/s"])
            ratio_b = statistics.median(v[1] for v in rows["4 at once tok/s"]) / statistics.median(v[1] for v in rows["alone tok/s"])
            print(f"4 at once / alone: A {ratio_a:.2f}x, B {ratio_b:.2f}x")
        finally:
            a.stop()
            b.stop()


if __name__ == "__main__":
    main()
