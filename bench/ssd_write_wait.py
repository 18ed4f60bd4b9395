"""Does an agent's next request wait for the bank's SSD write of the previous turn?

    python bench/ssd_write_wait.py [--model tiny-dense] [--rounds 9] [--tool-outputs 5] [--pause 0.05]

An agent's tool loop sends its next request as soon as a quick tool returns, while the bank is
still persisting the previous turn's entry (hundreds of MB at long context). Three engines on the
same model in one process, all with a RAM bank: one without an SSD tier, one with it (files
written on the bank's I/O thread, as mtplx runs), and one with the SSD tier written the way it was
before that, wholly on the engine thread as one idle step. Each takes a long agent conversation
(a read_file tool output per round, `--tool-outputs` of them), then `--rounds` pairs of short
follow-ups, each sent `--pause` seconds after the same engine's previous reply; the second of a
pair, sent while the first one's entry is being persisted, is timed. The engines take turns, so
machine noise hits all alike, and every engine settles first, so no other arm's write runs meanwhile. Printed: the median and worst warm TTFT of each, the ratios to the
RAM-only arm, the SSD file writes' sizes and durations, and whether every follow-up restored all
but its new tokens. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtplx import fast_path  # noqa: E402,F401  (before MLX: the fast path)
from mtplx.bank import ssd as ssd_tier  # noqa: E402
from mtplx.bank.bank import BankConfig  # noqa: E402
from mtplx.bank.ssd import SsdConfig  # noqa: E402
from mtplx.catalog import resolve  # noqa: E402
from mtplx.chat import render  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]
FILE = "\n".join(f"line {i}: def function_{i}(x): return x * {i}  # what it does" for i in range(120))


def conversation(outputs: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Refactor the project."}]
    for i in range(outputs):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/m{i}.py"})}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": FILE}]
    return messages


def on_engine_thread(bank) -> None:
    """Make `bank` persist as mtplx did before the I/O thread: the whole write in one idle step."""
    def persist_one(wait=0.0):
        entry = bank.pending_writes.popleft()
        if entry.entry_id in bank.entries:
            bank.ssd.write(entry)
            bank.ssd_views[entry.entry_id] = entry.view()
        return True

    bank.persist_one = persist_one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tool-outputs", type=int, default=5)
    parser.add_argument("--pause", type=float, default=0.05)
    args = parser.parse_args()
    writes = []
    write_file = ssd_tier.SsdTier.write_file

    def timed(self, staged):
        start = time.perf_counter()
        out = write_file(self, staged)
        writes.append((out[0], time.perf_counter() - start))
        return out

    ssd_tier.SsdTier.write_file = timed
    config = EngineConfig(context_window=65536)
    with tempfile.TemporaryDirectory(prefix="mtplx-ssd-wait-") as root:
        ssd = lambda sub: SsdConfig(Path(root) / sub, budget_bytes=16 << 30, free_floor_bytes=0)
        arms = {"ram only": Engine(resolve(args.model), config, name=args.model, bank=BankConfig()).start(),
                "ram + ssd": Engine(resolve(args.model), config, name=args.model, bank=BankConfig(), ssd=ssd("a")).start(),
                "ssd on engine thread": Engine(resolve(args.model), config, name=args.model, bank=BankConfig(),
                                               ssd=ssd("b")).start()}
        engine = arms["ssd on engine thread"]
        engine.call(lambda: on_engine_thread(engine.bank))
        try:
            tok = arms["ram only"].checkpoint.tokenizer
            base = conversation(args.tool_outputs)
            prompt = tuple(render(tok, base, TOOLS))
            for engine in arms.values():
                engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=4), session="agent")).result()
            ttft = {arm: [] for arm in arms}
            full = True
            for r in range(args.rounds):
                # per engine, two follow-ups `pause` apart: the first one's entry is being persisted
                # when the second (the one timed) arrives, as in an agent's quick tool loop
                asks = [tuple(render(tok, base + [{"role": "user", "content": f"And step {r}.{i}?"}], TOOLS)) for i in (0, 1)]
                for arm in list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]:
                    for engine in arms.values():  # no other arm's write runs meanwhile (two cores)
                        engine.settle()
                    for ask in asks:
                        time.sleep(args.pause)
                        stats = arms[arm].submit(GenerationRequest(ask, SamplingParams(max_tokens=4), session="agent")).result().stats
                        full &= len(ask) - stats.cached_tokens < 32
                    ttft[arm].append(stats.ttft_s)
            for engine in arms.values():
                engine.settle()
        finally:
            for engine in arms.values():
                engine.stop()
    med = {arm: statistics.median(v) for arm, v in ttft.items()}
    print(f"\n{args.model}: {len(prompt)}-token agent conversation, {args.rounds} timed follow-ups, "
          f"each {args.pause:.2f} s after the same engine's previous reply (engines taking turns)")
    for arm, values in ttft.items():
        print(f"{arm:<21} warm TTFT median {med[arm] * 1e3:7.1f} ms, worst {max(values) * 1e3:7.1f} ms, "
              f"median / ram only {med[arm] / med['ram only']:.2f}")
    if writes:
        print(f"SSD file writes (both SSD arms): {len(writes)}, median {statistics.median(w[0] for w in writes) / 1e6:.0f} MB "
              f"in {statistics.median(w[1] for w in writes) * 1e3:.0f} ms")
    print(f"every follow-up restored all but its new tokens: {full}")


if __name__ == "__main__":
    main()
