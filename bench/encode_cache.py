"""Chat-encode cache: the cost of a hit (hash the request body, copy the tokens) vs a full
render + tokenize, at 32 / 128 / 512 messages.

    python bench/encode_cache.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer  # noqa: E402

from mtplx.catalog import resolve  # noqa: E402
from mtplx.chat import render  # noqa: E402
from mtplx.server.encode_cache import EncodeCache  # noqa: E402
from mtplx.synth.agent import Sizes, conversation  # noqa: E402
from mtplx.synth.corpus import Corpus  # noqa: E402


def p50(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    tok = AutoTokenizer.from_pretrained(str(resolve("tiny-dense")))
    corpus = Corpus()
    first = conversation(500, corpus, Sizes(4, 10), 1)
    messages, seed = list(first["messages"]), 501
    while len(messages) < 512:
        messages += conversation(seed, corpus, Sizes(4, 10), 3)["messages"][1:]
        seed += 1
    cache = EncodeCache("bench", tok.chat_template)
    print(f"{'messages':>8} {'tokens':>7} {'render+tokenize ms':>19} {'cache hit ms':>13} {'ratio':>7}")
    for n in (32, 128, 512):
        body = json.dumps({"model": "tiny-dense", "messages": messages[:n], "tools": first["tools"]}).encode()
        full = p50(lambda: render(tok, messages[:n], first["tools"]), 5)
        tokens = render(tok, messages[:n], first["tools"])
        cache.put(cache.key("chat", body), tokens, {})
        hit = p50(lambda: cache.get(cache.key("chat", body)), 50)
        print(f"{n:>8} {len(tokens):>7} {full:19.2f} {hit:13.3f} {full / hit:6.0f}x")


if __name__ == "__main__":
    main()
