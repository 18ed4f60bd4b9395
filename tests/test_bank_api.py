"""The bank as a planner and a store, without the engine: planning reads the store and changes
nothing, the store keeps what it is handed, commit remembers the reply and names the renderings
the next request will use. Entries here hold no arrays (attention layers with empty snapshots):
planning needs their tokens and metadata only."""

from __future__ import annotations

import pytest

from mtplx.bank.anchors import Anchor
from mtplx.bank.bank import BankConfig, SessionBank, TurnRecord
from mtplx.bank.entry import Entry
from mtplx.chat import render
from mtplx.state.snapshot import LayerSnapshot

MESSAGES = [{"role": "system", "content": "You are a careful coding agent. " * 8},
            {"role": "user", "content": "Read src/app.py and say what it does."}]
REPLY = {"role": "assistant", "content": "It prints hello."}


def _bank(tokenizer, **config):
    heard = []
    bank = SessionBank(tokenizer, "m", recurrent=False, config=BankConfig(min_restore=8, **config),
                       notify=lambda action, detail: heard.append(action))
    return bank, heard


def _entry(tokens, session="s") -> Entry:
    return Entry(tuple(tokens), "m:ar", [LayerSnapshot("kv", (None, None), len(tokens))], {}, None, None,
                 [Anchor(len(tokens), "message")], session)


def test_plan_reads_the_store_and_changes_nothing(tokenizer):
    bank, heard = _bank(tokenizer)
    prompt = render(tokenizer, MESSAGES)
    held = _entry(prompt[:-10])
    bank.put(held)
    before = (dict(bank.entries), held.hits, held.last_used, list(heard), dict(bank.outcomes))
    plan = bank.plan(prompt, use_mtp=False, session=None, chat={"messages": MESSAGES}, request_id="r1")
    assert plan.restore.entry_id == held.entry_id and plan.restore.position == len(prompt) - 10
    assert plan.identity == "m:ar" and plan.session == "s"  # inferred from the entry it restores from
    assert plan.anchors and all(a.position <= len(prompt) for a in plan.anchors)
    assert (dict(bank.entries), held.hits, held.last_used, list(heard), dict(bank.outcomes)) == before


def test_plan_for_another_mode_or_model_is_cold(tokenizer):
    bank, _ = _bank(tokenizer)
    prompt = render(tokenizer, MESSAGES)
    bank.put(_entry(prompt[:-10]))
    assert bank.plan(prompt, use_mtp=True).restore.entry_id is None  # an AR entry holds no MTP state
    assert bank.plan([7] * len(prompt), use_mtp=False).restore.entry_id is None


def test_store_put_get_evict(tokenizer):
    bank, heard = _bank(tokenizer)
    short, long = _entry(range(40)), _entry(range(60))
    bank.put(short)
    bank.put(long)  # a strict prefix is superseded by the entry that extends it
    assert list(bank.entries) == [long.entry_id] and heard == ["stored", "superseded", "stored"]
    assert bank.get(long.entry_id, "m:ar") == (long, "ram") and bank.holds(range(60)) and not bank.holds(range(40))
    bank.evict(long.entry_id, "damaged")
    assert not bank.entries and heard[-1] == "discarded"


@pytest.mark.parametrize("sent_back", [True, False])
def test_commit_remembers_the_reply_and_names_the_next_renderings(tokenizer, sent_back):
    bank, _ = _bank(tokenizer)
    prompt = render(tokenizer, MESSAGES)
    chat = {"messages": MESSAGES, "tools": None}
    renderings = bank.commit(TurnRecord(_entry(prompt, session="s"), chat, REPLY, sent_back=sent_back))
    assert bank.last_turn["s"] == (len(MESSAGES), REPLY)
    if not sent_back:  # cancelled or cut by a stop string: the client will not send it back as it is
        assert renderings == []
        return
    assert renderings
    for follow in ({"role": "user", "content": "Thanks."}, {"role": "tool", "content": "x = 1"}):
        try:
            nxt = render(tokenizer, MESSAGES + [REPLY, follow], add_generation_prompt=False)
        except Exception:  # a template without this follow-up
            continue
        assert any(nxt[: len(r)] == r and len(r) > len(prompt) for r in renderings), follow["role"]


def test_commit_without_render_ahead_names_nothing(tokenizer):
    bank, _ = _bank(tokenizer, render_ahead=False)
    prompt = render(tokenizer, MESSAGES)
    assert bank.commit(TurnRecord(_entry(prompt), {"messages": MESSAGES}, REPLY, sent_back=True)) == []
    assert bank.holds(prompt)
