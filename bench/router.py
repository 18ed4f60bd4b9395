"""Many agents over several engines: N `mtplx serve` instances behind an existing router.

    python bench/router.py [--model tiny-dense] [--instances 2] [--sessions 4] [--turns 3] [--smg PATH]

Each instance gets its own MTPLX_HOME (one bank directory has one owner). Three arms, each over
fresh instances: `direct` — one instance, no router (what one engine restores: the reference);
then the router, SMG (PyPI `smg`, in the test extra), twice:
- affinity: `--policy consistent_hashing --sticky-sessions --routing-key-headers <the session
  headers agents send>`: every request of a session lands on the instance that holds its bank;
- round_robin: what a plain load balancer does.
Sessions are agent conversations (distinct system prompts and tools) driven over HTTP with the
server's own replies sent back (greedy, so every arm sees the same prompts); every later turn's
cached tokens are compared with the direct arm's for the same session and turn. The default of 3
sessions over 2 instances makes round robin move every session each turn. Then (affinity only) one instance is killed with SIGKILL and every session sends one more
turn: the statuses show whether the router moved them, and their cached tokens that a moved
session starts cold. Prints one table per policy. Too slow for CI: tests/test_router.py is its short form
(2 sessions, 2 turns, affinity only).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mtplx.replay.client import ReplayRejected, stream_turn  # noqa: E402
from mtplx.synth.agent import Sizes, conversation  # noqa: E402
from scratch import scratch_dir  # noqa: E402
from mtplx.synth.corpus import Corpus  # noqa: E402
from mtplx.synth.heads import HEADS  # noqa: E402

# The session headers real agents send with default settings (docs/server.md, Sessions); the
# router hashes the first one present. Pi and Qwen Code send none: use SMG's prefix-aware policy
# (cache_aware) for them, or give them a header through their config.
SESSION_HEADERS = ["x-session-id", "session-id", "x-claude-code-session-id", "x-conversation-id", "x-client-session",
                   "session_id", "conversation_id", "x-session-affinity", "x-mtplx-session"]
POLICIES = {
    "affinity": ["--policy", "consistent_hashing", "--sticky-sessions", "--routing-key-headers", *SESSION_HEADERS],
    "round_robin": ["--policy", "round_robin"],
}
ARMS = ["direct", *POLICIES]
REPLY_TOKENS = 48


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, path: str = "/health", timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready within {timeout}s")


@contextlib.contextmanager
def instances(model: str, n: int):
    """N `mtplx serve` processes, each with its own MTPLX_HOME."""
    procs, homes = [], []
    try:
        for _ in range(n):
            port, home = free_port(), str(scratch_dir("mtplx-router-home-"))
            homes.append(home)
            proc = subprocess.Popen([sys.executable, "-m", "mtplx.cli", "serve", "--model", model, "--port", str(port)],
                                    env={**os.environ, "MTPLX_HOME": home}, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            procs.append((proc, f"http://127.0.0.1:{port}"))
        for proc, url in procs:
            wait_ready(url, proc)
        yield procs
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, _ in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        for home in homes:
            shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def router(smg: str, workers: list[str], policy: list[str]):
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="mtplx-router-smg-", suffix=".log", delete=False)
    metrics = free_port()  # its Prometheus listener defaults to a fixed port: two routers would collide
    proc = subprocess.Popen([smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                             "--prometheus-port", str(metrics), "--worker-urls", *workers, *policy],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, "/v1/models", timeout=60)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


class Session:
    """One agent conversation: the transcript's user messages and tool results, the server's replies."""

    def __init__(self, name: str, seed: int, head, model: str):
        self.name, self.model = name, model  # the router picks workers by the model they serve
        convo = conversation(seed, Corpus(), Sizes(20, 60), 3, head)
        self.messages, self.tools = convo["messages"], convo["tools"]
        self.sent, self.cursor = [self.messages[0]], 1

    def turn(self, client: httpx.Client, url: str) -> dict:
        while self.cursor < len(self.messages) and self.messages[self.cursor]["role"] != "assistant":
            self.sent.append(self.messages[self.cursor])
            self.cursor += 1
        if self.cursor >= len(self.messages):  # the transcript ran out: ask one more question
            self.sent.append({"role": "user", "content": "Summarise what we found in one sentence."})
        body = {"model": self.model, "messages": self.sent, "tools": self.tools, "max_tokens": REPLY_TOKENS, "temperature": 0}
        try:
            r = stream_turn(client, url, body, {"x-session-id": self.name})
        except (ReplayRejected, httpx.HTTPError) as exc:
            return {"status": "error", "detail": str(exc)[:120]}
        row = {"status": 200, "prompt": r.prompt_tokens, "cached": r.cached_tokens}
        self.sent.append(r.message)
        self.cursor += 1
        return row


def run_arm(name: str, args, smg: str) -> list[dict]:
    rows = []
    with contextlib.ExitStack() as stack:
        procs = stack.enter_context(instances(args.model, 1 if name == "direct" else args.instances))
        url = procs[0][1] if name == "direct" else stack.enter_context(router(smg, [u for _, u in procs], POLICIES[name]))
        client = stack.enter_context(httpx.Client(timeout=600))
        sessions = [Session(f"agent-{i}", 700 + i, HEADS[i % len(HEADS)], args.model) for i in range(args.sessions)]
        for turn in range(1, args.turns + 1):
            for s in sessions:
                rows.append({"policy": name, "phase": "normal", "turn": turn, "session": s.name, **s.turn(client, url)})
        if name == "round_robin":
            return rows
        phase = "normal"
        if name == "affinity":  # one backend dies; the router must move its sessions
            procs[0][0].send_signal(signal.SIGKILL)
            procs[0][0].wait()
            phase = "after kill"
        for s in sessions:  # direct: the same turn on one engine, the reference for the moved sessions
            rows.append({"policy": name, "phase": phase, "turn": args.turns + 1, "session": s.name, **s.turn(client, url)})
    return rows


def report(rows: list[dict]) -> None:
    direct = {(r["session"], r["turn"]): r.get("cached") for r in rows if r["policy"] == "direct" and r["status"] == 200}
    print(f"\n{'arm':<12} {'phase':<11} {'turn':>4} {'requests':>8} {'200s':>5} {'cached':>7} {'vs direct':>9} "
          f"{'>=0.99':>7}")
    keys = sorted({(r["policy"], r["phase"], r["turn"]) for r in rows}, key=lambda k: (ARMS.index(k[0]), k[2]))
    for policy, phase, turn in keys:
        group = [r for r in rows if (r["policy"], r["phase"], r["turn"]) == (policy, phase, turn)]
        ok = [r for r in group if r["status"] == 200]
        # Per session: cached here / cached by one engine on the same turn (first turns: both ~0).
        ratios = [min(r["cached"] / direct[(r["session"], turn)], 1.0) for r in ok
                  if direct.get((r["session"], turn))]
        same = sum(1 for x in ratios if x >= 0.99)
        print(f"{policy:<12} {phase:<11} {turn:>4} {len(group):>8} {len(ok):>5} {sum(r['cached'] for r in ok):>7} "
              f"{statistics.median(ratios) if ratios else float('nan'):>9.2f} {f'{same}/{len(ratios)}' if ratios else '-':>7}")
    for r in rows:
        if r["status"] != 200:
            print(f"  {r['policy']} turn {r['turn']} {r['session']}: {r['detail']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--smg", default=shutil.which("smg"), help="The smg executable (pip install smg).")
    parser.add_argument("--arm", action="append", choices=ARMS, help="All three unless given.")
    args = parser.parse_args()
    if not args.smg:
        sys.exit("bench/router.py needs SMG's router: pip install smg (or pass --smg PATH)")
    rows = []
    for name in args.arm or ARMS:
        rows += run_arm(name, args, args.smg)
    report(rows)
    print("\nvs direct: per session, cached tokens / what one engine alone restored on that turn (median);"
          "\n>=0.99: sessions at 0.99 or more of it. After the kill, the direct arm's turn is one more turn of one engine.")


if __name__ == "__main__":
    main()
