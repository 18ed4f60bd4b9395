"""An agent's decode through `mtplx tui`'s endpoint (the TUI live in tmux) vs through `mtplx serve`.

    python bench/tui_endpoint.py [--model tiny-hybrid] [--depth 3] [--rounds 8] [--gap 1.5] [--attach]

With --attach the first arm is a `mtplx serve` that a `mtplx tui --attach` follows (in tmux: it
reads every engine event through GET /v1/mtplx/events), the second one that nobody watches.

`mtplx tui` serves the endpoint from the process that draws the dashboard, and every engine event
of the agent's request reaches the dashboard too. Each round, in alternating order, both servers
get bench/turns.py's prose answer (client-side decode tok/s from the first delta), `--gap` seconds
apart (an agent runs its tool between turns; 0.3 keeps them nearly back to back, so the dashboard's
drawing of each finished turn overlaps the next). Prints the medians and the paired TUI/serve ratio.
Needs tmux. Asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402

import turns  # noqa: E402
from mtplx.catalog import resolve  # noqa: E402
from peer_server import free_port  # noqa: E402


def wait_healthy(url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} never became healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-hybrid")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--gap", type=float, default=1.5)
    ap.add_argument("--attach", action="store_true", help="the TUI attached to a server of its own instead of serving")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve(args.model)))
    system = turns.prompts(tok)[1][0][0]
    flags = ["-m", args.model, "--depth", str(args.depth)]
    session = f"mtplx-bench-{os.getpid()}"
    watched = "mtplx serve + tui --attach" if args.attach else "mtplx tui"
    with contextlib.ExitStack() as stack:
        serve_flags = ["--depth", str(args.depth)]
        urls = {watched: stack.enter_context(turns.mtplx_server(args.model, serve_flags)) if args.attach
                else f"http://127.0.0.1:{free_port()}",
                "mtplx serve": stack.enter_context(turns.mtplx_server(args.model, serve_flags))}
        tui_flags = (f"--attach {urls[watched]}" if args.attach else
                     f"{' '.join(flags)} --port {urls[watched].rsplit(':', 1)[1]}")
        command = (f"cd {ROOT} && MTPLX_HOME={tempfile.mkdtemp(prefix='mtplx-bench-tui-')} "
                   f"{sys.executable} -m mtplx.cli tui {tui_flags}")
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "42", command], check=True)
        stack.callback(subprocess.run, ["tmux", "kill-session", "-t", session], stderr=subprocess.DEVNULL)
        wait_healthy(urls[watched])  # the TUI's own endpoint (attached: the server it follows, up already)
        speeds = {label: [] for label in urls}
        with httpx.Client(timeout=600) as client:
            for url in urls.values():
                turns.decode(client, url, system)  # warm up
            for r in range(args.rounds):
                for label in list(urls) if r % 2 == 0 else list(reversed(urls)):
                    time.sleep(args.gap)
                    speeds[label].append(turns.decode(client, urls[label], system)["decode_tps"])
    print(f"\n{args.model}, MTP depth {args.depth}, {args.rounds} rounds, {args.gap} s between answers "
          f"(client-side decode tok/s, medians)")
    for label, values in speeds.items():
        print(f"  {label:<26} {statistics.median(values):8.1f}   " + " ".join(f"{v:.0f}" for v in values))
    paired = statistics.median(a / b for a, b in zip(speeds[watched], speeds["mtplx serve"]))
    print(f"  {watched} / mtplx serve (paired per round) {paired:.2f}")


if __name__ == "__main__":
    main()
