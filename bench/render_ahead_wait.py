"""How long a request waits for render-ahead that is running when it arrives: chunks that step
aside between layers (the default) vs chunks that run whole (MTPLX_RENDER_AHEAD_PREEMPT=off).

    python bench/render_ahead_wait.py [--model tiny-hybrid] [--turns 5] [--rounds 2]

The agent workload of bench/turns.py, in process: a cold ~3k-token conversation (its render-ahead
is long and still running), then an agent turn, a 1 s pause, and the append turn (its tool result).
Per append turn: the wait from submission to its restore (what background work costs it) and its
time to first token, from the engine's own event times. Each round runs one engine per arm in
turn, alone on the machine (the order flips every round); prints medians and the ratio on/off.
Speed is never asserted anywhere.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtplx.catalog import resolve  # noqa: E402
from mtplx.chat import chat_request  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402
from mtplx.events import FirstToken, Queued, Restored  # noqa: E402
from mtplx.launch import open_engine  # noqa: E402
from turns import REPLY_TOKENS, prompts, with_nonce  # noqa: E402
from scratch import scratch_dir  # noqa: E402

ARMS = {"steps aside": "on", "whole chunks": "off"}


def measure(model: str, preempt: str, turns: int, workload) -> list[tuple[float, float]]:
    cold, (messages, tool_msg, tools) = workload
    os.environ["MTPLX_RENDER_AHEAD_PREEMPT"] = preempt
    os.environ["MTPLX_HOME"] = str(scratch_dir("mtplx-bench-home-"))
    engine = open_engine(model, ssd=False, receipts=False)
    tok = engine.checkpoint.tokenizer

    def turn(msgs, tools, n, session):
        request = chat_request(tok, msgs, tools, sampling=SamplingParams(max_tokens=n, temperature=0),
                               session=session, source="api")
        return list(engine.submit(request))

    out = []
    try:
        for i in range(turns + 1):
            turn(with_nonce(cold[0]), cold[1], 8, None)  # queues a long render-ahead
            msgs = with_nonce(messages)
            first = turn(msgs, tools, REPLY_TOKENS, f"agent-{i}")
            time.sleep(1.0)  # the client runs its tool; the cold conversation's render-ahead runs
            events = turn([*msgs, first[-1].reply, tool_msg], tools, 8, f"agent-{i}")
            at = {type(e): e.t for e in events if isinstance(e, (Queued, Restored, FirstToken))}
            if i:  # the first one compiles step shapes
                out.append((at[Restored] - at[Queued], at[FirstToken] - at[Queued]))
            engine.settle()
    finally:
        engine.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-hybrid")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    workload = prompts(AutoTokenizer.from_pretrained(str(resolve(args.model))))
    rows: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in (list(ARMS) if r % 2 == 0 else list(reversed(ARMS))):
            rows[arm] += measure(args.model, ARMS[arm], args.turns, workload)
    med = {arm: (statistics.median(w for w, _ in v) * 1e3, statistics.median(t for _, t in v) * 1e3)
           for arm, v in rows.items()}
    print(f"\n{args.model}: append turn while render-ahead runs, {len(rows['steps aside'])} turns per arm (ms, medians)")
    print(f"{'arm':<14} {'wait to restore':>15} {'TTFT':>8}   waits")
    for arm, (wait, ttft) in med.items():
        print(f"{arm:<14} {wait:15.1f} {ttft:8.1f}   " + " ".join(f"{w * 1e3:.0f}" for w, _ in rows[arm]))
    on, off = med["steps aside"], med["whole chunks"]
    print(f"steps aside / whole chunks: wait {on[0] / off[0]:.2f}, TTFT {on[1] / off[1]:.2f}")


if __name__ == "__main__":
    main()
