"""`mtplx tune`: measure AR and every MTP depth on this machine, keep the fastest.

All arms decode the same greedy prompt in one process, interleaved over two rounds, so machine
noise hits them alike; the result is stored per model identity (see settings.py).
"""

from __future__ import annotations

from typing import Callable

from mtplx.catalog import resolve
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.settings import store_tuned

PROMPT = [{"role": "user", "content": "Read src/parser/events.py and explain what it does."}]


def tune_model(model: str, tokens: int = 128, save: bool = True, echo: Callable[[str], None] = print) -> dict:
    path = resolve(model)
    engine = Engine(path, EngineConfig()).start()
    try:
        if not engine.has_mtp:
            echo(f"{model} has no MTP weights: autoregressive decoding is its only mode")
            return {"ar": None}
        ids = tuple(engine.checkpoint.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True))
        arms = {"ar": (False, 1)} | {f"depth {d}": (True, d) for d in range(1, 5)}
        best: dict[str, float] = {name: 0.0 for name in arms}
        engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=8))).result()  # warm-up
        for _ in range(2):
            for name, (mtp, depth) in arms.items():
                request = GenerationRequest(ids, SamplingParams(max_tokens=tokens), use_mtp=mtp, depth=depth, source="tune")
                stats = engine.submit(request).result().stats
                best[name] = max(best[name], stats.decode_tps or 0.0)
        for name, tps in best.items():
            echo(f"{name:<8} {tps:7.1f} tok/s  ({tps / best['ar']:.2f}x AR)")
        winner = max(best, key=best.get)
        mtp, depth = arms[winner]
        echo(f"fastest: {winner}" + (" (stored as this model's default)" if save else ""))
        if save:
            store_tuned(engine.checkpoint.identity, mtp, depth, best)
        return best
    finally:
        engine.stop()
