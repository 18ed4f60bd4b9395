"""A reply sent back at once: how much of the next turn each server restores, with the reply
rendered as the ids the model sampled (mtplx today) and re-encoded from its text (MTPLX_REPLY_IDS=off,
what mtplx did before), side by side on the same replies.

    python bench/resend.py [--model tiny-dense] [--runs 8] [--tokens 400] [--wait 0]

Each run sends Codex's recorded first request (tests/fixtures/clients/codex, the Responses API,
its tools and instructions) with a new question, temperature 1, then `--wait` seconds after the
reply its second request as Codex builds it: the input, our output items, then the output of each
function call (Codex ran it) or, after a reply without calls, a new user message (whose template
drops the reply's reasoning: that part only render-ahead can prepare).
Both servers run in this process on their own engines and see the same question and seed; their
replies differ only where their prompts do. Prints, per run and server: reply tokens, whether the
sampled ids were the tokenizer's encoding of the text, the second turn's cached / ceiling and
what the receipt gave as the cause of any shortfall.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from mtplx.bank.bank import BankConfig  # noqa: E402
from mtplx.catalog import resolve  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.events import Finished, Restored  # noqa: E402
from mtplx.reply_ids import ReplyIds  # noqa: E402
from mtplx.server.app import create_app  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "clients" / "codex" / "0001-v1_responses.json"
QUESTIONS = ["Explain what app.py does, step by step, in detail.", "Describe every function in app.py and how they relate.",
             "Walk me through how app.py handles errors, with examples.", "Write a detailed review of app.py.",
             "Explain the design of app.py and what you would change.", "List the risks in app.py and explain each one.",
             "Describe how to test app.py thoroughly.", "Explain app.py to a new contributor, in depth."]


def serve(model: str, splice: bool):
    engine = Engine(resolve(model), EngineConfig(), name=model, bank=BankConfig()).start()
    ReplyIds.of(engine.checkpoint.tokenizer).enabled = splice
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    seen: list = []
    engine.listeners.append(lambda e: seen.append(e) if isinstance(e, (Finished, Restored)) else None)
    return engine, server, f"http://127.0.0.1:{port}", seen


def items_of(stream: str) -> list[dict]:
    out = []
    for block in stream.split("\n\n"):
        data = [line[6:] for line in block.splitlines() if line.startswith("data: ")]
        if data and data[0] != "[DONE]":
            event = json.loads(data[0])
            if event.get("type") == "response.output_item.done":
                item = event["item"]  # Codex keeps a reasoning item's sealed blob, not its text
                out.append({k: v for k, v in item.items() if k != "content"} if item["type"] == "reasoning" else item)
    return out


def one_run(url: str, seen: list, engine: Engine, k: int, tokens: int, wait: float) -> dict:
    recorded = json.loads(FIXTURE.read_text())["body"]
    body = dict(recorded, temperature=1.0, seed=k, max_output_tokens=tokens, prompt_cache_key=f"resend-{k}-{time.time()}")
    body["input"] = list(recorded["input"][:-1]) + [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTIONS[k % len(QUESTIONS)]}]}]
    seen.clear()
    r = httpx.post(url + "/v1/responses", json=body, timeout=600)
    r.raise_for_status()
    fin = next(e for e in seen if isinstance(e, Finished))
    ids = list(fin.token_ids)
    tok = engine.checkpoint.tokenizer
    canonical = tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    time.sleep(wait)
    body2 = dict(body, max_output_tokens=4)
    items = items_of(r.text)
    calls = [i for i in items if i["type"] == "function_call"]
    # As Codex goes on: the output of each call it ran, else the user's next message
    follow = [{"type": "function_call_output", "call_id": c["call_id"], "output": "exit 0"} for c in calls] or [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now suggest one improvement."}]}]
    body2["input"] = body["input"] + items + follow
    seen.clear()
    httpx.post(url + "/v1/responses", json=body2, timeout=600).raise_for_status()
    restored = next(e for e in seen if isinstance(e, Restored))
    engine.settle()  # the next run starts from a quiet engine
    return {"reply": len(ids), "canonical": canonical, "kinds": "+".join(sorted({i["type"][:9] for i in items})), "cached": restored.cached_tokens, "ceiling": restored.ceiling,
            "cause": restored.shortfall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=400, help="max_output_tokens of the first turn")
    parser.add_argument("--wait", type=float, default=0.0, help="seconds between the reply and the resend")
    args = parser.parse_args()
    servers = {"mtplx (reply ids)": serve(args.model, True), "re-encoded text": serve(args.model, False)}
    rows = {label: [] for label in servers}
    print(f"{args.model}: Codex's second request {args.wait:g} s after the reply, cached / ceiling")
    print(f"{'run':>3}  {'server':<18} {'reply':>5} {'items':<28} {'canonical':>9} {'cached/ceiling':>16} {'ratio':>6}  cause")
    for k in range(args.runs):
        for label, (engine, _, url, seen) in servers.items():
            row = one_run(url, seen, engine, k, args.tokens, args.wait)
            rows[label].append(row)
            ratio = min(row["cached"], row["ceiling"]) / row["ceiling"] if row["ceiling"] else float("nan")
            print(f"{k:>3}  {label:<18} {row['reply']:>5} {row['kinds']:<28} {str(row['canonical']):>9} "
                  f"{row['cached']:>7}/{row['ceiling']:<8} {ratio:>6.3f}  {row['cause'] or '-'}", flush=True)
    print()
    for label, got in rows.items():
        ratios = [min(r["cached"], r["ceiling"]) / r["ceiling"] for r in got if r["ceiling"]]
        print(f"{label:<18} ratio median {statistics.median(ratios):.3f}  min {min(ratios):.3f}  "
              f"runs at > 0.99: {sum(x > 0.99 for x in ratios)}/{len(ratios)}  "
              f"non-canonical replies: {sum(not r['canonical'] for r in got)}/{len(got)}")
    for engine, server, _, _ in servers.values():
        server.should_exit = True
        engine.stop()


if __name__ == "__main__":
    main()
