"""Every sample transcript replayed against mtplx (in-process) and a fresh `mlx_lm.server` serving
the same model, then `mtplx receipts compare` of the two runs, per transcript.

    python bench/replay_vs_mlx_lm.py [--model tiny-dense] [--pause 2] [--transcripts sample_transcripts/*.json]

It runs the real CLI commands (`mtplx replay`, `mtplx replay --base-url`, `mtplx receipts compare`)
in a temporary MTPLX_HOME, so what it prints is what a user gets typing them. Each transcript gets
a fresh mlx_lm.server: the replay contract requires an uncached first turn, and the transcripts
share system heads.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from peer_server import mlx_lm_server  # noqa: E402
from scratch import scratch_dir  # noqa: E402

MTPLX = [sys.executable, "-m", "mtplx.cli"]


def replay(transcript: Path, model: str, env: dict, pause: float, base_url: str | None = None) -> str:
    cmd = MTPLX + ["replay", str(transcript), "--model", model, "--pause", str(pause)] + (["--base-url", base_url] if base_url else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    print(out.stdout, end="")
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return re.search(r"== run (\S+)", out.stdout).group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--transcripts", nargs="+", type=Path, default=sorted((ROOT / "sample_transcripts").glob("*.json")))
    parser.add_argument("--pause", type=float, default=0.0, help="Seconds between turns (an agent's tool time).")
    args = parser.parse_args()
    env = dict(os.environ, MTPLX_HOME=str(scratch_dir("mtplx-replay-peer-")))
    failed = []
    for transcript in args.transcripts:
        print(f"\n#### {transcript.name} on {args.model}")
        mine = replay(transcript, args.model, env, args.pause)
        with mlx_lm_server(args.model) as url:
            peer = replay(transcript, args.model, env, args.pause, url)
        print(f"$ mtplx receipts compare {mine} {peer}   (A = mtplx in-process, B = mlx_lm.server)")
        out = subprocess.run(MTPLX + ["receipts", "compare", mine, peer], env=env, capture_output=True, text=True, cwd=ROOT)
        print(out.stdout + out.stderr, end="")
        if out.returncode:
            failed.append(transcript.name)
    print(f"\nreceipts in {env['MTPLX_HOME']}/receipts.db; output parity failures: {failed or 'none'}")


if __name__ == "__main__":
    main()
