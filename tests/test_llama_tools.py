"""Llama 3.1 / 3.2 / 3.3 tool calls: the reply *is* the call, bare JSON
(`{"name": ..., "parameters": {...}}`, several separated by ";", or after `<|python_tag|>`).
mlx-lm has no parser for it, so these replies reached agents as text. A reply that opens with "{"
is held until it ends and read as calls when it parses as them, else shown as the text it was;
the form is recognised from the template; a forced call holds the whole reply to a grammar; a call
sent back renders as the model wrote it (its arguments reach the template's `tojson` as a
mapping), so the next turn restores through it. On a Llama stand-in with a Llama 3.1-layout
template (tests/fixtures/llama3_1_style.jinja)."""

from __future__ import annotations

import json

import pytest

import standins
from mtplx.reply_stream import ReplyStream
from mtplx.tool_formats import LLAMA_JSON, llama_format

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "enum": ["a.py", "b.py"]}}, "required": ["path"],
    "additionalProperties": False}}}]


def fed(stream, text: str, size: int | None = None):
    """The pieces of `text` fed to `stream` whole (size None) or `size` characters at a time."""
    if size is None:
        return stream.feed(text, final=True)
    out = []
    for i in range(0, len(text), size):
        out += stream.feed(text[i:i + size])
    return out + stream.feed("", final=True)


def _pieces(text: str, size: int | None = None):
    return fed(ReplyStream(False, LLAMA_JSON, TOOLS), text, size)


@pytest.mark.parametrize("size", [None, 1, 4])
def test_a_reply_that_is_json_is_read_as_calls(size):
    one = _pieces('{"name": "read_file", "parameters": {"path": "a.py"}}', size)
    assert [(p.kind, p.name, json.loads(p.arguments)) for p in one] == [("tool_call", "read_file", {"path": "a.py"})]
    two = _pieces('\n{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', size)
    assert [(p.name, json.loads(p.arguments)) for p in two] == [("a", {}), ("b", {"x": 1})]
    tagged = _pieces('<|python_tag|>{"name": "read_file", "parameters": {"path": "b.py"}}', size)
    assert [p.name for p in tagged if p.kind == "tool_call"] == ["read_file"]


@pytest.mark.parametrize("text", ['{"answer": 42}', '{"name": "x", "parameters": 3}', '{not json',
                                  'Sure: {"name": "read_file", "parameters": {}}', "  plain words"])
def test_other_replies_stay_text(text):
    pieces = _pieces(text, 3)
    assert {p.kind for p in pieces} == {"content"} and "".join(p.text for p in pieces) == text  # never lost


def test_the_form_is_recognised_from_the_template(tmp_path):
    from transformers import AutoTokenizer

    v31 = AutoTokenizer.from_pretrained(str(standins.family_tokenizer("llama3_1", tmp_path / "v31")))
    v30 = AutoTokenizer.from_pretrained(str(standins.family_tokenizer("llama3", tmp_path / "v30")))
    assert llama_format(v31) == LLAMA_JSON and llama_format(v30) is None  # Llama 3.0 had no tool calls


@pytest.fixture(scope="module")
def llama_engine(tmp_path_factory):
    from mtplx.bank.bank import BankConfig
    from mtplx.engine.engine import Engine, EngineConfig

    root = tmp_path_factory.mktemp("llama31")
    tok = standins.family_tokenizer("llama3_1", root / "tok")
    specials = {t["content"]: t["id"] for t in json.loads((tok / "tokenizer.json").read_text())["added_tokens"]}
    path = standins.build("llama", root / "model", tok, generation_config={
        "eos_token_id": [specials["<|end_of_text|>"], specials["<|eom_id|>"], specials["<|eot_id|>"]]})
    engine = Engine(path, EngineConfig(chunk_size=64), name="llama", bank=BankConfig()).start()
    yield engine
    engine.stop()


def test_a_llama_checkpoint_serves_tool_calls_end_to_end(llama_engine):
    """Forced (named, then required) the reply is a call the client gets as a tool call, whole and
    streamed; sent back with its result, it renders as the model wrote it and the next turn
    restores everything before the result."""
    from fastapi.testclient import TestClient

    from mtplx.chat import render
    from mtplx.server.app import create_app

    engine = llama_engine
    assert engine.checkpoint.tool_format == LLAMA_JSON
    tok = engine.checkpoint.tokenizer
    chat = [{"role": "system", "content": "You are a coding agent in a repository. " * 6},
            {"role": "user", "content": "Read a.py"}]
    with TestClient(create_app(engine, "llama")) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": chat, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "read_file"}},
            "max_tokens": 48, "temperature": 0})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "read_file" and json.loads(call["function"]["arguments"])["path"] in ("a.py", "b.py")
        assert not message["content"] and r.json()["choices"][0]["finish_reason"] == "tool_calls"
        with client.stream("POST", "/v1/chat/completions", json={"messages": chat, "tools": TOOLS, "stream": True,
                                                                "tool_choice": "required", "max_tokens": 48,
                                                                "temperature": 0}) as s:
            deltas = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert any(d["choices"][0]["delta"].get("tool_calls") for d in deltas if d["choices"])
        engine.settle()
        history = chat + [message, {"role": "tool", "tool_call_id": call["id"], "content": "x = 1\n"}]
        prompt = render(tok, history, TOOLS)
        assert '"parameters": {"path": "' in tok.decode(prompt)  # a mapping under tojson, not a quoted string
        r = client.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 4,
                                                      "temperature": 0})
        assert r.status_code == 200, r.text
    result_at = tok.decode(prompt).index("<|start_header_id|>ipython")
    before_result = len(tok.encode(tok.decode(prompt)[:result_at], add_special_tokens=False))
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= before_result - 1, r.json()["usage"]
