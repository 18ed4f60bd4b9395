"""The scheduler: several requests decode together, each exactly as it would alone.

Batched rows must give the tokens the same request gives alone (greedy, and seeded sampling with
each row's own sampler), a verify must accept per row and roll each row back to its own kept
length (attention KV and GatedDeltaNet state), a cancelled row must leave the others running,
and admission must respect max_batch and the memory budget.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from mtplx.engine import batch as batch_module
from mtplx.engine.batch import DecodeBatch
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.generation import Generation, StartPoint
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.events import Failed, Finished, FirstToken, Tokens

TOPICS = ["Explain src/ledger/events.py", "List the tests of the parser module and what each one checks",
          "Why does the build fail?", "Rename the helper in utils and update every caller in the package please"]


def _prompts(engine, n=4):
    tok = engine.checkpoint.tokenizer
    return [tuple(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
            for t in TOPICS[:n]]


def _requests(engine, n=4, **sampling):
    params = dict(max_tokens=40, ignore_eos=True) | sampling
    return [GenerationRequest(p, SamplingParams(**params), session=f"s{i}") for i, p in enumerate(_prompts(engine, n))]


@pytest.fixture
def batch_sizes(monkeypatch):
    """The number of rows of every batched step the engine runs (and, in .modes, MTP or AR)."""

    class Sizes(list):
        modes: set = set()

    sizes = Sizes()
    step = DecodeBatch.step

    def spy(self):
        sizes.append(len(self.gens))
        sizes.modes = sizes.modes | {"mtp" if self.mtp_mode else "ar"}
        return step(self)

    monkeypatch.setattr(batch_module.DecodeBatch, "step", spy)
    return sizes


@pytest.mark.parametrize("use_mtp", [True, False], ids=["mtp", "ar"])
def test_batched_greedy_equals_alone(engine, use_mtp, batch_sizes):
    requests = lambda: [GenerationRequest(r.prompt, r.sampling, use_mtp=use_mtp, session=r.session)
                        for r in _requests(engine)]
    alone = [engine.submit(r).result() for r in requests()]
    assert not batch_sizes  # one at a time never merges a batch
    subs = [engine.submit(r) for r in requests()]
    together = [s.result() for s in subs]
    assert max(batch_sizes) >= 3
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]
    assert batch_sizes.modes == {"mtp" if use_mtp else "ar"}


@pytest.mark.parametrize("use_mtp", [True, False], ids=["mtp", "ar"])
def test_each_turn_counts_the_rounds_it_decoded_in_a_batch_and_beside_how_many(dense_engine, use_mtp, batch_sizes):
    requests = [GenerationRequest(r.prompt, r.sampling, use_mtp=use_mtp, session=r.session) for r in _requests(dense_engine)]
    alone = dense_engine.submit(requests[0]).result().stats
    assert (alone.batched_rounds, alone.batch_rows, alone.rows_mean, alone.others_s) == (0, 0, 1.0, 0.0)
    together = [s.result().stats for s in _submit_together(dense_engine, requests)]
    for stats in (alone, *together):  # a round is a verify with MTP, one token's step without
        assert stats.rounds == (stats.verify_calls if use_mtp else stats.completion_tokens - 1)
    # each batched step of B rows is one batched round of each of its rows, beside B rows
    assert sum(s.batched_rounds for s in together) == sum(batch_sizes) > 0
    assert sum(s.batch_rows for s in together) == sum(b * b for b in batch_sizes)
    assert all(1.0 < s.rows_mean <= 4 for s in together)


def test_a_turn_counts_its_wait_for_admission_and_for_other_requests_prompts(dense_engine):
    engine = Engine(dense_engine.model_path, EngineConfig(chunk_size=64, max_batch=1), name="tiny-dense").start()
    try:
        first, second = (s.result().stats for s in _submit_together(engine, _requests(dense_engine, 2, max_tokens=24)))
    finally:
        engine.stop()
    assert second.queued_s >= first.ttft_s + first.decode_s > 0  # admitted once the first had ended
    # a long prompt prefilled in chunks while a turn decodes: the turn waited for those chunks
    decoding = dense_engine.submit(_requests(dense_engine, 1, max_tokens=300)[0])
    for event in decoding:
        if isinstance(event, Tokens):
            break
    tok = dense_engine.checkpoint.tokenizer
    long_prompt = tok.apply_chat_template([{"role": "user", "content": "Summarise this log. " + "step ok; " * 300}],
                                          add_generation_prompt=True)
    other = dense_engine.submit(GenerationRequest(tuple(long_prompt), SamplingParams(max_tokens=2), session="other"))
    other, decoded = other.result(), decoding.result()
    assert other.prompt_tokens > 2 * dense_engine.config.chunk_size
    assert decoded.stats.others_s > 0 and other.stats.others_s == 0.0


def test_seeded_sampling_in_a_batch_equals_alone(engine, batch_sizes):
    requests = lambda: _requests(engine, 3, temperature=0.8, seed=11, max_tokens=24)
    alone = [engine.submit(r).result().token_ids for r in requests()]
    subs = [engine.submit(r) for r in requests()]
    assert [s.result().token_ids for s in subs] == alone
    assert max(batch_sizes) >= 2


def test_a_mixed_batch_equals_each_request_alone(engine, tokenizer, batch_sizes):
    """Rows that need the host between drafts (a sampled row, a tool rule) share a batch with plain
    greedy rows of other depths and a masked row: each row still gets exactly its tokens alone."""
    alone, rule = assert_mixed_batch_equals_alone(engine, tokenizer, _prompts(engine), batch_sizes)
    assert rule.call_open in alone[3]


def assert_mixed_batch_equals_alone(engine, tokenizer, p, batch_sizes):
    """Greedy rows of depths 1 and 3, a seeded sampled row, a "required" tool rule and a "never"
    mask, run alone and then together: each row's tokens equal its own alone. Returns (the alone
    outputs, the required rule)."""
    from mtplx.engine.tool_rule import ToolRule

    rule = ToolRule("required", tokenizer.convert_tokens_to_ids("<tool_call>"), tuple(engine.eos_ids))
    never = ToolRule("never", rule.call_open)  # a turn without tools: a history-free mask, drafts stay lazy
    requests = lambda: [
        GenerationRequest(p[0], SamplingParams(max_tokens=32, ignore_eos=True), depth=1, session="a"),
        GenerationRequest(p[1], SamplingParams(max_tokens=32, ignore_eos=True), depth=3, session="b"),
        GenerationRequest(p[2], SamplingParams(max_tokens=32, temperature=0.7, seed=3, ignore_eos=True), session="c"),
        GenerationRequest(p[3], SamplingParams(max_tokens=32), depth=2, tool_rule=rule, session="d"),
        GenerationRequest(p[0], SamplingParams(max_tokens=32), depth=2, tool_rule=never, session="e"),
    ]
    alone = [engine.submit(r).result().token_ids for r in requests()]
    subs = [engine.submit(r) for r in requests()]
    assert [s.result().token_ids for s in subs] == alone
    assert max(batch_sizes) >= 3 and batch_sizes.modes == {"mtp"}
    return alone, rule


def test_greedy_rows_under_a_mask_batch_lazily_and_equal_alone(engine, tokenizer, batch_sizes, monkeypatch):
    """Turns without tools carry the "never" rule; as a mask it keeps a greedy batch's drafts one
    lazy chain (no per-row host picks) and every row still equals itself alone."""
    from mtplx.engine.tool_rule import ToolRule

    never = ToolRule("never", tokenizer.convert_tokens_to_ids("<tool_call>"))
    requests = lambda: [GenerationRequest(p, SamplingParams(max_tokens=32, ignore_eos=True), depth=2,
                                          tool_rule=never if i % 2 else None, session=f"m{i}")
                        for i, p in enumerate(_prompts(engine, 3))]
    alone = [engine.submit(r).result().token_ids for r in requests()]

    def host_draft(self, *args):
        raise AssertionError("a masked greedy batch drafted on the host")

    monkeypatch.setattr(DecodeBatch, "_draft", host_draft)
    subs = [engine.submit(r) for r in requests()]
    assert [s.result().token_ids for s in subs] == alone
    assert max(batch_sizes) >= 2 and batch_sizes.modes == {"mtp"}


def _ready(engine, prompt) -> Generation:
    """A generation prefilled and past its first token, as the scheduler hands it to a batch."""
    request = GenerationRequest(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    gen = Generation(engine.runner, request, use_mtp=True, depth=3, chunk_size=64, eos_ids=engine.eos_ids, submitted_at=0.0)
    for _ in gen.prefill(StartPoint(), (), None):
        pass
    list(gen.first_token())
    return gen


def _layer_arrays(layer) -> list[np.ndarray]:
    if hasattr(layer, "keys"):
        return [np.array(layer.keys[..., : layer.offset, :]), np.array(layer.values[..., : layer.offset, :])]
    return [np.array(a) for a in layer.cache]


def test_batched_verify_accepts_and_rolls_back_per_row(engine):
    """Rows of one verify keep different numbers of drafts; each row's tokens, drafts, acceptance
    and, after the batch hands its caches back, every cache array equal the same rounds alone.
    On tiny-hybrid this is the GatedDeltaNet rollback: recurrent rows take the state captured at
    their own kept position."""
    prompts = _prompts(engine)
    rounds = 12

    def run():
        alone, batched = [_ready(engine, p) for p in prompts], [_ready(engine, p) for p in prompts]
        solo_log = []
        for gen in alone:
            rows = []
            for _ in range(rounds):
                new, drafts, accepted = gen.speculator.round(gen.draft_budget())
                list(gen.take_round(new, drafts, accepted))
                rows.append((new, drafts, accepted))
            solo_log.append(rows)
        batch = DecodeBatch(engine.runner, batched)
        batch_log = [[] for _ in batched]
        for _ in range(rounds):
            for b, (gen, result) in enumerate(zip(batched, batch.step())):
                list(gen.take_round(*result))
                batch_log[b].append(result)
        batch.release()
        # Arrays become numpy here, on the engine thread that owns them.
        arrays = [[[_layer_arrays(layer) for layer in g.state.trunk + [g.state.mtp]] for g in gens]
                  for gens in (alone, batched)]
        return solo_log, batch_log, alone, batched, arrays

    solo_log, batch_log, alone, batched, (alone_arrays, batched_arrays) = engine.call(run)
    assert batch_log == solo_log
    per_round = [{row[r][2] for row in batch_log} for r in range(rounds)]
    assert any(len(kept) > 1 for kept in per_round), "no verify had different acceptance per row"
    assert any(a < len(d) for row in batch_log for _, d, a in row), "no partial acceptance to roll back"
    for a, b, a_layers, b_layers in zip(alone, batched, alone_arrays, batched_arrays):
        assert a.state.tokens == b.state.tokens and a.state.length == b.state.length == len(b.state.tokens)
        assert [type(x) for x in b.state.trunk] == [type(x) for x in a.state.trunk]
        for la, lb in zip(a_layers, b_layers):
            assert len(la) == len(lb)
            for x, y in zip(la, lb):
                assert x.shape == y.shape
                # A batched matmul may round differently in the last bits on MKL (fast_path.rows_bitwise).
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
        if engine.runner.has_recurrent:
            assert any(type(layer).__name__ == "ArraysCache" for layer in b.state.trunk)


def test_rows_leave_and_join_a_running_batch_each_as_alone(engine):
    """Membership changes move only the rows they concern: rows 0 and 1 leave mid-batch (the last
    rows move into their slots, theirs stay spare), decode alone with the caches they took, then
    row 1 and a row that started alone join into the spare slots, and row 0 joins a batch with none
    left. Every row's rounds, and its caches at the end, equal the same rounds alone; the rows that
    stayed were never handed back and re-merged."""
    prompts = _prompts(engine) + [_prompts(engine)[0][:-3]]
    rounds = 12

    def alone_round(gen, log):
        new, drafts, accepted = gen.speculator.round(gen.draft_budget())
        list(gen.take_round(new, drafts, accepted))
        log.append((new, drafts, accepted))

    def run():
        alone, gens = [_ready(engine, p) for p in prompts], [_ready(engine, p) for p in prompts]
        solo = [[] for _ in alone]
        for gen, log in zip(alone, solo):
            for _ in range(rounds):
                alone_round(gen, log)
        logs = {id(g): [] for g in gens}

        def batch_round(batch):
            for gen, result in zip(batch.gens, batch.step()):
                list(gen.take_round(*result))
                logs[id(gen)].append(result)

        batch = DecodeBatch(engine.runner, gens[:4])
        assert all(g.state.trunk is None for g in gens[:4])  # the batch holds the only copy
        for _ in range(4):
            batch_round(batch)
            alone_round(gens[4], logs[id(gens[4])])
        batch.drop([gens[1], gens[0]])
        order = [gens.index(g) for g in batch.gens]
        attention = next(layer for layer in batch.trunk if hasattr(layer, "keys"))
        slots = [attention.keys.shape[0]]  # the freed slots stay, spare
        for _ in range(2):
            batch_round(batch)
            for gen in (gens[0], gens[1], gens[4]):
                alone_round(gen, logs[id(gen)])
        batch.add([gens[1], gens[4]])  # into the spare slots, in place
        slots.append(attention.keys.shape[0])
        batch_round(batch)
        alone_round(gens[0], logs[id(gens[0])])
        batch.add([gens[0]])  # no slot spare: the batch grows
        slots.append(attention.keys.shape[0])
        for _ in range(rounds - 7):
            batch_round(batch)
        final = [gens.index(g) for g in batch.gens]
        batch.release()
        arrays = [[[_layer_arrays(layer) for layer in g.state.trunk + [g.state.mtp]] for g in side]
                  for side in (alone, gens)]
        return solo, [logs[id(g)] for g in gens], order, final, slots, arrays

    solo, batched, order, final, slots, (alone_arrays, batched_arrays) = engine.call(run)
    assert order == [2, 3] and final == [2, 3, 1, 4, 0] and slots == [4, 4, 5]
    assert batched == solo
    for a_layers, b_layers in zip(alone_arrays, batched_arrays):
        for la, lb in zip(a_layers, b_layers):
            for x, y in zip(la, lb):
                assert x.shape == y.shape
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threshold", [24, 8], ids=["rows-on-both-sides", "every-row-past"])
def test_past_the_few_row_kernels_threshold_a_batched_verify_is_each_row_alone_bit_for_bit(dense_engine, monkeypatch,
                                                                                          threshold):
    """From cpu_attention.FEW_FROM_KEYS keys (lowered here, so short prompts cross it) a row alone
    attends through the attention kernel's few-row entry. A ragged batch there runs its rows one by
    one through it, so a batched verify's logits are each row's alone, bit for bit; one batched
    masked call differed in the last bits (which greedy decoding turns into other tokens sooner or
    later) and made a short row attend over the longest row's length."""
    from mtplx.engine import batch_cache, cache_state, cpu_attention

    if cpu_attention.kernel()[0] is None or mx.fast.scaled_dot_product_attention is not cpu_attention.attention:
        pytest.skip("the CPU attention kernel is not active in this process")
    monkeypatch.setattr(cpu_attention, "FEW_FROM_KEYS", threshold)
    batched_calls, fused = [], cpu_attention._fused
    monkeypatch.setattr(cpu_attention, "_fused", lambda *a, **k: (batched_calls.append(k.get("row_keys")), fused(*a, **k))[1])
    prompts = _prompts(dense_engine)
    fed = [[5, 6, 7], [9, 10, 11], [12, 13, 14], [15, 16, 17]]

    def verify(tokens, cache):
        runner = dense_engine.runner
        with runner.small_forwards():
            cache_state.set_capture(cache, True)
            logits = runner.logits(runner.hidden(mx.array(tokens), cache))
            mx.eval(logits)
        return logits

    def run():
        alone = [verify([f], _ready(dense_engine, p).state.trunk)[0] for p, f in zip(prompts, fed)]
        gens = [_ready(dense_engine, p) for p in prompts]
        lengths = [g.state.length for g in gens]
        batched = verify(fed, batch_cache.merge([g.state.trunk for g in gens]))
        return lengths, [mx.array_equal(a, batched[b]).item() for b, a in enumerate(alone)]

    lengths, equal = dense_engine.call(run)
    if threshold == 24:
        assert min(lengths) + 3 < 24 <= max(lengths) + 3, lengths  # rows on both sides: each row its own call
        assert not any(batched_calls)
    else:
        assert any(batched_calls)  # every row past it: the batch's rows in one call of the entry
    assert all(equal), (lengths, equal)


def test_a_batch_past_32_rows_a_product_keeps_each_rows_bits(dense_engine):
    """Eight rows verifying 5 tokens each multiply 40 rows per product, past the small-row
    kernel's usual 32: the batch keeps them on the kernel (small_gemm.rows_up_to), whose sums do not
    depend on the row count, so every row's rounds and caches equal its own alone, bit for bit
    (MKL beyond 32 rows gave other last bits)."""
    from mtplx import fast_path

    if fast_path.KERNEL is None:
        pytest.skip("the small-row kernel is not active in this process")
    prompts = _prompts(dense_engine) + [p[:-4] for p in _prompts(dense_engine)]

    def ready(prompt):
        request = GenerationRequest(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        gen = Generation(dense_engine.runner, request, use_mtp=True, depth=4, chunk_size=64, eos_ids=dense_engine.eos_ids,
                         submitted_at=0.0)
        for _ in gen.prefill(StartPoint(), (), None):
            pass
        list(gen.first_token())
        return gen

    def run():
        alone, gens = [ready(p) for p in prompts], [ready(p) for p in prompts]
        solo = []
        for gen in alone:
            rounds = []
            for _ in range(3):
                new, drafts, accepted = gen.speculator.round(gen.draft_budget())
                list(gen.take_round(new, drafts, accepted))
                rounds.append((new, drafts, accepted))
            solo.append(rounds)
        batch, logs = DecodeBatch(dense_engine.runner, gens), [[] for _ in gens]
        for _ in range(3):
            for log, gen, result in zip(logs, gens, batch.step()):
                list(gen.take_round(*result))
                log.append(result)
        batch.release()
        same = [all(mx.array_equal(x, y).item() for la, lb in zip(a.state.trunk, b.state.trunk)
                    for x, y in zip(_layer_arrays(la), _layer_arrays(lb)))
                for a, b in zip(alone, gens)]
        return solo, logs, same

    solo, logs, same = dense_engine.call(run)
    assert max(len(d) for rounds in logs for _, d, _ in rounds) == 4  # 8 rows x 5 tokens per product
    assert logs == solo
    assert all(same), same


def test_leaving_order_fills_freed_slots_from_the_end():
    from mtplx.engine.batch_cache import leaving_order

    assert leaving_order(4, [1]) == [0, 3, 2]
    assert leaving_order(4, [1, 0]) == [2, 3]
    assert leaving_order(4, [3]) == [0, 1, 2]
    assert leaving_order(5, [0, 4]) == [3, 1, 2]
    assert leaving_order(3, [2, 1]) == [0]


def test_cancelling_one_row_leaves_the_others(engine, batch_sizes):
    requests = lambda: _requests(engine, 3, max_tokens=48)
    alone = [engine.submit(r).result().token_ids for r in requests()]
    subs = [engine.submit(r) for r in requests()]
    for event in subs[1]:
        if isinstance(event, Tokens):
            subs[1].cancel()
            break
    cancelled = subs[1].result()
    assert cancelled.finish_reason == "cancelled" and cancelled.completion_tokens < 48
    assert cancelled.token_ids == alone[1][: cancelled.completion_tokens]
    assert [subs[0].result().token_ids, subs[2].result().token_ids] == [alone[0], alone[2]]
    assert max(batch_sizes) >= 2


def test_a_short_request_gets_its_first_token_while_a_long_one_streams(dense_engine):
    long_request, short_request = _requests(dense_engine, 2, max_tokens=300)
    long = dense_engine.submit(long_request)
    for event in long:
        if isinstance(event, Tokens):
            break
    short = dense_engine.submit(GenerationRequest(short_request.prompt, SamplingParams(max_tokens=4), session="other"))
    short_events = list(short)
    long_end = long.result()
    first = next(e for e in short_events if isinstance(e, FirstToken))
    assert short_events[-1].finish_reason in ("stop", "length")
    assert first.t < short_events[-1].t < long_end.t  # served inside the long reply, not after it


def _serial_order(engine_config: EngineConfig, dense_engine) -> list[str]:
    """Which request's events come in which order when two are submitted together."""
    engine = Engine(dense_engine.model_path, engine_config, name="tiny-dense").start()
    try:
        order, lock = [], threading.Lock()

        def listen(event):
            if isinstance(event, (FirstToken, Finished)):
                with lock:
                    order.append((type(event).__name__, event.request_id))

        engine.listeners.append(listen)
        a, b = _requests(dense_engine, 2, max_tokens=24)
        subs = [engine.submit(a), engine.submit(b)]
        for s in subs:
            s.result()
        return [f"{kind}:{'a' if rid == a.request_id else 'b'}" for kind, rid in order]
    finally:
        engine.stop()


def test_admission_respects_max_batch_and_the_memory_budget(dense_engine):
    serial = ["FirstToken:a", "Finished:a", "FirstToken:b", "Finished:b"]
    assert _serial_order(EngineConfig(chunk_size=64, max_batch=1), dense_engine) == serial
    # 1 KiB of KV admits one request at a time (a request alone is admitted whatever its estimate).
    assert _serial_order(EngineConfig(chunk_size=64, memory_budget=1024), dense_engine) == serial
    together = _serial_order(EngineConfig(chunk_size=64), dense_engine)
    assert together.index("FirstToken:b") < together.index("Finished:a")


def test_admission_counts_each_row_at_the_longest_rows_estimate():
    """A batch's rows share one KV buffer as long as its longest row, so a short request beside a
    long one costs the long one's estimate: within the budget by the sum of their own estimates,
    refused by what the buffer would hold."""
    from types import SimpleNamespace

    from mtplx.engine.scheduler import Scheduler, Sequence

    scheduler = Scheduler(None, chunk_size=64, max_batch=8, memory_budget=1000, publish=None, finish=None)
    assert scheduler.can_admit(10_000)  # alone: always
    long = Sequence(sub=SimpleNamespace(), gen=None, prefill=None, reserved=600)
    scheduler.admit(long)
    assert not scheduler.can_admit(100)  # 600 + 100 fits, 2 x 600 does not
    scheduler.memory_budget = 1200
    assert scheduler.can_admit(100) and not scheduler.can_admit(601)
    scheduler.max_batch = 1
    assert not scheduler.can_admit(1)


@pytest.mark.parametrize("share", [1.0, 0.5, 0.25])
def test_prompts_get_their_share_of_the_engine_while_replies_stream(monkeypatch, share):
    """A prompt chunk at agent context costs many decode rounds (here 10): with a chunk every
    step (share 1.0) a streaming reply got a tenth of the engine while another prompt went in.
    With a share, a step runs the rounds alone while the prompts are ahead of it: over the
    contention the prompts' time stays within their share, one chunk over at most."""
    from types import SimpleNamespace

    from mtplx.engine import scheduler as scheduler_module
    from mtplx.engine.scheduler import Scheduler
    from mtplx.engine.stats import GenerationStats

    clock, ran = [0.0], []
    monkeypatch.setattr(scheduler_module.time, "perf_counter", lambda: clock[0])

    def prefill(self, seq, budget, shared=False):  # one chunk; the prompt has more to come
        ran.append("P")
        clock[0] += 10.0
        self.prefilling.append(seq)
        return budget

    def decode(self, key):
        ran.append("D")
        clock[0] += 1.0

    monkeypatch.setattr(Scheduler, "_prefill", prefill)
    monkeypatch.setattr(Scheduler, "_decode", decode)
    scheduler = Scheduler(None, chunk_size=64, max_batch=8, memory_budget=10**9, publish=None, finish=None,
                          prefill_share=share)
    scheduler.prefilling.append(SimpleNamespace(todo=10**6, decoding=False))
    scheduler.groups["mtp"] = [SimpleNamespace(gen=SimpleNamespace(stats=GenerationStats()))]
    for _ in range(200):
        scheduler.step()
    prompts, rounds = 10.0 * ran.count("P"), 1.0 * ran.count("D")
    assert ran.count("D") == 200  # every step decodes
    assert (prompts - 10.0) / (prompts - 10.0 + rounds) <= share  # within their share, one chunk over at most
    # and not held back past it: one more chunk would have been over, or a chunk ran every step
    assert ran.count("P") == 200 or (prompts + 10.0) / (prompts + 10.0 + rounds) > share
    if share == 1.0:
        assert ran == ["P", "D"] * 200  # as before: a chunk every step
    scheduler.groups.clear()  # no reply streams: a chunk every step again
    ran.clear()
    for _ in range(3):
        scheduler.step()
    assert ran == ["P"] * 3


def test_the_prompts_share_is_between_0_and_1():
    with pytest.raises(ValueError, match="prefill_share"):
        EngineConfig(prefill_share=0)
    with pytest.raises(ValueError, match="prefill_share"):
        EngineConfig(prefill_share=1.5)


def _submit_together(engine, requests) -> list:
    """Submit `requests` while the engine thread is busy, so they arrive together (as an agent's
    parallel subagents do); their submissions."""
    busy, gate = threading.Event(), threading.Event()
    holder = threading.Thread(target=engine.call, args=(lambda: (busy.set(), gate.wait()),))
    holder.start()
    busy.wait()
    subs = [engine.submit(r) for r in requests]
    gate.set()
    holder.join()
    return subs


def _burst_merges(engine, requests, monkeypatch) -> list[int]:
    """Rows of each batch merged while `requests` arrive together (_submit_together)."""
    merges, init = [], DecodeBatch.__init__

    def spy(self, runner, gens):
        merges.append(len(gens))
        init(self, runner, gens)

    monkeypatch.setattr(batch_module.DecodeBatch, "__init__", spy)
    for sub in _submit_together(engine, requests):
        sub.result()
    monkeypatch.undo()
    return merges


def test_a_burst_of_short_requests_starts_together_in_one_merge(dense_engine, monkeypatch):
    """Requests that arrive together are admitted together and prefilled in one step, as long as
    their prompts fit one chunk: the first batch holds all of them, instead of growing a row per
    step with a decode round and a merge for each."""
    engine = Engine(dense_engine.model_path, EngineConfig(chunk_size=256), name="tiny-dense").start()
    try:
        assert _burst_merges(engine, _requests(engine, 4, max_tokens=12), monkeypatch)[0] == 4
    finally:
        engine.stop()
    # With 64-token chunks, the first in line takes its prompt whatever its length, the next ones
    # only while their whole prompt fits what is left: the decoding rows never wait for more.
    requests = _requests(dense_engine, 4, max_tokens=12)
    fit, left = 1, 64 - len(requests[0].prompt)
    while fit < len(requests) and len(requests[fit].prompt) <= left:
        left -= len(requests[fit].prompt)
        fit += 1
    assert 1 < fit < 4  # the case is one where the budget matters
    assert _burst_merges(dense_engine, requests, monkeypatch)[0] == fit


def test_ragged_cache_rows_round_trip(dense_engine):
    """Rows of different lengths merged into one ragged cache come back as they went in, and a
    per-row trim only moves that row's end."""
    from mtplx.engine.batch_cache import merge, split

    def run():
        runner = dense_engine.runner
        caches = []
        for n in (5, 17, 9):
            cache = runner.new_trunk_cache()
            runner.hidden(list(range(3, 3 + n)), cache)
            caches.append(cache)
        merged = merge(caches)
        merged[0].trim_rows([0, 4, 1])
        back = split(merged, 3)
        same = [mx.array_equal(row[0].keys, orig[0].keys[..., : row[0].offset, :]).item() and
                mx.array_equal(row[0].values, orig[0].values[..., : row[0].offset, :]).item()
                for orig, row in zip(caches, back)]
        return [row[0].offset for row in back], merged[0].lengths, same

    offsets, lengths, same = dense_engine.call(run)
    assert lengths == offsets == [5, 13, 8]
    assert all(same)


def test_a_ragged_write_lands_at_each_rows_own_end_and_masks_follow_the_lengths():
    """One write of S tokens per row puts row b's at [lengths[b], lengths[b] + S) and nowhere
    else; the mask every layer of the batch shares is rebuilt when a per-row trim moves the ends."""
    from mlx_lm.models.cache import KVCache

    from mtplx.engine.batch_cache import merge

    rng = np.random.default_rng(0)
    rows = []
    for n in (3, 7, 0):
        layers = []
        for _ in range(2):
            cache = KVCache()
            if n:
                cache.update_and_fetch(mx.array(rng.normal(size=(1, 2, n, 4)), mx.float32),
                                       mx.array(rng.normal(size=(1, 2, n, 4)), mx.float32))
            layers.append(cache)
        rows.append(layers)
    before = [[np.array(c.keys) if c.keys is not None else None for c in layers] for layers in rows]
    merged = merge(rows)
    first, second = merged
    mask = first.make_mask(2)
    assert second.make_mask(2) is mask  # built once for the whole batch
    new = mx.array(rng.normal(size=(3, 2, 2, 4)), mx.float32)
    keys, _ = first.update_and_fetch(new, new * 2)
    keys = np.array(keys)
    for b, n in enumerate((3, 7, 0)):
        if n:
            assert np.array_equal(keys[b, :, :n], before[b][0][0, :, :n])
        assert np.array_equal(keys[b, :, n : n + 2], np.array(new[b]))
    assert first.lengths == [5, 9, 2]
    expected = np.arange(9)[None, None, None, :] <= np.array([3, 7, 0])[:, None, None, None] + np.arange(2)[None, None, :, None]
    assert np.array_equal(np.array(mask), expected)
    second.update_and_fetch(new, new)
    first.trim_rows([1, 0, 2])
    second.trim_rows([1, 0, 2])
    again = first.make_mask(1)
    assert np.array_equal(np.array(again), np.arange(10)[None, None, None, :] <= np.array([4, 9, 0])[:, None, None, None])
    assert second.make_mask(1) is again


def test_a_failing_batched_step_fails_its_rows_and_the_engine_serves_on(dense_engine, monkeypatch):
    def broken(self):
        raise RuntimeError("simulated failure in a batched step")

    monkeypatch.setattr(batch_module.DecodeBatch, "step", broken)
    subs = [dense_engine.submit(r) for r in _requests(dense_engine, 3, max_tokens=40)]
    ends = [list(s)[-1] for s in subs]
    failed = [e for e in ends if isinstance(e, Failed)]
    assert len(failed) >= 2 and all(e.kind == "internal" for e in failed)
    monkeypatch.undo()
    assert dense_engine.alive and dense_engine.busy is None
    assert dense_engine.submit(_requests(dense_engine, 1)[0]).result().completion_tokens == 40


def test_two_banked_sessions_at_once_restore_and_equal_cold(hybrid_engine, batch_sizes):
    """Two agents drive one banked engine at the same time (their turns interleave and batch):
    every warm turn restores from the bank, and each agent's replies equal a cold engine's."""
    from mtplx.bank.bank import BankConfig
    from mtplx.synth.agent import Sizes, conversation
    from mtplx.synth.corpus import Corpus
    from test_bank_restore import _agent_turns

    convos = {"a": conversation(77, Corpus(), Sizes(20, 50), max_user_turns=2),
              "b": conversation(78, Corpus(), Sizes(20, 50), max_user_turns=2)}
    cold = {name: [t[0] for t in _agent_turns(hybrid_engine, convo, 3)] for name, convo in convos.items()}
    banked = Engine(hybrid_engine.model_path, EngineConfig(chunk_size=64), name="tiny-hybrid", bank=BankConfig()).start()
    try:
        warm, errors = {}, []

        def drive(name):
            try:
                warm[name] = _agent_turns(banked, convos[name], 3)
            except Exception as exc:  # reported below, on the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=drive, args=(name,)) for name in convos]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors
        assert max(batch_sizes) == 2  # the two agents' turns decoded in one batch
        for name in convos:
            assert [w[0] for w in warm[name]] == cold[name]
            assert warm[name][0][1] == 0 and all(w[1] > 0 for w in warm[name][1:])
    finally:
        banked.stop()


def test_a_burst_goes_straight_to_drafting_with_no_plain_steps_alone(engine):
    """A reply whose first token shows nothing (here the model's opening reasoning marker) leads
    with plain steps when it runs alone (test_mtp_exactness), but in a burst each such step would
    be one row's step while every other row waits: there the head's short prompt KV goes at once
    and the first round drafts. The tokens are still AR greedy's."""
    from mtplx.events import DraftVerified

    requests = [GenerationRequest(r.prompt, SamplingParams(max_tokens=16, ignore_eos=True), use_mtp=True, depth=2,
                                  session=r.session) for r in _requests(engine, 4)]
    subs = _submit_together(engine, requests)
    hidden_first = 0
    for request, sub in zip(requests, subs):
        events = list(sub)
        ar = engine.submit(GenerationRequest(request.prompt, SamplingParams(max_tokens=16, ignore_eos=True),
                                             use_mtp=False)).result()
        assert events[-1].token_ids == ar.token_ids
        first = next(e for e in events if isinstance(e, Tokens))
        before = []
        for event in events:
            if isinstance(event, DraftVerified):
                break
            if isinstance(event, Tokens):
                before.extend(event.token_ids)
        if not first.pieces:  # showed the client nothing: alone, plain steps would follow
            hidden_first += 1
            assert before == list(ar.token_ids[:1])
    assert hidden_first >= 2  # the case is one the rule decides
