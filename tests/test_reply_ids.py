"""A reply sent back renders as the ids the model generated (mtplx/reply_ids.py): pure splicing
against the real template, the store on disk, and on the engine a non-canonical reply restored in
full at once, with nothing rendered ahead, and the next turn equal to a cold engine's."""

from __future__ import annotations

import pytest

from mtplx.chat import common_prefix, render
from mtplx.reply_ids import ReplyIds, reply_key

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.fixture
def tok():
    """A tokenizer of its own: the store is per tokenizer, and the session-wide one stays clean."""
    from transformers import AutoTokenizer

    from mtplx.catalog import resolve

    return AutoTokenizer.from_pretrained(str(resolve("tiny-dense")))


def _non_canonical(tok, before: str, after: str) -> list[int]:
    """`before` + "\\n\\n" + `after` as a model samples it: the blank line as two newline tokens."""
    newline = tok.encode("\n", add_special_tokens=False)
    assert tok.encode("\n\n", add_special_tokens=False) != newline * 2  # the tokenizer merges them
    return tok.encode(before, add_special_tokens=False) + newline * 2 + tok.encode(after, add_special_tokens=False)


def test_a_sent_back_reply_renders_as_generated_before_either_follow_up(tok):
    ask = [{"role": "user", "content": "Summarise app.py."}]
    ids = _non_canonical(tok, "It prints hello.", "Then it exits.")
    reply = {"role": "assistant", "content": tok.decode(ids)}
    prompt = render(tok, ask, TOOLS)
    canonical = [render(tok, ask + [reply, f], TOOLS) for f in ({"role": "user", "content": "Thanks."},
                                                                {"role": "tool", "tool_call_id": "c", "content": "x"})]
    assert all(common_prefix(c, prompt + ids) < len(prompt) + len(ids) for c in canonical)
    ReplyIds.of(tok).record(tok, reply, ids)
    for sent in (reply, dict(reply, content=reply["content"] + "\n")):  # a client may add a newline: same reply
        for follow in ({"role": "user", "content": "Thanks."}, {"role": "tool", "tool_call_id": "c", "content": "x"}):
            convo = ask + [sent, follow]
            again = render(tok, convo, TOOLS)
            assert again[: len(prompt) + len(ids)] == prompt + ids
            assert tok.decode(again) == tok.apply_chat_template(convo, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    other = ask + [{"role": "assistant", "content": "Something else."}, {"role": "user", "content": "ok"}]
    assert render(tok, other) == list(tok.apply_chat_template(other, tokenize=True, return_dict=False, add_generation_prompt=True))


def test_the_part_after_stripped_reasoning_and_before_a_reserialised_call_is_spliced(tok):
    think_end, call = tok.encode("</think>", add_special_tokens=False), tok.encode("<tool_call>", add_special_tokens=False)
    body = _non_canonical(tok, "I will read it.", "Reading now.")
    ids = (tok.encode("<think>\nLook first.\n", add_special_tokens=False) + think_end
           + tok.encode("\n\n", add_special_tokens=False) + body + tok.encode("\n", add_special_tokens=False) + call
           + tok.encode('\n{"name":"read_file","arguments":{"path":"a.py"}}\n</tool_call>', add_special_tokens=False))
    content = tok.decode(body)
    reply = {"role": "assistant", "content": content, "reasoning_content": "Look first.",
             "tool_calls": [{"id": "c", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]}
    ReplyIds.of(tok).record(tok, reply, ids)
    ask = [{"role": "user", "content": "Read a.py."}]
    for follow in ({"role": "user", "content": "Thanks."}, {"role": "tool", "tool_call_id": "c", "content": "x"}):
        prompt = render(tok, ask + [reply, follow], TOOLS)
        at = next(i for i in range(len(prompt)) if prompt[i: i + len(body)] == body)  # the content, as generated
        assert tok.decode(prompt[:at]).endswith(("assistant\n", "</think>\n\n"))


def test_a_reply_quoted_in_an_earlier_message_is_spliced_where_the_reply_is(tok):
    ids = _non_canonical(tok, "Yes.", "Done.")
    text = tok.decode(ids)
    reply = {"role": "assistant", "content": text}
    ReplyIds.of(tok).record(tok, reply, ids)
    convo = [{"role": "user", "content": f"Answer exactly: {text}"}, reply, {"role": "user", "content": "ok"}]
    spliced = render(tok, convo)
    head = render(tok, convo[:1])
    assert spliced[: len(head)] == head  # the quote encodes as text...
    assert spliced[len(head): len(head) + len(ids)] == ids  # ...and the reply as generated


def test_the_store_survives_a_restart_and_a_damaged_file(tok, tmp_path):
    from transformers import AutoTokenizer

    from mtplx.catalog import resolve

    path = tmp_path / "replies.db"
    ids = _non_canonical(tok, "First.", "Second.")
    reply = {"role": "assistant", "content": tok.decode(ids)}
    ReplyIds.of(tok).persist(path)
    ReplyIds.of(tok).record(tok, reply, ids)
    fresh = AutoTokenizer.from_pretrained(str(resolve("tiny-dense")))  # a new process's tokenizer
    ReplyIds.of(fresh).persist(path)
    convo = [{"role": "user", "content": "Go."}, reply, {"role": "user", "content": "ok"}]
    assert render(fresh, convo) == render(tok, convo)
    assert reply_key(reply) in ReplyIds.of(fresh).records
    damaged = tmp_path / "damaged.db"
    damaged.write_bytes(b"not a database" * 100)
    third = AutoTokenizer.from_pretrained(str(resolve("tiny-dense")))
    ReplyIds.of(third).persist(damaged)  # set aside, a fresh file in its place
    ReplyIds.of(third).record(third, reply, ids)
    assert render(third, convo) == render(tok, convo)
    assert [p.read_bytes() for p in tmp_path.glob("damaged.db.damaged-*")] == [b"not a database" * 100]
    fourth = AutoTokenizer.from_pretrained(str(resolve("tiny-dense")))
    ReplyIds.of(fourth).persist(damaged)
    assert reply_key(reply) in ReplyIds.of(fourth).records  # the fresh file persisted the third's record


def test_records_a_full_disk_refused_are_written_once_it_takes_them(tok, tmp_path):
    from transformers import AutoTokenizer

    from mtplx.catalog import resolve

    path = tmp_path / "replies.db"
    store = ReplyIds.of(tok)
    store.persist(path)
    pages = store.db.execute("pragma page_count").fetchone()[0]
    store.db.execute(f"pragma max_page_count = {pages}")  # sqlite answers as on a full disk
    replies = []
    for i in range(3):
        ids = _non_canonical(tok, f"Reply {i}. " + "word " * 400, "Done.")
        replies.append({"role": "assistant", "content": tok.decode(ids)})
        store.record(tok, replies[-1], ids)
        if i == 1:
            assert len(store.unsaved) == 2  # refused, still served from memory
            store.db.execute("pragma max_page_count = 1000000")  # space freed
    assert not store.unsaved
    fresh = AutoTokenizer.from_pretrained(str(resolve("tiny-dense")))  # a new process
    ReplyIds.of(fresh).persist(path)
    assert all(reply_key(r) in ReplyIds.of(fresh).records for r in replies)


def test_a_lock_on_the_file_never_holds_the_engine_and_the_record_goes_in_later(tok, tmp_path):
    """Records are written on the engine thread at each turn's end: another process holding the file
    (a second server on the same home) is waited on for WRITE_WAIT_MS, not sqlite's 5 s, and the
    refused record is written with the next one."""
    import sqlite3
    import threading

    from transformers import AutoTokenizer

    from mtplx.catalog import resolve

    path = tmp_path / "replies.db"
    store = ReplyIds.of(tok)
    store.persist(path)
    blocker = sqlite3.connect(str(path), isolation_level=None)
    blocker.execute("begin exclusive")
    replies = []

    def record(i):
        ids = _non_canonical(tok, f"Reply {i}. " + "word " * 40, "Done.")
        replies.append({"role": "assistant", "content": tok.decode(ids)})
        store.record(tok, replies[-1], ids)

    ended = threading.Thread(target=record, args=(0,))
    ended.start()
    ended.join(2.5)  # sqlite's default busy wait alone is 5 s
    assert not ended.is_alive(), "the record waited on the lock"
    assert len(store.unsaved) == 1  # refused, still served from memory
    blocker.execute("rollback")
    record(1)
    assert not store.unsaved
    fresh = AutoTokenizer.from_pretrained(str(resolve("tiny-dense")))  # a new process
    ReplyIds.of(fresh).persist(path)
    assert all(reply_key(r) in ReplyIds.of(fresh).records for r in replies)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_a_long_sampled_reply_sent_back_at_once_restores_whole_and_matches_cold(name):
    """Without any render-ahead (the client resends before idle time), the follow-up restores
    through the whole reply even though the model sampled it in non-canonical ids, and its
    greedy answer equals a cold engine's on the same prompt (restored == cold)."""
    from mtplx.bank.bank import BankConfig
    from mtplx.catalog import resolve
    from mtplx.chat import chat_request
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.engine.sampling import SamplingParams

    warm = Engine(resolve(name), EngineConfig(chunk_size=64), name=name, bank=BankConfig(render_ahead=False)).start()
    cold = Engine(resolve(name), EngineConfig(chunk_size=64), name=name).start()
    try:
        tok = warm.checkpoint.tokenizer
        system = "You are a coding agent. " + " ".join(f"Rule {k}: keep the change small and tested." for k in range(12))
        for seed in range(24):  # a whole reply whose sampled ids the tokenizer would not choose
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"Explain how a hash map works ({seed})."}]
            first = chat_request(tok, msgs, sampling=SamplingParams(temperature=1.0, seed=seed, max_tokens=200), session=f"s{seed}")
            fin = warm.submit(first).result()
            ids = list(fin.token_ids)
            if fin.finish_reason == "stop" and tok.encode(tok.decode(ids), add_special_tokens=False) != ids:
                break
        else:
            pytest.fail("no non-canonical reply ended by the model in 24 samples")
        follow = msgs + [fin.reply, {"role": "tool", "tool_call_id": "call_0", "content": "ok"}]
        second = chat_request(tok, follow, sampling=SamplingParams(max_tokens=24), session=f"s{seed}")
        ended = list(first.prompt) + ids + [tok.eos_token_id]  # what the model computed: the reply and its stop token
        assert second.prompt[: len(ended)] == tuple(ended)
        canonical = tok.encode(tok.decode(ids), add_special_tokens=False)
        assert common_prefix(canonical, ids) < len(ids)  # what re-encoding the text would have lost
        again = warm.submit(second).result()
        assert again.cached_tokens >= len(ended)
        fresh = cold.submit(chat_request(cold.checkpoint.tokenizer, follow, sampling=SamplingParams(max_tokens=24),
                                         prompt=list(second.prompt))).result()
        assert fresh.cached_tokens == 0 and fresh.token_ids == again.token_ids
    finally:
        warm.stop()
        cold.stop()


def test_a_reply_repeated_later_in_other_ids_leaves_the_earlier_rendering_alone(tok):
    """An agent repeating itself: the same reply (content, reasoning, call) generated twice in
    different ids. The earlier turn keeps rendering as it did, stripped of its reasoning, and the
    later one renders as its own ids: the history the bank holds stays a prefix of each prompt."""
    think = tok.encode("<think>\nCheck it.\n</think>\n\n", add_special_tokens=False)
    first_ids = think + _non_canonical(tok, "Looking.", "Now.")
    text = tok.decode(first_ids[len(think):])
    again_ids = think + tok.encode(text, add_special_tokens=False)
    assert again_ids != first_ids
    reply = {"role": "assistant", "content": text, "reasoning_content": "Check it."}
    u1, u2 = {"role": "user", "content": "Look at a.py."}, {"role": "user", "content": "And again?"}
    tool = {"role": "tool", "tool_call_id": "c", "content": "x = 1"}
    replies = ReplyIds.of(tok)
    replies.record(tok, reply, first_ids, render(tok, [u1]))
    before = render(tok, [u1, reply, tool, u2])  # the first reply, stripped: its content as generated
    replies.record(tok, reply, again_ids, before)
    assert render(tok, [u1, reply, tool, u2]) == before
    later = render(tok, [u1, reply, tool, u2, reply, tool])
    assert later[: len(before)] == before
    assert later[len(before): len(before) + len(again_ids)] == again_ids


def test_a_reply_opening_with_a_newline_keeps_it_so_it_comes_back_as_generated(tok):
    """A tiny model often opens a plain reply with a newline; dropping it from the message made the
    whole sent-back reply differ from the model's tokens (a Codex run restored 9264 of 9390)."""
    from mtplx.reply_stream import ReplyStream, message

    assert message(ReplyStream().feed("\n# Title\nBody.\n", final=True))["content"] == "\n# Title\nBody."
    assert message(ReplyStream().feed("<think>\nR\n</think>\n\nAnswer.", final=True))["content"] == "Answer."
    ids = tok.encode("\n# Title\nBody.", add_special_tokens=False)
    reply = message(ReplyStream().feed(tok.decode(ids), final=True))
    ReplyIds.of(tok).record(tok, reply, ids)
    ask = [{"role": "user", "content": "Go."}]
    prompt = render(tok, ask)
    assert render(tok, ask + [reply, {"role": "user", "content": "ok"}])[: len(prompt) + len(ids)] == prompt + ids
