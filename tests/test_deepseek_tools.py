"""DeepSeek's tool calls (V3 and V3.1), which mlx-lm has no parser for: read from a reply (whole
and streamed), recognised from the real V3 tokenizer's template and from a V3.1-layout one, held
to a grammar when forced, described in the system prompt because DeepSeek's templates drop
`tools`, and served end to end on a DeepSeek-V3 stand-in (MTP head included): a forced call comes
back as an OpenAI tool call and an Anthropic tool_use, and the follow-up restores the history
through the call."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import standins
from mtplx.reply_stream import ReplyStream
from mtplx.tool_formats import DEEPSEEK, DS_CALL, DS_CALL_END, DS_CALLS, DS_CALLS_END, DS_SEP, deepseek_format

PLAIN = (f"Let me look.{DS_CALLS}{DS_CALL}read_file{DS_SEP}" + '{"path":"a.py"}' + f"{DS_CALL_END}"
         f"{DS_CALL}ls{DS_SEP}{{}}{DS_CALL_END}{DS_CALLS_END}")
FENCED = (f"{DS_CALLS}{DS_CALL}function{DS_SEP}read_file\n```json\n" + '{"path": "a.py"}' +
          f"\n```{DS_CALL_END}{DS_CALLS_END}")
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "enum": ["a.py", "src/b.py"]}}, "required": ["path"]}}},
         {"type": "function", "function": {"name": "ls", "description": "List files.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _streamed(text: str, fmt, size: int = 3):
    stream, pieces = ReplyStream(False, fmt), []
    for i in range(0, len(text), size):
        pieces += stream.feed(text[i:i + size])
    return pieces + stream.feed("", final=True)


def test_v3_1_calls_are_read_whole_and_streamed_with_the_models_own_argument_text():
    for pieces in (ReplyStream(False, DEEPSEEK).feed(PLAIN, final=True), _streamed(PLAIN, DEEPSEEK)):
        assert "".join(p.text for p in pieces if p.kind == "content") == "Let me look."
        calls = [(p.name, p.arguments) for p in pieces if p.kind == "tool_call"]
        # kept verbatim: DeepSeek's templates write a sent-back arguments string as it is
        assert calls == [("read_file", '{"path":"a.py"}'), ("ls", "{}")]


def test_v3_fenced_calls_and_broken_ones():
    fenced = replace(DEEPSEEK, body="fenced")
    assert [(p.name, json.loads(p.arguments)) for p in _streamed(FENCED, fenced) if p.kind == "tool_call"] == \
        [("read_file", {"path": "a.py"})]
    for broken in (f"{DS_CALLS}{DS_CALL}read_file{DS_SEP}{{not json{DS_CALL_END}{DS_CALLS_END}",
                   f"{DS_CALLS}{DS_CALL}read_file{DS_SEP}[1, 2]{DS_CALL_END}{DS_CALLS_END}",
                   f"{DS_CALLS}nothing here{DS_CALLS_END}"):
        pieces = ReplyStream(False, DEEPSEEK).feed(broken, final=True)
        assert {p.kind for p in pieces} == {"content"} and "".join(p.text for p in pieces) == broken  # shown, not lost


def test_the_format_is_recognised_from_real_and_v3_1_layout_templates(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    from test_bank_templates import deepseek_dir

    real_v3 = AutoTokenizer.from_pretrained(str(deepseek_dir(tmp_path / "v3")))
    assert deepseek_format(real_v3) == replace(DEEPSEEK, body="fenced")
    v31 = AutoTokenizer.from_pretrained(str(standins.family_tokenizer("deepseek_v3_1", tmp_path / "v31")))
    assert deepseek_format(v31) == DEEPSEEK
    assert deepseek_format(tokenizer) is None  # the embedded models write <tool_call>
    assert DEEPSEEK.call_head("ls") == f"{DS_CALL}ls{DS_SEP}"


def test_tools_go_in_the_system_prompt_when_the_template_drops_them(tmp_path, tokenizer):
    """DeepSeek's templates render no `tools`: mtplx describes them after the system prompt, in
    the syntax the replies are parsed with; each message boundary still prefixes the prompt. A
    template that renders tools (the embedded models') is left alone."""
    from transformers import AutoTokenizer

    from mtplx.chat import message_boundaries, render

    tok = AutoTokenizer.from_pretrained(str(standins.family_tokenizer("deepseek_v3_1", tmp_path / "v31")))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read a.py"}]
    bare, described = tok.decode(render(tok, chat)), tok.decode(render(tok, chat, TOOLS))
    assert "read_file" not in bare and bare.endswith("<｜User｜>Read a.py<｜Assistant｜></think>")
    assert described.startswith("<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n")
    assert "### read_file\nDescription: Read a file." in described and '"enum": ["a.py", "src/b.py"]' in described
    assert f"{DS_CALLS}{DS_CALL}tool_call_name{DS_SEP}tool_call_arguments{DS_CALL_END}" in described
    no_system = tok.decode(render(tok, chat[1:], TOOLS))
    assert no_system.startswith("<｜begin▁of▁sentence｜>## Tools\n")
    call = {"id": "c0", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    history = chat + [{"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c0", "content": "x = 1"}, {"role": "user", "content": "Thanks."}]
    prompt = render(tok, history, TOOLS)
    boundaries = message_boundaries(tok, history, TOOLS, prompt)
    assert boundaries and all(b.valid for b in boundaries), boundaries
    qwen = [{"role": "user", "content": "hi"}]
    assert render(tokenizer, qwen, TOOLS) == list(tokenizer.apply_chat_template(
        qwen, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_forced_call_grammars_compile_for_both_bodies(tmp_path):
    from transformers import AutoTokenizer

    from mtplx.server.tool_choice import ToolChoice, ToolRules

    tok = AutoTokenizer.from_pretrained(str(standins.family_tokenizer("deepseek_v3_1", tmp_path / "v31")))
    eos = {tok.convert_tokens_to_ids("<｜end▁of▁sentence｜>")}
    for fmt in (DEEPSEEK, replace(DEEPSEEK, body="fenced")):
        rules = ToolRules(tok, eos, fmt)
        assert rules.open == tok.convert_tokens_to_ids(DS_CALLS) and len(rules.marks) == 3
        for parallel in (True, False):
            grammar = rules._compiled(TOOLS, ("read_file", "ls"), None, parallel)
            assert grammar is not None, (fmt.body, parallel)
        rule = rules.rule(ToolChoice("required", name="read_file"), False)
        assert tok.decode(list(rule.head)) == fmt.call_head("read_file")


@pytest.fixture(scope="module")
def deepseek_engine(tmp_path_factory):
    from mtplx.bank.bank import BankConfig
    from mtplx.engine.engine import Engine, EngineConfig

    root = tmp_path_factory.mktemp("deepseek")
    path = standins.build("deepseek_v3", root / "model", standins.family_tokenizer("deepseek_v3_1", root / "tok"))
    engine = Engine(path, EngineConfig(chunk_size=64, depth=2), name="deepseek", bank=BankConfig()).start()
    yield engine
    engine.stop()


def test_a_deepseek_checkpoint_serves_tool_calls_end_to_end(deepseek_engine):
    """A forced call on a DeepSeek-V3 stand-in (V3.1 template, MTP head) is an OpenAI tool call,
    whole and streamed, and an Anthropic tool_use; sent back with its result, the follow-up
    restores everything before the result (render-ahead had the history ready)."""
    from fastapi.testclient import TestClient

    from mtplx.events import Restored
    from mtplx.server.app import create_app

    engine = deepseek_engine
    assert engine.checkpoint.tool_format == DEEPSEEK and engine.has_mtp
    seen: list[Restored] = []
    listener = lambda e: seen.append(e) if isinstance(e, Restored) else None
    engine.listeners.append(listener)
    chat = [{"role": "system", "content": "You are a coding agent in a repository. " * 6},
            {"role": "user", "content": "Read a.py"}]
    forced = {"type": "function", "function": {"name": "read_file"}}
    try:
        with TestClient(create_app(engine, "deepseek")) as client:
            r = client.post("/v1/chat/completions", json={"messages": chat, "tools": TOOLS, "tool_choice": forced,
                                                          "max_tokens": 32, "temperature": 0})
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            call = message["tool_calls"][0]
            assert call["function"]["name"] == "read_file" and json.loads(call["function"]["arguments"])["path"] in ("a.py", "src/b.py")
            assert DS_CALLS not in (message["content"] or "")  # the markup is not shown as text

            with client.stream("POST", "/v1/chat/completions", json={"messages": chat, "tools": TOOLS, "stream": True,
                                                                    "tool_choice": "required", "max_tokens": 32,
                                                                    "temperature": 0}) as s:
                deltas = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            streamed = [d["choices"][0]["delta"]["tool_calls"][0] for d in deltas if d["choices"][0]["delta"].get("tool_calls")]
            assert streamed and streamed[0]["function"]["name"] in ("read_file", "ls")

            anthropic = client.post("/v1/messages", json={
                "model": "deepseek", "max_tokens": 32, "temperature": 0, "system": chat[0]["content"],
                "messages": [chat[1]], "tool_choice": {"type": "tool", "name": "read_file"},
                "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                           "input_schema": t["function"]["parameters"]} for t in TOOLS]})
            assert anthropic.status_code == 200, anthropic.text
            use = next(b for b in anthropic.json()["content"] if b["type"] == "tool_use")
            assert use["name"] == "read_file" and use["input"]["path"] in ("a.py", "src/b.py")

            engine.settle()  # the agent runs its tool: idle time the bank uses
            history = chat + [message, {"role": "tool", "tool_call_id": call["id"], "content": "x = 1\n"}]
            r = client.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 4,
                                                          "temperature": 0})
            assert r.status_code == 200, r.text
    finally:
        engine.listeners.remove(listener)
    from mtplx.chat import render

    tok = engine.checkpoint.tokenizer
    prompt = render(tok, history, TOOLS)
    result_at = prompt.index(tok.convert_tokens_to_ids("<｜tool▁output▁begin｜>"))
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= result_at, (seen[-1], result_at)


def test_stops_and_segments_know_deepseeks_call_tokens(tmp_path):
    """A stop string cannot match inside a DeepSeek call (it is not visible content), and the
    call's tokens count as the tool-call segment (acceptance by segment in receipts and the TUI)."""
    from transformers import AutoTokenizer

    from mtplx.engine.segments import SegmentTracker
    from mtplx.engine.text_stream import HIDDEN, visible_mask

    tags = (DS_CALLS, DS_CALLS_END)
    visible = visible_mask(PLAIN + " done", False, tags)
    assert visible.replace(HIDDEN, "") == "Let me look.done" and len(visible) == len(PLAIN + " done")
    assert visible_mask(PLAIN, False).replace(HIDDEN, "") != "Let me look."  # the default tags do not know them
    tok = AutoTokenizer.from_pretrained(str(standins.family_tokenizer("deepseek_v3_1", tmp_path / "v31")))
    ids = tok.encode(PLAIN + " done", add_special_tokens=False)
    tracker = SegmentTracker(tok, call_tags=tags)
    kinds = [tracker.segment_of(i) for i in ids]
    opened, closed = ids.index(tok.convert_tokens_to_ids(DS_CALLS)), ids.index(tok.convert_tokens_to_ids(DS_CALLS_END))
    assert set(kinds[:opened]) == {"content"} and set(kinds[opened:closed + 1]) == {"tool_call"}
    assert set(kinds[closed + 1:]) == {"content"}


def test_models_names_the_call_format_and_who_describes_the_tools(deepseek_engine):
    """`mtplx models` says how a checkpoint writes calls and, for a template that drops `tools`,
    that mtplx describes them (read from the template's text: no tokenizer, no MLX)."""
    from typer.testing import CliRunner

    from mtplx.catalog import describe
    from mtplx.cli import app

    path = deepseek_engine.checkpoint.path
    template = describe(path)["template"]
    assert template["calls"] == "deepseek" and not template["tools"]  # its comments mention `tools`; its code does not
    out = CliRunner().invoke(app, ["models", str(path)]).output
    assert "calls: deepseek (tools described by mtplx)" in out
    embedded = describe(Path(__file__).resolve().parents[1] / "mtplx" / "assets" / "models" / "tiny-dense")["template"]
    assert embedded["calls"] == "<tool_call>" and embedded["tools"]


def test_thinking_reaches_deepseeks_own_switch(tmp_path):
    """DeepSeek V3.1's template turns reasoning on with a plain `thinking` variable, not
    `enable_thinking`: a request's thinking switch reaches it (the generation prompt opens
    `<think>`), and `chat_template_kwargs.thinking` names it directly."""
    from transformers import AutoTokenizer

    from mtplx.chat import render
    from mtplx.tool_formats import template_reads_thinking_switch

    tok = AutoTokenizer.from_pretrained(str(standins.family_tokenizer("deepseek_v3_1", tmp_path / "v31")))
    chat = [{"role": "user", "content": "hi"}]
    assert template_reads_thinking_switch(tok.chat_template)
    assert tok.decode(render(tok, chat)).endswith("<｜Assistant｜></think>")
    assert tok.decode(render(tok, chat, enable_thinking=True)).endswith("<｜Assistant｜><think>")
    assert tok.decode(render(tok, chat, enable_thinking=True, template_kwargs={"thinking": False})).endswith("</think>")
    assert tok.decode(render(tok, chat, template_kwargs={"thinking": True})).endswith("<think>")
    qwen = (Path(__file__).resolve().parents[1] / "mtplx" / "assets" / "models" / "tiny-dense" / "tokenizer_config.json")
    assert not template_reads_thinking_switch(json.loads(qwen.read_text())["chat_template"])
