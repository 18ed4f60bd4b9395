"""The bank on real chat templates (Llama 3's, Gemma 3's, DeepSeek-V3's, ours): turn markers found by
probing the template (open/close turns, or DeepSeek's role tokens), message spans and anchors on
those turns, render-ahead cut at them, and sliding-window caches banked exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

import standins
from mtplx.bank.anchors import prompt_anchors
from mtplx.bank.bank import SessionBank
from mtplx.bank.markers import Markers
from mtplx.bank.spans import message_spans, reuse_ceiling
from mtplx.chat import chat_request, render

TINY = Path(__file__).resolve().parents[1] / "mtplx" / "assets" / "models" / "tiny-dense"
DEEPSEEK = Path(__file__).resolve().parent / "fixtures" / "deepseek_v3"
# A template of our own that adds a system turn when the conversation has none, as Llama 3.1's does.
INJECTING = ("{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|start_header_id|>system<|end_header_id|>\n\n"
             "Today is a day.<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
             "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
             "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHAT = [{"role": "system", "content": ("You are a careful agent. " * 6).strip()}, {"role": "user", "content": "Read a.py"},
        {"role": "assistant", "content": "It sets x."}, {"role": "user", "content": "And b.py?"}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tok")
    out = {"chatml": AutoTokenizer.from_pretrained(str(TINY))}
    for family in ("llama3", "gemma3"):
        out[family] = AutoTokenizer.from_pretrained(str(standins.family_tokenizer(family, root / family)))
    injecting = AutoTokenizer.from_pretrained(str(standins.family_tokenizer("llama3", root / "inject")))
    injecting.chat_template = INJECTING
    out["injecting"] = injecting
    return out


def deepseek_dir(dest: Path) -> Path:
    """The real DeepSeek-V3 tokenizer and template (tests/fixtures/deepseek_v3), unzipped at `dest`."""
    import gzip
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_bytes(gzip.decompress((DEEPSEEK / "tokenizer.json.gz").read_bytes()))
    shutil.copy(DEEPSEEK / "tokenizer_config.json", dest / "tokenizer_config.json")
    return dest


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(deepseek_dir(tmp_path_factory.mktemp("deepseek"))))


def test_probe_finds_each_templates_turn_tokens(tokenizers):
    def ids(tok, *names):
        return tuple(tok.convert_tokens_to_ids(n) for n in names)

    chatml, llama, gemma = (Markers.from_tokenizer(tokenizers[k]) for k in ("chatml", "llama3", "gemma3"))
    assert (chatml.turn_start, chatml.turn_end) == ids(tokenizers["chatml"], "<|im_start|>", "<|im_end|>")
    assert chatml.tools_merged and not chatml.system_merged and chatml.newline is not None
    # The stand-in tokenizers still hold ChatML's tokens: only the template says which are used.
    assert (llama.turn_start, llama.turn_end) == ids(tokenizers["llama3"], "<|start_header_id|>", "<|eot_id|>")
    assert llama.newline is None and not llama.system_merged and llama.system
    assert (gemma.turn_start, gemma.turn_end) == ids(tokenizers["gemma3"], "<start_of_turn>", "<end_of_turn>")
    assert gemma.system_merged and gemma.newline is not None
    assert Markers.from_tokenizer(tokenizers["injecting"]).lead == 1


@pytest.mark.parametrize("name", ["chatml", "llama3", "gemma3", "injecting"])
def test_spans_map_each_message_to_its_turn(tokenizers, name):
    """Each message's span starts where rendering the messages before it ends (the template's own
    boundaries), and every complete message end is a message anchor."""
    tok = tokenizers[name]
    markers = Markers.from_tokenizer(tok)
    for messages in (CHAT, CHAT[1:]):
        prompt = render(tok, messages)
        spans = message_spans(prompt, messages, markers)
        assert [s.index for s in spans] == list(range(len(messages)))
        anchors = {a.position for a in prompt_anchors(prompt, markers, min_restore=1, grid=10_000)}
        for k in range(1, len(messages)):
            if name == "gemma3" and k == 1 and messages[0]["role"] == "system":
                continue  # Gemma folds the system message into the first user turn: no boundary there
            if name == "chatml" and messages[k - 1]["role"] == "assistant":
                continue  # Qwen's template gives a last assistant turn an empty think block: not a prefix
            before = render(tok, messages[:k], add_generation_prompt=False)
            assert prompt[: len(before)] == before
            assert spans[k].start == len(before), (name, k)
            assert len(before) in anchors
        # A follow-up turn's ceiling: everything the previous request and its reply held.
        assert reuse_ceiling(spans, len(messages) - 1, None) == spans[-1].start > 0


def test_gemma_system_shares_the_first_user_turn(tokenizers):
    tok = tokenizers["gemma3"]
    prompt = render(tok, CHAT)
    spans = message_spans(prompt, CHAT, Markers.from_tokenizer(tok))
    assert (spans[0].start, spans[0].end) == (spans[1].start, spans[1].end)
    assert tok.decode(prompt[spans[2].start: spans[2].start + 3]).startswith("<start_of_turn>model")


def test_gemmas_head_ends_where_the_first_user_messages_text_begins(tokenizers):
    """Gemma writes the system prompt into the first user turn: the head (bank/folded_head.py)
    ends just before that message's own text, the same tokens for any user message, and only
    where the request's tokens agree; a template with a system turn keeps its own head."""
    from mtplx.bank.folded_head import FoldedHeads

    tok = tokenizers["gemma3"]
    system = {"role": "system", "content": "You are a careful agent. " * 20}
    heads = FoldedHeads(tok)
    found = []
    for text in ("Read a.py", "\nStarts with a newline", "a"):
        chat = {"messages": [system, {"role": "user", "content": text}], "tools": None}
        prompt = render(tok, chat["messages"])
        found.append(heads.head(chat, prompt))
        assert tok.decode(prompt[found[-1]:]).startswith(text.strip())
    assert found[0] == found[1] == found[2] and len(heads.known) == 1  # probed once
    chat = {"messages": [system, {"role": "user", "content": "Read a.py"}], "tools": None}
    other = render(tok, [{"role": "system", "content": "You are brief. " * 20}, chat["messages"][1]])
    assert heads.head(chat, other) is None  # its tokens are not this system prompt's
    assert heads.head({"messages": chat["messages"][1:], "tools": None}, render(tok, chat["messages"][1:])) is None
    bank = SessionBank(tok, "x", recurrent=True)
    anchors = bank.plan(render(tok, chat["messages"]), use_mtp=False, chat=chat).anchors
    assert [a.position for a in anchors if a.kind == "head"] == [found[0]]
    llama = tokenizers["llama3"]
    prompt = render(llama, chat["messages"])
    assert [a.position for a in SessionBank(llama, "x", recurrent=True).plan(prompt, use_mtp=False, chat=chat).anchors
            if a.kind == "head"] == [a.position for a in prompt_anchors(prompt, Markers.from_tokenizer(llama)) if a.kind == "head"]


def test_the_system_text_before_the_tools_is_an_anchor_of_its_own(tokenizers, deepseek):
    """Inside the head, where the system text ends and the tool list begins (bank/system_end.py):
    the same point whatever the tools, so a session whose tools changed restores its system
    prompt. Found on the template's own renderings; none without tools, none where the prompt's
    tokens are not that system prompt's."""
    from mtplx.bank.plan import common_prefix

    def tool(name):
        return {"type": "function", "function": {"name": name, "description": f"The {name} tool.",
                                                 "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}

    system = {"role": "system", "content": "You are a careful coding agent. Read before you edit. " * 4}
    ask = {"role": "user", "content": "Fix the failing test."}
    for name, tok in (("chatml", tokenizers["chatml"]), ("deepseek", deepseek)):
        bank = SessionBank(tok, "x", recurrent=True)

        def anchors(tools, messages=(system, ask)):
            prompt = render(tok, list(messages), tools)
            plan = bank.plan(prompt, use_mtp=False, chat={"messages": list(messages), "tools": tools})
            return prompt, {a.kind: a.position for a in plan.anchors if a.kind in ("system", "head")}

        both, (fewer, ends) = anchors([tool("read_file"), tool("grep")]), anchors([tool("grep")])
        (prompt, found) = both
        if name == "chatml":  # Qwen's template: the system text, then "# Tools"
            assert "system" in found and tok.decode(prompt[: found["system"]]).rstrip().endswith("Read before you edit.")
        if "system" in found:
            assert 32 <= found["system"] < found["head"] and ends.get("system") == found["system"]
            assert common_prefix(prompt, fewer) >= found["system"]  # both heads hold it: a restore point for either
        assert "system" not in anchors(None)[1]  # no tools: the head is the system text
        other = {"role": "system", "content": "You are terse. " * 12}
        assert anchors([tool("grep")], (other, ask))[1].get("system") != found.get("system") or "system" not in found


def test_spans_on_integer_lists():
    """Pure: turn 1 opens at token 1; the flags decide which messages share a turn."""
    prompt = [0, 1, 9, 5, 2, 1, 8, 5, 2, 1, 8, 6, 2, 1, 8, 6, 2, 1, 7]
    msgs = [{"role": "system"}, {"role": "user"}, {"role": "tool"}, {"role": "tool"}]
    starts = lambda m: [s.start for s in message_spans(prompt, msgs, m)]
    assert starts(Markers(1, 2, None, (9,), tools_merged=True)) == [1, 5, 9, 9]
    assert starts(Markers(1, 2, None, (9,), tools_merged=False)) == [1, 5, 9, 13]
    assert starts(Markers(1, 2, None, (), system_merged=True, tools_merged=False)) == [1, 1, 5, 9]
    assert [s.start for s in message_spans(prompt, msgs[1:], Markers(1, 2, None, (9,), tools_merged=False, lead=1))] == [5, 9, 13]


def test_role_token_spans_on_integer_lists():
    """Pure: role tokens 1 (user) and 2 (assistant), 3+4 one opening of a tool run, 4 alone a further
    result, 5 closes the run and the reply after it starts right after; 0 is BOS, 9 the system text."""
    roles = Markers(None, None, None, opens=(1, 2, 3, 4), joined=((3, 4),), after=(5,), system_bare=True, preamble=1,
                    tools_merged=False)
    prompt = [0, 9, 9, 1, 7, 2, 7, 8, 3, 4, 7, 4, 7, 5, 7, 8, 1, 7, 2]
    msgs = [{"role": "system"}, {"role": "user"}, {"role": "assistant"}, {"role": "tool"}, {"role": "tool"},
            {"role": "assistant"}, {"role": "user"}]
    assert [(s.start, s.end) for s in message_spans(prompt, msgs, roles)] == [
        (1, 3), (3, 5), (5, 8), (8, 11), (11, 14), (14, 16), (16, 18)]
    anchors = prompt_anchors(prompt, roles, min_restore=1, grid=10_000)
    assert [(a.position, a.kind) for a in anchors] == [
        (3, "head"), (5, "message"), (8, "message"), (11, "message"), (14, "message"), (16, "message"),
        (18, "prompt_end")]
    assert reuse_ceiling(message_spans(prompt, msgs, roles), 6, None) == 16
    # No system text before the first opener: no head, and spans start at the opener after BOS.
    assert [a.kind for a in prompt_anchors([0, 1, 7, 2], roles, min_restore=1)] == ["prompt_end"]
    assert message_spans([0, 1, 7, 2], msgs[1:2], roles)[0].start == 1


DS_CALL = {"id": "call_0", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}
DS_TOOLS = [CHAT[0], {"role": "user", "content": "Read a.py and b.py"},
            {"role": "assistant", "content": "Reading both.", "tool_calls": [DS_CALL, DS_CALL]},
            {"role": "tool", "tool_call_id": "call_0", "content": "x = 1"},
            {"role": "tool", "tool_call_id": "call_0", "content": "y = 2"},
            {"role": "assistant", "content": "a.py sets x, b.py sets y."}, {"role": "user", "content": "And c.py?"},
            {"role": "assistant", "content": "Reading it.", "tool_calls": [DS_CALL]},
            {"role": "tool", "tool_call_id": "call_0", "content": "z = 3"}]


def test_probe_reads_deepseeks_role_tokens(deepseek):
    """The real DeepSeek-V3 template has no open/close turns: the probe finds its role tokens, the
    tool-output openers, the closing token the reply after tool results follows, and the bare system
    prompt after BOS."""
    markers = Markers.from_tokenizer(deepseek)
    names = lambda ids: [deepseek.convert_ids_to_tokens(i) for i in ids]
    assert markers.turn_start is None and markers.turn_end is None and markers.roles
    assert names(markers.opens) == ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>"]
    assert [tuple(names(pair)) for pair in markers.joined] == [("<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>")]
    assert names(markers.after) == ["<｜tool▁outputs▁end｜>"]
    assert markers.system_bare and markers.preamble == 1 and not markers.tools_merged


@pytest.mark.parametrize("messages", [CHAT, CHAT[1:]], ids=["system", "no-system"])
def test_deepseek_spans_are_the_templates_own_boundaries(deepseek, messages):
    """Each message's span starts where rendering the messages before it ends, every one of those
    is a message anchor (the system prompt's end a head anchor), and a follow-up turn's ceiling is
    everything the previous request and its reply held."""
    markers = Markers.from_tokenizer(deepseek)
    prompt = render(deepseek, messages)
    spans = message_spans(prompt, messages, markers)
    assert [s.index for s in spans] == list(range(len(messages)))
    anchors = {a.position: a.kind for a in prompt_anchors(prompt, markers, min_restore=1, grid=10_000)}
    for k in range(1, len(messages)):
        before = render(deepseek, messages[:k], add_generation_prompt=False)
        assert prompt[: len(before)] == before
        assert spans[k].start == len(before), k
        assert anchors[len(before)] == ("head" if messages[k - 1]["role"] == "system" else "message")
    assert ("head" in anchors.values()) == (messages[0]["role"] == "system")
    assert reuse_ceiling(spans, len(messages) - 1, None) == spans[-1].start == len(render(
        deepseek, messages[:-1], add_generation_prompt=False))


def test_deepseek_tool_runs_map_each_result_to_its_own_span(deepseek):
    """Tool results (two runs: the template opens only the first with `<｜tool▁outputs▁begin｜>`) and
    the reply after them (no role token: it follows `<｜tool▁outputs▁end｜>`) each get the span holding
    their own text and no other message's, and every span end is an anchor."""
    markers = Markers.from_tokenizer(deepseek)
    prompt = render(deepseek, DS_TOOLS)
    spans = message_spans(prompt, DS_TOOLS, markers)
    assert [s.index for s in spans] == list(range(len(DS_TOOLS)))
    anchors = {a.position for a in prompt_anchors(prompt, markers, min_restore=1, grid=10_000)}
    for span, m in zip(spans, DS_TOOLS):
        text = deepseek.decode(prompt[span.start: span.end])
        assert m["content"] in text and not any(o["content"] in text for o in DS_TOOLS if o is not m), text
        assert span.end in anchors or span.end == len(prompt)
    heads = [deepseek.decode(prompt[s.start: s.start + 1]) for s in spans[1:]]
    assert heads == ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>", "a",
                     "<｜User｜>", "<｜Assistant｜>", "<｜tool▁output▁begin｜>"]
    assert deepseek.decode(prompt[spans[5].start - 1: spans[5].start]) == "<｜tool▁outputs▁end｜>"


def test_deepseek_misses_are_attributed_to_the_message(deepseek):
    """Below the ceiling, the cause names the message where the prompt left the entry: an edited
    user message, the bare system prompt, and a reply whose tool call the model generated but the
    template drops when it renders history."""
    from mtplx.bank.plan import attribute_miss

    markers = Markers.from_tokenizer(deepseek)
    call = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read\n```json\n{}\n```<｜tool▁call▁end｜>"

    def cause(entry_messages, messages, generated=None):
        entry = render(deepseek, entry_messages)
        entry += deepseek.encode(generated or messages[len(entry_messages)]["content"], add_special_tokens=False)
        prompt = render(deepseek, messages)
        spans = message_spans(prompt, messages, markers)
        ceiling = reuse_ceiling(spans, len(entry_messages) + 1, None)
        return attribute_miss(prompt, spans, 0, ceiling, tuple(entry), other_identity=False, evicted_match=0,
                              note=None, think_id=None).cause

    follow = CHAT[:3] + [{"role": "user", "content": "And b.py?"}]
    edited = [CHAT[0], {"role": "user", "content": "Read c.py"}] + follow[2:]
    assert cause(CHAT[:2], edited).startswith("user[1] re-rendered differently")
    assert cause(CHAT[:2], [{"role": "system", "content": "Be brief."}] + follow[1:]) == "system or tools changed"
    with_call = CHAT[:2] + [{"role": "assistant", "content": "Reading.", "tool_calls": [DS_CALL]},
                            {"role": "tool", "tool_call_id": "call_0", "content": "x = 1"}]
    assert cause(CHAT[:2], with_call, "Reading." + call).startswith("assistant[2] re-rendered differently")


@pytest.mark.parametrize("history", [CHAT[:3], DS_TOOLS[:6]], ids=["chat", "after-a-tool-run"])
def test_deepseek_render_ahead_variants_prefix_the_next_prompt(deepseek, history):
    """The variants rendered when a turn ends are exact prefixes of the next real prompt, for a user
    follow-up and a tool follow-up, and reach the follow-up's own span: all the next prompt's
    reusable tokens."""
    from mtplx.bank.render_ahead import variants

    markers = Markers.from_tokenizer(deepseek)
    request, reply = history[:-1], history[-1]
    chat = {"messages": request, "tools": None, "enable_thinking": None}
    rendered = variants(deepseek, chat, reply, markers)
    follow_ups = [{"role": "user", "content": "Now c.py, please."},
                  {"role": "tool", "tool_call_id": "call_0", "content": "w = 4"}]
    # After the first tool run a further result opens with "\n" (the template's flag stays set), so
    # the two follow-ups need two variants there; before it they share one.
    assert len(rendered) == (2 if any(m["role"] == "tool" for m in history) else 1)
    for follow_up in follow_ups:
        messages = request + [reply, follow_up]
        nxt = render(deepseek, messages)
        ceiling = reuse_ceiling(message_spans(nxt, messages, markers), len(request) + 1, None)
        best = max((v for v in rendered if nxt[: len(v)] == v), key=len, default=None)
        assert best is not None and len(best) == ceiling, (follow_up["role"], len(best or ()), ceiling)


def test_a_role_token_template_of_other_tokens_is_read_from_the_template(tokenizers):
    """Nothing of DeepSeek's is assumed: role tokens of another vocabulary (a token for user, one for
    assistant, one for each tool result, the system prompt bare) are found, and the spans they give
    are the template's own boundaries."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizers["injecting"].name_or_path)
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|start_header_id|>"
                         "{{ m['content'] }}{% elif m['role'] == 'assistant' %}<|end_header_id|>{{ m['content'] }}"
                         "<|end_of_text|>{% elif m['role'] == 'tool' %}<|eot_id|>{{ m['content'] }}{% else %}"
                         "{{ m['content'] }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|end_header_id|>{% endif %}")
    markers = Markers.from_tokenizer(tok)
    ids = lambda *names: tuple(tok.convert_tokens_to_ids(n) for n in names)
    assert markers.opens == ids("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>") and markers.system_bare
    messages = CHAT + [{"role": "assistant", "content": "Calling."}, {"role": "tool", "content": "x = 1"},
                       {"role": "tool", "content": "y = 2"}]
    prompt = render(tok, messages)
    spans = message_spans(prompt, messages, markers)
    for k in range(1, len(messages)):
        assert spans[k].start == len(render(tok, messages[:k], add_generation_prompt=False)), k


def test_a_template_with_no_turn_structure_gets_no_anchors(tokenizers):
    """Contents joined with newlines (no template token between messages), or role tokens for user
    and assistant but tool results as bare text (no token says where one ends): the probe declines,
    and the prompt gets no message anchors and no spans rather than wrong ones."""
    from transformers import AutoTokenizer

    from mtplx.bank.markers import probe, probe_roles

    tok = AutoTokenizer.from_pretrained(tokenizers["injecting"].name_or_path)
    for template in ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
                     "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|start_header_id|>"
                     "{{ m['content'] }}{% elif m['role'] == 'assistant' %}<|end_header_id|>{{ m['content'] }}"
                     "<|end_of_text|>{% else %}{{ m['content'] }}{% endif %}{% endfor %}"):
        tok.chat_template = template
        for find in (probe, probe_roles):  # each declines, by None or by refusing the probe
            try:
                assert find(tok) is None
            except StopIteration:
                pass
        markers = Markers.from_tokenizer(tok)  # ChatML's tokens (this tokenizer has them): none in its prompts
        prompt = render(tok, CHAT, add_generation_prompt=False)
        assert message_spans(prompt, CHAT, markers) == []
        assert {a.kind for a in prompt_anchors(prompt, markers, min_restore=1, grid=10_000)} == {"prompt_end"}


def test_sliding_window_restorable_positions_are_a_pure_rule():
    from mtplx.bank.plan import EntryView, plan_restore, restorable_positions, superseded

    assert restorable_positions(50, {}, recurrent=False, window=64) is None  # never rotated: cut anywhere
    assert restorable_positions(64, {}, recurrent=False, window=64) is None
    assert restorable_positions(65, {}, recurrent=False, window=64) == (65,)  # rotated: its end only
    # a checkpoint holds the sliding-window layers' state too (snapshot.checkpoint_arrays)
    assert restorable_positions(100, {40: 0}, recurrent=True, window=64) == (40, 100)
    assert restorable_positions(100, {40: 0, 80: 0}, recurrent=False, window=64) == (40, 80, 100)
    assert restorable_positions(100, {40: 0}, recurrent=True, window=None) == (40, 100)
    assert restorable_positions(100, {}, recurrent=False, window=None) is None
    prompt = list(range(300))
    rotated = EntryView("r", tuple(prompt[:100]) + (999,), "m", restorable_positions(101, {}, recurrent=False, window=64),
                        None)
    plan = plan_restore(prompt, [], [rotated], "m", need_mtp=False, recurrent=False, min_restore=1)
    assert plan.entry_id is None and plan.match == 100  # the match is 100, but no exact state below the end
    whole = EntryView("w", tuple(prompt[:120]), "m", restorable_positions(120, {}, recurrent=False, window=64), None)
    assert plan_restore(prompt, [], [rotated, whole], "m", need_mtp=False, recurrent=False, min_restore=1).position == 120
    short = EntryView("s", tuple(prompt[:60]), "m", restorable_positions(60, {}, recurrent=False, window=64), None)
    assert plan_restore(prompt[:50] + [7] * 20, [], [short], "m", need_mtp=False, recurrent=False,
                        min_restore=1).position == 50
    assert superseded(whole, [short]) == []  # the rotated entry cannot stand in for the short one's cuts


def _rotating_cache(tokens: int, window: int, chunks: list[int]):
    """A RotatingKVCache fed `tokens` random keys in `chunks` (multi-token updates), then one by one."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    cache, fed = RotatingKVCache(max_size=window), 0
    for n in chunks + [1] * (tokens - sum(chunks)):
        k = mx.random.normal((1, 2, n, 8))
        cache.update_and_fetch(k, k * 2)
        fed += n
    return cache


@pytest.mark.parametrize("tokens,chunks", [(40, [16, 16]), (150, [64, 64])])
def test_rotating_snapshot_restores_the_same_window_and_is_independent(tokens, chunks):
    """A snapshot holds the window's tokens in temporal order; the restored cache continues exactly
    as the live one (same keys after the next chunk and the next single token), and writes into the
    live ring buffer never reach the snapshot."""
    import mlx.core as mx
    import numpy as np

    from mtplx.state import snapshot

    mx.random.seed(3)
    live = _rotating_cache(tokens, 32, chunks)
    snap = snapshot.snapshot([live])
    before = np.array(snap[0].arrays[0])
    restored = snapshot.restore(snap)[0]
    assert snapshot.window(snap) == 32 and restored.offset == live.offset == tokens
    for n in (5, 1, 1):
        k = mx.random.normal((1, 2, n, 8))
        a, _ = live.update_and_fetch(k, k)
        b, _ = restored.update_and_fetch(k, k)
        order = lambda c, x: np.array(c._temporal_order(x))
        assert np.array_equal(order(live, live.keys), order(restored, restored.keys))
    assert np.array_equal(np.array(snap[0].arrays[0]), before)
    if tokens <= 32:  # never rotated: an earlier cut is exact
        cut = snapshot.restore(snapshot.truncate_kv(snap, 20))[0]
        assert cut.offset == 20 and np.array_equal(np.array(cut.keys), before[..., :20, :])
    else:
        with pytest.raises(ValueError):
            snapshot.truncate_kv(snap, 20)


USER_TURNS = ["Read src/app.py and tell me what it does, line by line, please.",
              "Now make it print goodbye instead of hello, and keep the rest as it is.",
              "Good. Add a test for it under tests/, using pytest, and run it once."]


@pytest.mark.parametrize("family", ["llama3", "gemma3", "deepseek_v3"])
def test_real_template_turns_restore_their_ceiling_and_equal_cold(tmp_path, family):
    """A multi-turn chat (system, user, the model's own reply, user, ...) on a stand-in with the
    family's real template: every warm turn has a non-zero ceiling from the template's own turn
    markers, restores >= 0.99 of it, and its greedy output equals a cold engine's. The Gemma 3
    stand-in has sliding-window layers (window 64, rotated long before the later turns); the
    DeepSeek-V3 one (MLA attention, MoE, an MTP layer) has the real DeepSeek tokenizer, whose
    template has role tokens and no closing token per turn."""
    from mtplx.bank.bank import BankConfig
    from mtplx.bank.spans import reuse_ratio
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams

    kind = {"llama3": "llama", "gemma3": "gemma3", "deepseek_v3": "deepseek_v3"}[family]
    tokenizer = (deepseek_dir(tmp_path / "tok") if family == "deepseek_v3"
                 else standins.family_tokenizer(family, tmp_path / "tok"))
    path = standins.build(kind, tmp_path / kind, tokenizer)
    banked = Engine(path, EngineConfig(chunk_size=64), name=kind, bank=BankConfig(min_restore=16)).start()
    cold = Engine(path, EngineConfig(chunk_size=64), name=kind).start()
    tok = banked.checkpoint.tokenizer
    messages = [{"role": "system", "content": ("You are a careful coding agent working in a repository. " * 4).strip()}]
    rows = []
    try:
        for text in USER_TURNS:
            messages.append({"role": "user", "content": text})
            params = SamplingParams(max_tokens=12, temperature=0.0)
            request = chat_request(tok, messages, sampling=params, session="s")
            prompt = request.prompt
            warm = banked.submit(request).result()
            banked.settle()  # the user reads the reply: idle time for the render-ahead
            outcome = banked.bank.outcomes[request.request_id]
            reference = cold.submit(GenerationRequest(prompt, params)).result()
            rows.append((len(prompt), outcome.ceiling, warm.cached_tokens, warm.token_ids == reference.token_ids))
            messages.append(warm.reply)
        # Gemma's window layers have rotated in every later entry; the prefill's checkpoints hold
        # their state at anchors too (snapshot.checkpoint_arrays), so those restore there as well.
        rotated = [v for v in banked.call(banked.bank.views) if v.restorable is not None and len(v.tokens) > 64]
        assert bool(rotated) == (family == "gemma3")
        assert family != "gemma3" or any(len(v.restorable) > 1 for v in rotated)
    finally:
        banked.stop()
        cold.stop()
    print(family, rows)
    assert all(same for *_, same in rows), rows
    for prompt_len, ceiling, cached, _ in rows[1:]:
        assert ceiling and ceiling > 64 and reuse_ratio(cached, ceiling) >= 0.99, rows


def test_sliding_window_cut_before_rotation_equals_cold(tmp_path):
    """Gemma 3 stand-in (window 64): an entry shorter than the window is cut back to a shared
    prefix, and the output from there equals a cold engine's; a prompt sharing the prefix of a
    rotated entry is not cut from it."""
    from mtplx.bank.bank import BankConfig
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams

    path = standins.build("gemma3", tmp_path / "g3", standins.family_tokenizer("gemma3", tmp_path / "tok"))
    banked = Engine(path, EngineConfig(chunk_size=16), name="g3", bank=BankConfig(min_restore=8)).start()
    cold = Engine(path, EngineConfig(chunk_size=16), name="g3").start()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base = tuple(range(300, 340))
    try:
        banked.submit(GenerationRequest(base, params)).result()  # 40 + 6 tokens: never rotated
        fork = base[:30] + tuple(range(500, 512))
        warm = banked.submit(GenerationRequest(fork, params)).result()
        assert warm.cached_tokens == 30
        assert warm.token_ids == cold.submit(GenerationRequest(fork, params)).result().token_ids
        long = tuple(range(600, 700))
        banked.submit(GenerationRequest(long, params)).result()  # 106 tokens: rotated
        late = long[:90] + (7, 8, 9)
        warm = banked.submit(GenerationRequest(late, params)).result()
        assert warm.cached_tokens == 0
        assert warm.token_ids == cold.submit(GenerationRequest(late, params)).result().token_ids
    finally:
        banked.stop()
        cold.stop()


def test_sliding_window_entry_survives_the_ssd_tier(tmp_path):
    """A rotated sliding-window entry written to SSD and read back (as after a restart) keeps its
    window, its exact tokens and the rule that only its end is restorable."""
    import mlx.core as mx
    import numpy as np

    from mtplx.bank.anchors import Anchor
    from mtplx.bank.entry import Entry
    from mtplx.bank.ssd import SsdConfig, SsdTier
    from mtplx.state import snapshot

    mx.random.seed(5)
    trunk = snapshot.snapshot([_rotating_cache(100, 32, [64]), _rotating_cache(100, 32, [64, 16])])
    entry = Entry(tuple(range(100)), "g:ar", trunk, {}, None, None, [Anchor(100, "generation_end")], "s")
    tier = SsdTier(SsdConfig(tmp_path, budget_bytes=64 << 20, free_floor_bytes=0))
    tier.write(entry)
    back = tier.load(entry.entry_id, "g:ar")
    assert back.view().restorable == entry.view().restorable == (100,)
    assert [v.restorable for v in tier.views()] == [(100,)]
    for a, b in zip(snapshot.restore(entry.trunk), snapshot.restore(back.trunk)):
        assert (a.offset, a.max_size, a._idx) == (b.offset, b.max_size, b._idx)
        assert np.array_equal(np.array(a.keys), np.array(b.keys))
