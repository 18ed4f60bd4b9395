"""Parallel turns over one new prompt head: computed once and shared, or prefilled by each.

    python bench/shared_prompt.py [--model tiny-dense --model tiny-hybrid] [--rounds 3]
                                  [--agents 3] [--head-lines 150] [--tokens 16]

Per model, one engine with a session bank. Each round sends a burst of `--agents` turns at once:
one system prompt new to the bank (a few thousand tokens, like a subagent's system prompt and
tools) and a different short user task each, as an agent's parallel subagents do. The arms
alternate within the round, each with a head of its own: `shared` (the default: queued turns
wait for the one computing the head and restore it, engine/shared_prompt.py) and `each` (every
turn prefills the head itself: `share_prompts` off). Prints per arm the burst's wall time, the
slowest turn's TTFT, the prompt tokens computed (prompt minus cached), the ratio each / shared,
and whether the greedy outputs of both arms are identical (they must be). Two more cases per
round and arm: a short turn sent together with a long one over the same head (it waits only
until the long prefill has passed the head), and a turn sent while another over the same head
already decodes (it restores the head from that running turn: bank_executor.share_running).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mtplx  # noqa: E402,F401  (the CPU fast path before MLX)

from mtplx.bank.bank import BankConfig  # noqa: E402
from mtplx.catalog import resolve  # noqa: E402
from mtplx.chat import chat_request  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402


def burst(engine, head: str, agents: int, tokens: int, tag: str) -> dict:
    tok = engine.checkpoint.tokenizer
    params = SamplingParams(max_tokens=tokens, temperature=0)
    requests = [chat_request(tok, [{"role": "system", "content": head},
                                   {"role": "user", "content": f"Task {i}: read file_{i}.py and report what it does."}],
                             None, sampling=params, session=f"{tag}-{i}") for i in range(agents)]
    t0 = time.perf_counter()
    subs = [engine.submit(r) for r in requests]
    fins = [s.result() for s in subs]
    wall = time.perf_counter() - t0
    return {"wall": wall, "ttft": max(f.stats.ttft_s or 0.0 for f in fins),
            "computed": sum(f.prompt_tokens - f.cached_tokens for f in fins), "prompt": fins[0].prompt_tokens,
            "outputs": [f.token_ids for f in fins]}


def pair(engine, head: str, tokens: int, tag: str) -> dict:
    """A long turn (the head and a long log to read) and a short one over the same head, sent
    together: the short one's TTFT, and what it restored."""
    tok = engine.checkpoint.tokenizer
    params = SamplingParams(max_tokens=tokens, temperature=0)
    log = "Review this log. " + " ".join(f"line {i}: request {i} took {i % 7} ms." for i in range(120))
    long, short = (chat_request(tok, [{"role": "system", "content": head}, {"role": "user", "content": text}], None,
                                sampling=params, session=f"{tag}-{name}")
                   for name, text in (("long", log), ("short", "Task: read file_1.py and report.")))
    subs = [engine.submit(long), engine.submit(short)]
    fins = [s.result() for s in subs]
    return {"short_ttft": fins[1].stats.ttft_s or 0.0, "long_ttft": fins[0].stats.ttft_s or 0.0,
            "short_cached": fins[1].cached_tokens, "long_prompt": fins[0].prompt_tokens}


def late(engine, head: str, tokens: int, tag: str) -> dict:
    """A turn over the head decoding a long reply, and another over the same head sent once the
    first is decoding (a second agent started meanwhile): the second's TTFT, and what it restored."""
    import dataclasses

    from mtplx.events import FirstToken

    tok = engine.checkpoint.tokenizer
    first, second = (chat_request(tok, [{"role": "system", "content": head}, {"role": "user", "content": text}], None,
                                  sampling=SamplingParams(max_tokens=n, temperature=0), session=f"{tag}-{name}")
                     for name, text, n in (("first", "Explain file_0.py in detail.", 256),
                                           ("second", "Task: read file_1.py and report.", tokens)))
    first = dataclasses.replace(first, sampling=dataclasses.replace(first.sampling, ignore_eos=True))
    started = []
    listen = lambda e: started.append(e) if isinstance(e, FirstToken) and e.request_id == first.request_id else None  # noqa: E731
    engine.listeners.append(listen)
    try:
        running = engine.submit(first)
        while not started:
            time.sleep(0.001)
        fin = engine.submit(second).result()
        running.result()
    finally:
        engine.listeners.remove(listen)
    return {"late_ttft": fin.stats.ttft_s or 0.0, "late_cached": fin.cached_tokens, "late_prompt": fin.prompt_tokens,
            "late_output": fin.token_ids}


def run(model: str, rounds: int, agents: int, lines: int, tokens: int) -> None:
    engine = Engine(resolve(model), EngineConfig(), name=model, bank=BankConfig()).start()
    try:
        rows = {"shared": [], "each": []}
        for r in range(rounds + 1):  # round 0 warms the compiled shapes up; not counted
            for arm in ("shared", "each") if r % 2 == 0 else ("each", "shared"):
                engine.call(lambda: setattr(engine, "share_prompts", arm == "shared"))
                # A head of its own per round and arm (new to the bank), the same rules in other words.
                head = f"You are subagent {r}-{arm}. " + " ".join(
                    f"Rule {i}: keep edits small and test module {i} before module {i + 1}." for i in range(lines))
                row = burst(engine, head, agents, tokens, f"{model}-{r}-{arm}")
                row |= pair(engine, "Long and short. " + head, tokens, f"{model}-{r}-{arm}-pair")
                row |= late(engine, "One after another. " + head, tokens, f"{model}-{r}-{arm}-late")
                if r:
                    rows[arm].append(row)
        engine.call(lambda: setattr(engine, "share_prompts", True))
        med = {arm: {k: statistics.median(row[k] for row in rows[arm]) for k in rows[arm][0]} for arm in rows}
        print(f"{model}: {agents} turns at once over a {int(med['shared']['prompt'])}-token prompt, {rounds} rounds (medians)")
        for arm in ("shared", "each"):
            m = med[arm]
            print(f"  {arm:<7} burst {m['wall']:.2f} s, slowest TTFT {m['ttft']:.2f} s, prompt tokens computed {int(m['computed'])}")
        print(f"  each / shared: burst {med['each']['wall'] / med['shared']['wall']:.2f}x, "
              f"slowest TTFT {med['each']['ttft'] / med['shared']['ttft']:.2f}x, "
              f"tokens computed {med['each']['computed'] / med['shared']['computed']:.2f}x")
        print(f"  a short turn sent with a long one ({int(med['shared']['long_prompt'])} tokens) over the same head: "
              f"its TTFT shared {med['shared']['short_ttft']:.2f} s (restored {int(med['shared']['short_cached'])}), "
              f"each {med['each']['short_ttft']:.2f} s ({med['each']['short_ttft'] / med['shared']['short_ttft']:.2f}x); "
              f"the long one's {med['shared']['long_ttft']:.2f} vs {med['each']['long_ttft']:.2f} s")
        print(f"  a turn sent while another over the same head decodes ({int(med['shared']['late_prompt'])} tokens): "
              f"its TTFT shared {med['shared']['late_ttft']:.3f} s (restored {int(med['shared']['late_cached'])}), "
              f"each {med['each']['late_ttft']:.3f} s ({med['each']['late_ttft'] / med['shared']['late_ttft']:.2f}x)")
        check = cold_check(engine, model, agents, lines, tokens)
        print(f"  shared turns equal the same turns computed alone, cold: {check}")
    finally:
        engine.stop()


def cold_check(engine, model: str, agents: int, lines: int, tokens: int) -> bool:
    """A shared burst's outputs, and a turn's sent while another decodes, against each of those
    turns run alone on a fresh engine (no bank)."""
    head = "You are the checking subagent. " + " ".join(
        f"Rule {i}: keep edits small and test module {i} before module {i + 1}." for i in range(lines))
    shared = burst(engine, head, agents, tokens, f"{model}-check")["outputs"]
    shared.append(late(engine, head, tokens, f"{model}-check-late")["late_output"])
    cold = Engine(resolve(model), EngineConfig(), name=model).start()
    try:
        tok = cold.checkpoint.tokenizer
        params = SamplingParams(max_tokens=tokens, temperature=0)
        alone = []
        for i in range(agents):
            req = chat_request(tok, [{"role": "system", "content": head},
                                     {"role": "user", "content": f"Task {i}: read file_{i}.py and report what it does."}],
                               None, sampling=params)
            alone.append(cold.submit(req).result().token_ids)
        req = chat_request(tok, [{"role": "system", "content": head},
                                 {"role": "user", "content": "Task: read file_1.py and report."}], None, sampling=params)
        alone.append(cold.submit(req).result().token_ids)
        return alone == shared
    finally:
        cold.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--head-lines", type=int, default=150)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    for model in args.model or ["tiny-dense", "tiny-hybrid"]:
        run(model, args.rounds, args.agents, args.head_lines, args.tokens)


if __name__ == "__main__":
    main()
