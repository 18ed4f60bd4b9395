"""The GIL switch interval `mtplx serve` sets, side by side through it (one run, one machine).

    python bench/switch_interval.py [--model tiny-dense] [--depth 4] [--rounds 6] [--intervals 5000 500]

Four `mtplx serve` children per model: MTP at `--depth` and `--no-mtp`, each at every interval of
`--intervals` (microseconds, MTPLX_SWITCH_INTERVAL_US; 5000 is Python's default). Each round, in
alternating order, every server gets bench/turns.py's append turn (an agent's first reply, 1 s,
then the tool result: the client-side time to the first delta) and one prose answer (client-side
decode tok/s from the first delta). Prints medians per server, MTP's append TTFT over AR's and
the decode MTP/AR per interval. Asserts nothing.

Why: the engine thread holds the GIL while it builds MLX graphs, and an MTP round builds the next
graphs while the device computes, so the server's event loop waited for the GIL to send a delta.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from mtplx import fast_path  # noqa: E402,F401  (before MLX, as every bench)
from mtplx.catalog import resolve  # noqa: E402
from mtplx.launch import SWITCH_INTERVAL_ENV  # noqa: E402
import turns  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="tiny-dense and tiny-hybrid unless given")
    ap.add_argument("--depth", type=int, help="MTP depth (default: 4 on tiny-dense, 3 on tiny-hybrid)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--intervals", type=int, nargs="+", default=[5000, 500])
    args = ap.parse_args()
    from transformers import AutoTokenizer

    for model in args.model or ["tiny-dense", "tiny-hybrid"]:
        depth = args.depth or (4 if model == "tiny-dense" else 3)
        tok = AutoTokenizer.from_pretrained(str(resolve(model)))
        cold, agent = turns.prompts(tok)
        with contextlib.ExitStack() as stack, httpx.Client(timeout=300) as client:
            urls = {(us, arm): stack.enter_context(turns.mtplx_server(
                        model, ["--depth", str(depth)] if arm == "mtp" else ["--no-mtp"], {SWITCH_INTERVAL_ENV: str(us)}))
                    for us in args.intervals for arm in ("mtp", "ar")}
            append = {k: [] for k in urls}
            decode = {k: [] for k in urls}
            for r in range(args.rounds):
                for key in (list(urls) if r % 2 == 0 else list(reversed(urls))):
                    turns.settle_all()
                    append[key].append(turns.measure(client, urls[key], cold, agent, 1.0)["append_ttft"])
                    turns.settle_all()
                    decode[key].append(turns.decode(client, urls[key], agent[0][0])["decode_tps"])
                print(f"{model}: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        med = lambda values: statistics.median([v for v in values if v is not None])
        print(f"\n{model}: MTP depth {depth}, medians of {args.rounds} rounds (client-side, streaming)")
        print(f"{'switch interval':>16} {'arm':>4} {'append TTFT ms':>15} {'decode tok/s':>13}")
        for key in urls:
            print(f"{key[0]:>13} us {key[1]:>4} {med(append[key]) * 1e3:15.1f} {med(decode[key]):13.1f}")
        for us in args.intervals:
            print(f"  {us} us: append TTFT MTP/AR {med(append[(us, 'mtp')]) / med(append[(us, 'ar')]):.2f}, "
                  f"decode MTP/AR {med(decode[(us, 'mtp')]) / med(decode[(us, 'ar')]):.2f}")


if __name__ == "__main__":
    main()
