"""Session-bank benchmark: replay agent conversations, with and without the bank, side by side.

    python bench/bank.py [--models tiny-dense tiny-hybrid] [--quick] [--peer mlx-lm [--only-peer]]

Each scenario drives the model like an agent (transcript tool results and user messages, the
model's own replies) through two engines in one process: one with the session bank, one cold.
Every warm turn prints prompt tokens, reuse ceiling, achieved (cached) tokens, ratio, restore
source and anchor kind, the cause of any shortfall, TTFT warm vs cold, restore overhead (warm
TTFT / the warm prefill of the un-restored suffix alone) and output parity. After each scenario
the banked engine is stopped (flushing its bank to SSD), a fresh one opens the same directory and
repeats the last turn: the after-restart table shows what it restored from SSD and its TTFT vs
cold. It also prints the anchor planner's p50 at 32 / 128 / 512 messages.

With `--peer mlx-lm` the same scenarios also run over HTTP against mtplx's server and a fresh
`mlx_lm.server` serving the same weights, with identical request bodies, and a side-by-side table
of cached tokens, ratio and TTFT per warm turn is printed (bench/bank_peer.py).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mtplx.bank.anchors import Markers, as_tokens, prompt_anchors  # noqa: E402
from mtplx.bank.bank import BankConfig  # noqa: E402
from mtplx.bank.plan import EntryView, plan_restore  # noqa: E402
from mtplx.bank.spans import reuse_ratio  # noqa: E402
from mtplx.bank.ssd import SsdConfig  # noqa: E402
from mtplx.catalog import resolve  # noqa: E402
from mtplx.chat import chat_request, render  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402
from mtplx.replay.live_agent import AgentSession  # noqa: E402
from mtplx.synth.agent import Sizes, conversation  # noqa: E402
from mtplx.synth.corpus import Corpus  # noqa: E402
from mtplx.synth.heads import HEADS  # noqa: E402
from scratch import scratch_dir  # noqa: E402

MAX_TOKENS = 160


def scenarios(quick: bool) -> list[tuple[str, list[AgentSession], list[int], BankConfig]]:
    corpus = Corpus()
    big = Sizes(120, 260) if not quick else Sizes(60, 120)
    coder = HEADS[0]
    return [
        ("tool turns, long results", [AgentSession("s1", conversation(301, corpus, big, 1, coder))], [0] * 4, BankConfig()),
        ("new user message strips reasoning", [AgentSession("s1", conversation(302, corpus, Sizes(20, 60), 3, coder))],
         [0] * 6, BankConfig()),
        ("new session sharing the head", [AgentSession("s1", conversation(303, corpus, Sizes(20, 60), 1, coder)),
                                          AgentSession("s2", conversation(304, corpus, Sizes(20, 60), 1, coder))],
         [0, 0, 1, 1], BankConfig()),
        ("two interleaved sessions", [AgentSession("s1", conversation(305, corpus, Sizes(20, 60), 2, HEADS[2])),
                                      AgentSession("s2", conversation(306, corpus, Sizes(20, 60), 2, HEADS[3]))],
         [0, 1, 0, 1, 0, 1], BankConfig()),
        ("budget forces eviction", [AgentSession("s1", conversation(307, corpus, Sizes(20, 60), 2, HEADS[1])),
                                    AgentSession("s2", conversation(308, corpus, Sizes(20, 60), 2, HEADS[3]))],
         [0, 1, 0, 1], BankConfig(budget_bytes=3 << 20)),
    ]


def run_turn(engine: Engine, prompt, chat, session):
    req = chat_request(engine.checkpoint.tokenizer, chat["messages"], chat["tools"], prompt=prompt,
                       sampling=SamplingParams(max_tokens=MAX_TOKENS), session=session, source="bench")
    fin = engine.submit(req).result()
    engine.settle()
    outcome = engine.bank.outcomes.get(req.request_id) if engine.bank else None
    return fin, outcome


def run_scenario(name, sessions, order, bank_config, model, rows, restarts):
    ssd_root = scratch_dir("mtplx-bench-ssd-")
    ssd = SsdConfig(ssd_root, budget_bytes=1 << 30, free_floor_bytes=0)
    warm = Engine(resolve(model), EngineConfig(), name=model, bank=bank_config, ssd=ssd).start()
    cold = Engine(resolve(model), EngineConfig(), name=model).start()
    tok = warm.checkpoint.tokenizer
    last = None
    try:
        for turn, idx in enumerate(order):
            s = sessions[idx]
            nxt = s.next_request(tok)
            if nxt is None:
                continue
            prompt, chat = nxt
            fin_w, outcome = run_turn(warm, prompt, chat, s.name)
            fin_c, _ = run_turn(cold, prompt, chat, s.name)
            last = (prompt, chat, s.name, fin_c, fin_w)
            first_of_session = not any(m["role"] == "assistant" for m in s.sent) and not any(
                o is not s and o.conversation["messages"][0] == s.conversation["messages"][0]
                and any(m["role"] == "assistant" for m in o.sent) for o in sessions)
            if outcome.ceiling is None or turn == 0 or first_of_session:
                s.send_back(fin_w.reply)
                continue  # a session's first turn with a head never seen is cold by construction
            ratio = reuse_ratio(outcome.achieved, outcome.ceiling)
            prefill_s = fin_w.stats.prefill_s or 1e-9
            rows.append(dict(model=model, scenario=name, session=s.name, prompt=len(prompt), ceiling=outcome.ceiling,
                             achieved=outcome.achieved, ratio=ratio, source=outcome.source, anchor=outcome.anchor,
                             cause=outcome.cause, ttft_warm=fin_w.stats.ttft_s, ttft_cold=fin_c.stats.ttft_s,
                             overhead=fin_w.stats.ttft_s / (prefill_s + fin_w.stats.sample_s) if fin_w.stats.prefill_s else None,
                             parity=fin_w.token_ids == fin_c.token_ids))
            s.send_back(fin_w.reply)
    finally:
        warm.stop()  # a clean shutdown flushes the bank to SSD
        cold.stop()
    if last is None:
        return
    # After a restart: a fresh engine on the same SSD directory replays the scenario's last turn.
    prompt, chat, session, fin_c, fin_w = last
    restarted = Engine(resolve(model), EngineConfig(), name=model, bank=bank_config, ssd=ssd).start()
    try:
        restarted.bank.last_turn = {}  # nothing of the session survives in RAM, only on disk
        fin_r, outcome = run_turn(restarted, prompt, chat, session)
    finally:
        restarted.stop()
        shutil.rmtree(ssd_root, ignore_errors=True)
    restarts.append(dict(model=model, scenario=name, prompt=len(prompt), cached=fin_r.cached_tokens,
                         source=outcome.source, anchor=outcome.anchor, ratio_vs_warm=fin_r.cached_tokens / max(fin_w.cached_tokens, 1),
                         ttft_ssd=fin_r.stats.ttft_s, ttft_cold=fin_c.stats.ttft_s, parity=fin_r.token_ids == fin_c.token_ids))


def planner_p50(tokenizer) -> dict[int, float]:
    corpus = Corpus()
    messages = [conversation(400, corpus, Sizes(4, 10), 1)["messages"][0]]
    seed = 401
    while len(messages) < 512:
        messages += conversation(seed, corpus, Sizes(4, 10), 3)["messages"][1:]
        seed += 1
    markers = Markers.from_tokenizer(tokenizer)
    out = {}
    for n in (32, 128, 512):
        prompt = render(tokenizer, messages[:n], None)
        entries = [EntryView(str(i), tuple(prompt[: len(prompt) - 50 * (i + 1)]), "m", (100, 200), None, False,
                             token_array=as_tokens(prompt[: len(prompt) - 50 * (i + 1)])) for i in range(4)]
        times = []
        for _ in range(200):  # the bank's own path: convert the prompt once, find anchors, plan
            t = time.perf_counter()
            tokens = as_tokens(prompt)
            anchors = prompt_anchors(tokens, markers)
            plan_restore(tokens, anchors, entries, "m", need_mtp=False, recurrent=True)
            times.append((time.perf_counter() - t) * 1000)
        out[n] = (statistics.median(times), len(prompt))
    return out


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    parser.add_argument("--quick", action="store_true", help="Shorter tool results (for a fast look).")
    parser.add_argument("--peer", choices=["mlx-lm"], help="Also run every scenario against this server, side by side.")
    parser.add_argument("--only-peer", action="store_true", help="With --peer: skip the in-process tables.")
    parser.add_argument("--peer-arm", action="append", default=[""],
                        help="With --peer: also run mtplx under this setting (e.g. no-mtp), repeatable.")
    args = parser.parse_args()
    if args.peer:
        import bank_peer

        peer_rows: list[dict] = []
        for model in args.models:
            for arm in args.peer_arm:
                for name, sessions, order, config in scenarios(args.quick):
                    bank_peer.run_scenario(name, sessions, order, config, model, peer_rows, arm)
        bank_peer.print_table(peer_rows)
        if args.only_peer:
            return
    rows: list[dict] = []
    restarts: list[dict] = []
    for model in args.models:
        for name, sessions, order, config in scenarios(args.quick):
            run_scenario(name, sessions, order, config, model, rows, restarts)
    print(f"{'model':<11} {'scenario':<34} {'sess':<4} {'prompt':>6} {'ceil':>6} {'cached':>6} {'ratio':>6} "
          f"{'source':<6} {'anchor':<14} {'TTFT warm':>9} {'TTFT cold':>9} {'ovh':>5} {'parity':<6} cause")
    for r in rows:
        print(f"{r['model']:<11} {r['scenario']:<34} {r['session']:<4} {r['prompt']:>6} {r['ceiling']:>6} "
              f"{r['achieved']:>6} {fmt(r['ratio'], '6.3f')} {r['source']:<6} {r['anchor'] or '-':<14} "
              f"{r['ttft_warm']:9.3f} {r['ttft_cold']:9.3f} {fmt(r['overhead'], '5.2f')} {str(r['parity']):<6} {r['cause'] or ''}")
    for model in args.models:
        mine = [r for r in rows if r["model"] == model and r["ratio"] is not None]
        if mine:
            print(f"{model}: warm turns {len(mine)}, min ratio {min(r['ratio'] for r in mine):.3f}, "
                  f"mean ratio {statistics.mean(r['ratio'] for r in mine):.3f}, parity {all(r['parity'] for r in mine)}, "
                  f"TTFT warm/cold median {statistics.median(r['ttft_warm'] / r['ttft_cold'] for r in mine):.3f}")
    print("\nafter restart (fresh engine, same SSD directory, the scenario's last turn again):")
    print(f"{'model':<11} {'scenario':<34} {'prompt':>6} {'cached':>6} {'vs warm':>7} {'source':<6} {'anchor':<14} "
          f"{'TTFT ssd':>8} {'TTFT cold':>9} {'ratio':>6} parity")
    for r in restarts:
        print(f"{r['model']:<11} {r['scenario']:<34} {r['prompt']:>6} {r['cached']:>6} {r['ratio_vs_warm']:7.3f} "
              f"{r['source']:<6} {r['anchor'] or '-':<14} {r['ttft_ssd']:8.3f} {r['ttft_cold']:9.3f} "
              f"{r['ttft_ssd'] / r['ttft_cold']:6.3f} {r['parity']}")
    from transformers import AutoTokenizer

    p50 = planner_p50(AutoTokenizer.from_pretrained(str(resolve(args.models[0]))))
    print("anchor planning p50: " + ", ".join(f"{n} messages ({t} tokens) {ms:.3f} ms" for n, (ms, t) in p50.items()))


if __name__ == "__main__":
    main()
