"""One environment variable's values side by side through `mtplx serve` (one run, one machine).

    python bench/serve_ab.py [--model tiny-dense] [--depth 4] [--rounds 6]
                             [--variable MTPLX_SWITCH_INTERVAL_US] [--values 5000 500]

Per model, `mtplx serve` children: MTP at `--depth` and `--no-mtp`, each with `--variable` set to
every one of `--values`. Each round, in alternating order, every server gets bench/turns.py's
append turn (an agent's first reply, 1 s, then the tool result: the client-side time to the first
delta) and one prose answer (client-side decode tok/s from the first delta). Prints medians per
server, MTP's append TTFT over AR's and the decode MTP/AR per value. Asserts nothing.

Written for the GIL switch interval, which `mtplx serve` sets otherwise than an engine in process
(launch.open_engine says why); also run for the small-row kernel's helper thread
(`--variable MTPLX_SMALL_GEMM_THREADS --values on off`, docs/engine.md) and the stream interval
(`--variable MTPLX_STREAM_INTERVAL_MS --values 0 10`).
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
import turns  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="tiny-dense and tiny-hybrid unless given")
    ap.add_argument("--depth", type=int, help="MTP depth (default: 4 on tiny-dense, 3 on tiny-hybrid)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--variable", default="MTPLX_SWITCH_INTERVAL_US")
    ap.add_argument("--values", nargs="+", default=["5000", "500"])
    args = ap.parse_args()
    from transformers import AutoTokenizer

    for model in args.model or ["tiny-dense", "tiny-hybrid"]:
        depth = args.depth or (4 if model == "tiny-dense" else 3)
        tok = AutoTokenizer.from_pretrained(str(resolve(model)))
        cold, agent = turns.prompts(tok)
        with contextlib.ExitStack() as stack, httpx.Client(timeout=300) as client:
            urls = {(value, arm): stack.enter_context(turns.mtplx_server(
                        model, ["--depth", str(depth)] if arm == "mtp" else ["--no-mtp"], {args.variable: value}))
                    for value in args.values for arm in ("mtp", "ar")}
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
        print(f"{args.variable:>32} {'arm':>4} {'append TTFT ms':>15} {'decode tok/s':>13}")
        for key in urls:
            print(f"{key[0]:>32} {key[1]:>4} {med(append[key]) * 1e3:15.1f} {med(decode[key]):13.1f}")
        for value in args.values:
            print(f"  {value}: append TTFT MTP/AR {med(append[(value, 'mtp')]) / med(append[(value, 'ar')]):.2f}, "
                  f"decode MTP/AR {med(decode[(value, 'mtp')]) / med(decode[(value, 'ar')]):.2f}")


if __name__ == "__main__":
    main()
