"""Streamed decode speed through `mtplx serve`, one server process at a time: MTP vs AR.

    python bench/stream_decode.py [--model tiny-dense] [--depth 1] [--requests 6] [--rounds 2]

Each round starts `mtplx serve --depth N`, then `mtplx serve --no-mtp` (order reversed every other
round), each alone on the machine with a fresh home, and streams a prose answer (160 tokens, no
tools, so nothing is held back) `--requests` times, the first as a warm-up. Decode tok/s is client
side: (completion tokens - 1) / (total - TTFT). bench/turns.py measures the same beside mlx-lm
with every server up at once; this one measures what a single user's server streams, which is
where a per-event cost in the server shows (the event loop's hand-off, SSE writes).
Prints the speeds per request and their medians; speed is never asserted anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from mtplx.catalog import resolve  # noqa: E402
from mtplx.replay.client import stream_turn  # noqa: E402
from turns import QUESTION, mtplx_server, prompts, with_nonce  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-dense")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve(args.model)))
    _, (messages, _, _) = prompts(tok)
    arms = {f"mtp depth {args.depth}": ["--depth", str(args.depth)], "ar": ["--no-mtp"]}
    speeds: dict[str, list[float]] = {arm: [] for arm in arms}
    with httpx.Client(timeout=600) as client:
        for r in range(args.rounds):
            for arm in (list(arms) if r % 2 == 0 else list(reversed(arms))):
                with mtplx_server(args.model, arms[arm]) as url:
                    for i in range(args.requests):
                        body = {"messages": with_nonce([messages[0], {"role": "user", "content": QUESTION}]),
                                "max_tokens": 160, "temperature": 0}
                        d = stream_turn(client, url, body, {})
                        if i:  # the first compiles the step shapes
                            speeds[arm].append((d.completion_tokens - 1) / (d.total_s - d.ttft_first_token_s))
                        with contextlib.suppress(httpx.HTTPError):  # let its render-ahead finish
                            while httpx.get(url + "/health", timeout=10).json().get("idle_work"):
                                time.sleep(0.1)
    print(f"\n{args.model}: streamed decode tok/s, one `mtplx serve` at a time, {args.rounds} rounds")
    for arm, values in speeds.items():
        print(f"{arm:<12} median {statistics.median(values):7.1f}   " + " ".join(f"{v:.0f}" for v in values))
    mtp, ar = (statistics.median(v) for v in speeds.values())
    print(f"MTP/AR {mtp / ar:.2f}")


if __name__ == "__main__":
    main()
