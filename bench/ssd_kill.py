"""Crash safety of the SSD tier: kill -9 a writer repeatedly, then check what the next open sees.

    python bench/ssd_kill.py [--kills 20] [--model tiny-hybrid]

Each round starts a child that computes real bank entries on the embedded model and then persists
copies of them as fast as the disk allows into one bank directory, and kills it with SIGKILL at a
random moment (so most kills land inside a write). After each kill the tier is opened the way
a restarted server opens it; the script checks that no temp file survives the open, that every
entry in the manifest loads and validates (no partial entry is ever served), and that the bytes on
disk stay within the budget.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHILD = """
import sys, itertools, dataclasses
from pathlib import Path
from mtplx.bank.bank import BankConfig
from mtplx.bank.ssd import SsdConfig
from mtplx.catalog import resolve
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
root, model, budget = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
engine = Engine(resolve(model), EngineConfig(chunk_size=64), bank=BankConfig(),
                ssd=SsdConfig(root, budget_bytes=budget, free_floor_bytes=0)).start()
# Real entries from real turns, then writes as fast as the disk takes them, so kills land mid-write.
for i in range(3):
    prompt = tuple(range(5, 5 + 300 + 150 * i))
    engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=8), session=f"s{i}")).result()
engine.settle()
print("ready", flush=True)
def hammer():
    bank = engine.bank
    seeds = list(bank.entries.values())
    for i in itertools.count():
        entry = dataclasses.replace(seeds[i % len(seeds)], entry_id=f"e_kill{i:06d}")
        bank.ssd.write(entry)
engine.call(hammer)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--model", default="tiny-hybrid")
    parser.add_argument("--budget-mb", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from mtplx.bank.ssd import CorruptEntry, SsdConfig, SsdTier

    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="mtplx-kill-"))
    budget = args.budget_mb << 20
    failures, totals = 0, []
    for k in range(args.kills):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(root), args.model, str(budget)],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        child.stdout.readline()  # "ready": the model is loaded, writes are about to start
        time.sleep(rng.uniform(0.2, 1.5))
        temps_before = len(list(root.glob(".tmp-*")))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        tier = SsdTier(SsdConfig(root, budget_bytes=budget, free_floor_bytes=0))  # what a restart does
        temps_after = len(list(root.glob(".tmp-*")))
        bad = 0
        for view in tier.views():  # each entry as the engine would ask for it (its identity carries the compute path)
            try:
                tier.load(view.entry_id, view.identity)
            except CorruptEntry:
                bad += 1
        used = tier.stats()["bytes"]
        on_disk = sum(p.stat().st_size for p in root.glob("*.safetensors"))
        ok = temps_after == 0 and bad == 0 and used <= budget and on_disk == used
        failures += not ok
        totals.append(used)
        print(f"kill {k + 1:>2}: temp files at kill {temps_before}, after open {temps_after}; entries {len(tier.views())}, "
              f"invalid {bad}; bytes {used / 2**20:.2f} MiB of {budget / 2**20:.0f} MiB (files {on_disk / 2**20:.2f}) "
              f"{'ok' if ok else 'FAIL'}")
        tier.close()
    print(f"{args.kills} kills: {args.kills - failures} clean, {failures} failed; max bytes {max(totals) / 2**20:.2f} MiB "
          f"(budget {budget / 2**20:.0f} MiB)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
