"""Predicted outputs: decode speed with a prediction vs MTP alone vs autoregressive, one process.

    python bench/prediction.py [--models tiny-dense tiny-hybrid] [--tokens 256] [--runs 3]

A client that rewrites a file sends the file as `prediction`; where the reply repeats it, a verify
takes up to 16 predicted tokens in one forward (engine/prediction.py). The tiny models follow no
instruction to rewrite a file, so the predictions here are made from the model's own greedy reply
(what a good prediction is): the reply itself ("exact"), the reply with a 6-token edit every 100
tokens ("edited"), and the reply to another prompt ("unrelated": what a wrong prediction costs);
"ar+" arms decode without the MTP head, as a model without one does.
Each prompt runs through every arm back to back (greedy, fixed length, `ignore_eos`), so machine
noise hits the arms alike; every arm's tokens are checked equal to AR's. Printed: medians of
decode tok/s, the ratios to MTP and to AR, and the predicted tokens kept / verified. Speed is
printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtplx.catalog import resolve  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402

PROMPTS = ["import codecs\n\n### Codec APIs\n\nclass Codec(codecs.Codec):\n",
           "def main():\n    parser = argparse.ArgumentParser()\n",
           "The test for main in tests/test_cp1254.py is failing.",
           "class StreamWriter(Codec, codecs.StreamWriter):\n"]
ARMS = ("ar", "mtp", "exact", "edited", "unrelated", "ar+exact", "ar+edited")  # ar+: no MTP head used


def edited(ids: list[int], tokenizer) -> list[int]:
    edit = tokenizer.encode(" # edited here\n", add_special_tokens=False)[:6]
    out = []
    for start in range(0, len(ids), 100):
        out += ids[start:start + 94] + (edit if start + 100 < len(ids) else ids[start + 94:start + 100])
    return out


def run_model(name: str, tokens: int, runs: int) -> None:
    engine = Engine(resolve(name), EngineConfig(chunk_size=256), name=name).start()
    tokenizer = engine.checkpoint.tokenizer
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    prompts = [tuple(tokenizer.encode(p)) for p in PROMPTS]

    def decode(prompt, mtp: bool, prediction=()):
        return engine.submit(GenerationRequest(prompt, params, use_mtp=mtp, prediction=tuple(prediction))).result()

    replies = [list(decode(p, False).token_ids) for p in prompts]  # also warms every shape up
    tps = {arm: [] for arm in ARMS}
    kept = {arm: [0, 0] for arm in ARMS}
    for _ in range(runs):
        for i, prompt in enumerate(prompts):
            change = edited(replies[i], tokenizer)
            arms = {"ar": (False, ()), "mtp": (True, ()), "exact": (True, replies[i]), "edited": (True, change),
                    "unrelated": (True, replies[(i + 1) % len(prompts)]), "ar+exact": (False, replies[i]),
                    "ar+edited": (False, change)}
            for arm, (mtp, prediction) in arms.items():
                fin = decode(prompt, mtp, prediction)
                if list(fin.token_ids) != replies[i]:
                    raise SystemExit(f"{name} {arm}: the reply differs from AR's: exactness broken")
                tps[arm].append(fin.stats.decode_tps)
                kept[arm][0] += fin.stats.predicted_accepted
                kept[arm][1] += fin.stats.predicted_drafted
    engine.stop()
    med = {arm: statistics.median(v) for arm, v in tps.items()}
    print(f"\n{name}: {len(prompts)} prompts x {runs} runs, {tokens} tokens each, greedy; every reply equal to AR's")
    print(f"{'arm':10s} {'decode tok/s':>12s} {'vs MTP':>8s} {'vs AR':>7s} {'predicted kept/verified':>25s}")
    for arm in ARMS:
        share = f"{kept[arm][0]}/{kept[arm][1]}" if kept[arm][1] else "-"
        print(f"{arm:10s} {med[arm]:12.1f} {med[arm] / med['mtp']:8.2f} {med[arm] / med['ar']:7.2f} {share:>25s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for name in args.models:
        run_model(name, args.tokens, args.runs)


if __name__ == "__main__":
    main()
