"""Does a long-running `mtplx serve` stay within its memory? Many agent sessions, back to back.

    python bench/soak.py [--requests 400] [--sessions 40] [--model tiny-dense]

Starts `mtplx serve` with a 64 MiB bank (and its SSD tier), then sends requests without pauses
from `--sessions` conversations that each grow by a user message per turn, across the chat,
Messages and Responses routes, half of the chat ones streamed. Prints the server's resident
memory every 50 requests and its growth per request after the first 100 (the bank, caches and
compiled kernels have filled by then). A server whose memory is bounded shows a growth near zero;
an unbounded queue or cache shows a straight line (render-ahead's idle queue before eccc846: ~7 MB a
request).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
from scratch import scratch_dir  # noqa: E402


def serve(model: str, home: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, MTPLX_HOME=home)
    proc = subprocess.Popen([sys.executable, "-m", "mtplx.cli", "serve", "-m", model, "--port", "0",
                             "--bank-ram", "64M", "--bank-ssd", "300M"], stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)
    for line in proc.stderr:
        if "serving" in line:
            return proc, line.split(" on ", 1)[1].strip()
    raise SystemExit("mtplx serve did not start")


def rss_mib(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) // 1024


def turn(client: httpx.Client, url: str, rnd: random.Random, messages: list[dict], session: str) -> None:
    route = rnd.choice(["chat", "chat", "messages", "responses"])
    if route == "chat":
        body = {"model": "m", "messages": messages, "max_tokens": rnd.randint(4, 48), "stream": rnd.random() < 0.5}
        with client.stream("POST", url + "/chat/completions", json=body, headers={"x-session-id": session}) as r:
            r.read()
    elif route == "messages":
        r = client.post(url + "/messages", json={"model": "m", "system": messages[0]["content"], "messages": messages[1:],
                                                 "max_tokens": rnd.randint(4, 48)})
    else:
        r = client.post(url + "/responses", json={"model": "m", "instructions": messages[0]["content"],
                                                  "input": messages[-1]["content"], "max_output_tokens": 16})
    if r.status_code != 200:
        raise SystemExit(f"{route}: {r.status_code} {r.text[:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--model", default="tiny-dense")
    args = parser.parse_args()
    if not Path("/proc/self/status").exists():
        raise SystemExit("needs Linux /proc to read the server's resident memory")
    words = (ROOT / "mtplx" / "engine" / "engine.py").read_text().split()
    rnd, conversations, marks = random.Random(0), {}, []
    proc, url = serve(args.model, str(scratch_dir("mtplx-soak-")))
    try:
        with httpx.Client(timeout=300) as client:
            t0 = time.monotonic()
            for i in range(args.requests + 1):
                s = rnd.randrange(args.sessions)
                messages = conversations.setdefault(s, [{"role": "system", "content": f"Agent {s}. " + " ".join(
                    words[s * 40: s * 40 + 300])}])
                messages.append({"role": "user", "content": " ".join(rnd.sample(words, rnd.randint(5, 60)))})
                turn(client, url, rnd, messages, f"s{s}")
                messages.append({"role": "assistant", "content": f"ok {i}"})
                if len(messages) > 30:
                    del messages[1:3]
                if i % 50 == 0:
                    marks.append((i, rss_mib(proc.pid)))
                    print(f"{i:5d} requests  {marks[-1][1]:6d} MiB resident  {time.monotonic() - t0:6.0f} s", flush=True)
            health = client.get(url.removesuffix("/v1") + "/health").json()["bank"]
    finally:
        proc.terminate()
        proc.wait(60)
    settled = [m for m in marks if m[0] >= 100]
    growth = (settled[-1][1] - settled[0][1]) / max(1, settled[-1][0] - settled[0][0])
    print(f"\ngrowth after the first 100 requests: {growth:.2f} MiB per request "
          f"({settled[0][1]} -> {settled[-1][1]} MiB); bank at the end: {health}")


if __name__ == "__main__":
    main()
