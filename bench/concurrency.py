"""Several sessions at once vs one alone, on the embedded models (MTP on, greedy).

    python bench/concurrency.py [--models tiny-dense tiny-hybrid] [--sessions 4] [--tokens 128] [--runs 3] [--ttfts 5]
                                [--steady 10] [--long-prompt 3072] [--membership-context 4096]

Per model:
- aggregate decode tok/s of N sessions streaming at once vs one session alone (tokens after each
  first token, over the span from the first FirstToken to the last Finished), and the ratio;
- TTFT of a short request submitted while a long one streams vs the same request alone (--ttfts
  pairs a run: each TTFT is a few milliseconds and waits for up to one round in flight, so one
  sample a run made the median a coin toss);
- greedy outputs of the N sessions run together vs each alone, token for token;
- what moving rows in and out of a batch costs (merge + release of N rows) next to one batched
  MTP round over the same rows, and one row leaving and one joining N rows at
  `--membership-context` tokens, as the scheduler did it before (hand every row back, merge the
  new membership) and does now (DecodeBatch.drop / add: only that row moves);
- a long prompt (`--long-prompt` tokens) arriving while a reply streams, at each share of the
  engine's time that prompts get while replies stream (`EngineConfig.prefill_share`: 1.0, a prompt
  chunk every step, as before; 0.5, the default), alternated: the stream's decode tok/s while the
  prompt goes in, and the prompt's TTFT;
- the steady state (`--steady` seconds): one row alone and the N rows batched, blocks of 40
  rounds (after 4 untimed) alternated in one process, no prefill, admission or release inside:
  the ratio that the span's other costs (the other rows' prefills, the batch's first and last
  rounds) pull the first one below; and the same with MTP off (AR), beside it: what batching
  alone gives here, and what MTP adds to one row and to N rows.
Runs alternate alone / together and report medians: the machine is shared, its load varies.

The engine runs as `mtplx serve` / `tui` / `generate` run it: the small-row kernel's helper thread
only where the model's step pays for it (launch.fit_helper; MTPLX_SMALL_GEMM_THREADS overrides).
Before, the bench kept the helper on for the embedded models, which users never get: its polling
slowed one row alone (steady state, tiny-dense: 975 tok/s with it, 1,336 without) and not four
rows (2,340 / 2,301), so it read a ratio users do not see (2.40x, not 1.72x).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtplx.catalog import resolve  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402
from mtplx.events import Finished, FirstToken, Tokens  # noqa: E402
from mtplx.launch import fit_helper  # noqa: E402

TOPICS = ["Explain src/ledger/events.py and how the replay uses it", "List the tests of the parser module",
          "Why does the build fail on the release branch?", "Rename the helper in utils and update every caller",
          "Write a docstring for the scheduler's step function", "What does the bank keep between turns?",
          "Summarise the last three commits", "Find the slowest test and explain why it is slow"]


def prompts(engine: Engine, n: int) -> list[tuple[int, ...]]:
    tok = engine.checkpoint.tokenizer
    return [tuple(tok.apply_chat_template([{"role": "user", "content": TOPICS[i % len(TOPICS)] + " " * (i // len(TOPICS))}],
                                          add_generation_prompt=True)) for i in range(n)]


def run(engine: Engine, batch: list[tuple[int, ...]], tokens: int, **fields) -> tuple[float, list[tuple[int, ...]]]:
    """Submit all at once; aggregate decode tok/s and each request's tokens. `fields`: the
    requests' other fields (use_mtp=False: AR)."""
    marks: dict[str, list] = {}
    listener = lambda e: marks.setdefault(e.request_id, []).append(e) if isinstance(e, (FirstToken, Finished)) else None
    engine.listeners.append(listener)
    try:
        subs = [engine.submit(GenerationRequest(p, SamplingParams(max_tokens=tokens, ignore_eos=True), session=f"s{i}",
                                                 **fields))
                for i, p in enumerate(batch)]
        done = [s.result() for s in subs]
    finally:
        engine.listeners.remove(listener)
    first = min(e.t for s in subs for e in marks[s.request.request_id] if isinstance(e, FirstToken))
    last = max(d.t for d in done)
    return sum(d.completion_tokens - 1 for d in done) / (last - first), [d.token_ids for d in done]


def ttft_under_load(engine: Engine, long: tuple[int, ...], short: tuple[int, ...], tokens: int) -> tuple[float, float]:
    """TTFT of `short` alone, then while `long` streams (submitted once long's first token is out)."""
    alone = engine.submit(GenerationRequest(short, SamplingParams(max_tokens=4), session="short")).result().stats
    alone_ttft = _ttft(alone)
    streaming = engine.submit(GenerationRequest(long, SamplingParams(max_tokens=tokens, ignore_eos=True), session="long"))
    for event in streaming:
        if isinstance(event, FirstToken):
            break
    time.sleep(0.05)  # well inside its decode
    loaded = _ttft(engine.submit(GenerationRequest(short, SamplingParams(max_tokens=4), session="short")).result().stats)
    streaming.result()
    return alone_ttft, loaded


def prefill_beside_stream(engine: Engine, short: tuple[int, ...], long: tuple[int, ...], shares: list[float],
                          runs: int) -> dict[float, tuple[float, float]]:
    """{share: (the stream's decode tok/s while `long` is prefilled, long's TTFT s)}, medians of
    `runs` alternations: `long` is submitted once the stream decodes."""
    got: dict[float, tuple[list, list]] = {share: ([], []) for share in shares}
    for _ in range(runs):
        for share in shares:
            engine.call(lambda: setattr(engine.scheduler, "prefill_share", share))
            marks: list = []
            listen = lambda e: marks.append(e) if isinstance(e, (Tokens, FirstToken)) else None
            engine.listeners.append(listen)
            try:
                stream = engine.submit(GenerationRequest(short, SamplingParams(max_tokens=10**5, ignore_eos=True),
                                                         session="stream"))
                for event in stream:
                    if isinstance(event, Tokens):
                        break
                sub = engine.submit(GenerationRequest(long, SamplingParams(max_tokens=2), session="long"))
                start = time.monotonic()
                first = next(e for e in sub if isinstance(e, FirstToken))
                sub.result()
                stream.cancel()
                stream.result()
            finally:
                engine.listeners.remove(listen)
            rid = stream.request.request_id
            n = sum(len(e.token_ids) for e in marks if isinstance(e, Tokens) and e.request_id == rid and start <= e.t <= first.t)
            got[share][0].append(n / (first.t - start))
            got[share][1].append(first.ttft_s)
    return {share: (statistics.median(a), statistics.median(b)) for share, (a, b) in got.items()}


def _ttft(stats) -> float:
    return stats["ttft_s"] if isinstance(stats, dict) else stats.ttft_s


def decoding(engine: Engine, batch: list[tuple[int, ...]], repeat: int = 4, depth: int | None = None,
             max_tokens: int = 64, use_mtp: bool = True) -> list:
    """On the engine thread: one Generation per prompt (each repeated `repeat` times; MTP unless
    use_mtp=False), its prompt prefilled and its first token taken, ready to decode alone or in a
    DecodeBatch."""
    from mtplx.engine.generation import Generation, StartPoint

    gens = []
    for p in batch:
        gen = Generation(engine.runner, GenerationRequest(p * repeat, SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                         use_mtp=use_mtp, depth=depth or engine.config.depth, chunk_size=engine.config.chunk_size,
                         eos_ids=engine.eos_ids, submitted_at=0.0)
        for _ in gen.prefill(StartPoint(), (), None):
            pass
        list(gen.first_token())
        gens.append(gen)
    return gens


def copy_cost(engine: Engine, batch: list[tuple[int, ...]]) -> tuple[float, float, int]:
    """(merge + release ms, one batched MTP round ms, context tokens) for len(batch) rows."""
    from mtplx.engine.batch import DecodeBatch

    def measure():
        gens = decoding(engine, batch)
        moves, rounds = [], []
        for _ in range(5):
            t = time.perf_counter()
            b = DecodeBatch(engine.runner, gens)
            b.release()
            moves.append(time.perf_counter() - t)
        b = DecodeBatch(engine.runner, gens)
        for _ in range(5):
            t = time.perf_counter()
            for gen, result in zip(gens, b.step()):
                list(gen.take_round(*result))
            rounds.append(time.perf_counter() - t)
        b.release()
        return statistics.median(moves) * 1e3, statistics.median(rounds) * 1e3, gens[0].state.length

    return engine.call(measure)


def membership_cost(engine: Engine, batch: list[tuple[int, ...]], repeat: int) -> tuple[dict, int]:
    """One row leaving and one joining a batch of len(batch) rows at `repeat` times the prompts'
    context, each evaluated: as the scheduler did it before (the batch handed back to every row,
    the new membership merged) and as it does now (DecodeBatch.drop: the leaving row takes a copy,
    the last row moves into its slot; DecodeBatch.add: the row written into the slot that freed,
    in place, as an agent's next request does). Medians of 5 in ms,
    {"leave": (before, now), "join": (before, now)}, and the rows' context length."""
    import mlx.core as mx

    from mtplx.engine.batch import DecodeBatch

    def ready(b: DecodeBatch) -> DecodeBatch:
        mx.eval([a for layer in b.trunk + [b.mtp] if layer is not None
                 for a in ((layer.keys, layer.values) if hasattr(layer, "keys") else layer.cache) if a is not None])
        return b

    def timed(fn):
        t = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t) * 1e3

    def measure():
        gens = decoding(engine, batch, repeat=repeat)
        times = {("leave", 0): [], ("leave", 1): [], ("join", 0): [], ("join", 1): []}
        for _ in range(5):
            whole = ready(DecodeBatch(engine.runner, gens))

            def old_leave():  # every row handed back, the others merged again
                whole.release()
                return ready(DecodeBatch(engine.runner, gens[:1] + gens[2:]))

            rest, ms = timed(old_leave)
            times[("leave", 0)].append(ms)

            def old_join():
                rest.release()
                return ready(DecodeBatch(engine.runner, gens[:1] + gens[2:] + gens[1:2]))

            whole, ms = timed(old_join)
            times[("join", 0)].append(ms)
            # now: a middle row leaves (the last row moves into its slot), then joins the spare slot
            times[("leave", 1)].append(timed(lambda: whole.drop([gens[2]]))[1])

            def new_join():
                whole.add([gens[2]])
                return ready(whole)

            times[("join", 1)].append(timed(new_join)[1])
            whole.release()
        return ({kind: (statistics.median(times[(kind, 0)]), statistics.median(times[(kind, 1)]))
                 for kind in ("leave", "join")}, gens[0].state.length)

    return engine.call(measure)


def steady(engine: Engine, batch: list[tuple[int, ...]], seconds: float, use_mtp: bool = True) -> tuple[float, float]:
    """Decode tok/s in steady state, the first prompt alone and every prompt batched: blocks of 40
    timed rounds (after 4 untimed ones) alternated in one process for `seconds` (no prefill,
    admission or release inside), medians. What the aggregate ratio would be without the measured
    span's other costs. use_mtp=False: AR steps."""
    from mtplx.engine.batch import DecodeBatch

    def rounds(gens, merged, n: int) -> None:
        for _ in range(n):
            if merged is None:
                list(gens[0].step())
            else:
                for gen, (new, drafts, accepted) in zip(gens, merged.step()):
                    list(gen.take_round(new, drafts, accepted) if use_mtp else gen.take_tokens(new))

    def block(gens, merged) -> float:
        rounds(gens, merged, 4)  # untimed: the first rounds after the other arm's find colder caches
        before, t = sum(len(g.generated) for g in gens), time.perf_counter()
        rounds(gens, merged, 40)
        return (sum(len(g.generated) for g in gens) - before) / (time.perf_counter() - t)

    def measure():
        alone, together = [], []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            one = decoding(engine, batch[:1], repeat=1, max_tokens=10**6, use_mtp=use_mtp)
            rows = decoding(engine, batch, repeat=1, max_tokens=10**6, use_mtp=use_mtp)
            merged = DecodeBatch(engine.runner, rows)
            alone.append(block(one, None))
            together.append(block(rows, merged))
            merged.release()
        return statistics.median(alone), statistics.median(together)

    return engine.call(measure)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-dense", "tiny-hybrid"])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ttfts", type=int, default=5)
    ap.add_argument("--steady", type=float, default=10.0,
                    help="seconds of steady-state blocks per model and mode, MTP and AR (0: none)")
    ap.add_argument("--long-prompt", type=int, default=3072,
                    help="tokens of the prompt that arrives while a reply streams (0: no such line)")
    ap.add_argument("--membership-context", type=int, default=4096,
                    help="context length of the rows a membership change moves (0: no such line)")
    args = ap.parse_args()
    rows, steadies, memberships, helpers, besides = [], [], [], [], []
    for name in args.models:
        engine = Engine(resolve(name), EngineConfig(use_mtp=True), name=name).start()
        helpers.append((name, fit_helper(engine)))  # as the serving processes set it
        try:
            batch = prompts(engine, args.sessions)
            run(engine, batch[:1], 16)  # warm up
            alone_tps, together_tps, ratios, ttfts = [], [], [], []
            equal = total = 0
            for r in range(args.runs):
                singles = [run(engine, [p], args.tokens) for p in batch]
                alone = statistics.median(s[0] for s in singles)
                together, outs = run(engine, batch, args.tokens)
                alone_tps.append(alone)
                together_tps.append(together)
                ratios.append(together / alone)
                equal += sum(o == s[1][0] for o, s in zip(outs, singles))
                total += len(batch)
                ttfts += [ttft_under_load(engine, batch[0], batch[1], args.tokens * 2)
                          for _ in range(args.ttfts)]
            move_ms, round_ms, context = copy_cost(engine, batch)
            if args.membership_context:
                repeat = max(1, args.membership_context // len(batch[0]))
                memberships.append((name, *membership_cost(engine, batch, repeat)))
            if args.long_prompt:
                long = tuple(prompts(engine, 1)[0] * max(1, args.long_prompt // len(batch[0])))
                besides.append((name, len(long), prefill_beside_stream(engine, batch[1], long, [1.0, 0.5], args.runs)))
            if args.steady > 0:
                steadies.append((name, *steady(engine, batch, args.steady), *steady(engine, batch, args.steady, use_mtp=False)))
            alone_ttft = statistics.median(a for a, _ in ttfts)
            loaded_ttft = statistics.median(b for _, b in ttfts)
            rows.append((name, statistics.median(alone_tps), statistics.median(together_tps), statistics.median(ratios),
                         alone_ttft * 1e3, loaded_ttft * 1e3, loaded_ttft / alone_ttft, equal, total, move_ms, round_ms, context))
        finally:
            engine.stop()
    n = args.sessions
    print(f"\n{n} sessions at once vs one alone: MTP on, greedy, {args.tokens} tokens each, median of {args.runs} runs "
          f"(TTFT: of {args.runs * args.ttfts} pairs)\n")
    print(f"{'model':<12} {'alone tok/s':>11} {f'{n} at once':>11} {'ratio':>6} | {'TTFT alone':>10} {'streaming':>10} "
          f"{'ratio':>6} | {'batch == alone':>14} | {'merge+release':>13} {'1 round':>8} {'ctx':>5}")
    for name, a, t, r, ta, tl, tr, eq, tot, mv, rd, ctx in rows:
        print(f"{name:<12} {a:>11.1f} {t:>11.1f} {r:>5.2f}x | {ta:>8.1f}ms {tl:>8.1f}ms {tr:>5.2f}x | {eq:>6}/{tot:<7} | "
              f"{mv:>10.1f}ms {rd:>6.1f}ms {ctx:>5}")
    for name, one, many, ar_one, ar_many in steadies:
        print(f"{name:<12} steady state (blocks of 40 rounds alternated, {args.steady:.0f} s): one row {one:.0f} tok/s, "
              f"{n} rows {many:.0f} tok/s, {many / one:.2f}x; AR: {ar_one:.0f} / {ar_many:.0f} tok/s, "
              f"{ar_many / ar_one:.2f}x; MTP/AR: one row {one / ar_one:.2f}x, {n} rows {many / ar_many:.2f}x")
    for name, cost, context in memberships:
        print(f"{name:<12} a row leaving / joining {n} rows at {context} tokens: release + merge "
              f"{cost['leave'][0]:.1f} / {cost['join'][0]:.1f} ms, drop / add {cost['leave'][1]:.1f} / "
              f"{cost['join'][1]:.1f} ms")
    for name, length, by_share in besides:
        print(f"{name:<12} a {length}-token prompt arriving while a reply streams, by the prompts' share of the engine: "
              + "; ".join(f"{share:g}: stream {tps:.0f} tok/s, prompt TTFT {ttft:.2f} s" for share, (tps, ttft) in by_share.items()))
    print("small-row kernel's helper thread: " + ", ".join(f"{m} {'on' if on else 'off' if on is False else 'no kernel'}"
                                                         for m, on in helpers))
    print("\ntargets: ratio >= 2.5x, TTFT streaming/alone <= 1.5x, batch == alone on every request")


if __name__ == "__main__":
    main()
