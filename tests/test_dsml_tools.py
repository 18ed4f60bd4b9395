"""DeepSeek-V3.2: calls in DSML (`<｜DSML｜function_calls>` blocks of invokes and typed
parameters), which mlx-lm has no parser for, and a chat template that is mlx-lm's Python encoder
(the tokenizer config's `chat_template_type`), not Jinja. Before: the V3 call tokens still in the
vocabulary made mtplx read V3.1's format, so no V3.2 call ever parsed; rendering passed the encoder
variables it does not take (`return_dict`, a request's `reasoning_effort`), a TypeError on every
chat request; the server answered 400 "no chat template"; tools reached the model only when the
request had a system message (the encoder writes them after one); and the bank found no turn
structure (the encoder refused its probes), so no turn had a reuse ceiling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import standins
from mtplx import chat_template, tool_formats
from mtplx.reply_stream import ReplyStream
from mtplx.tool_formats import DSML_FORMAT
from test_llama_tools import fed  # whole or a few characters at a time

D = "｜DSML｜"
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "array"}, "n": {"type": "integer"}},
    "required": ["path"]}}}]
REPLY = (f'Let me look.\n\n<{D}function_calls>\n<{D}invoke name="read_file">\n'
         f'<{D}parameter name="path" string="true">src/"odd" name.py</{D}parameter>\n'
         f'<{D}parameter name="lines" string="false">[1, 2]</{D}parameter>\n'
         f'<{D}parameter name="n" string="false">not json</{D}parameter>\n</{D}invoke>\n'
         f'<{D}invoke name="ls">\n</{D}invoke>\n</{D}function_calls>')


def _pieces(text: str, size: int | None = None):
    return fed(ReplyStream(False, DSML_FORMAT, TOOLS), text, size)


@pytest.mark.parametrize("size", [None, 1, 5])
def test_v3_2_calls_are_read_with_typed_parameters_whole_and_streamed(size):
    pieces = _pieces(REPLY, size)
    assert "".join(p.text for p in pieces if p.kind == "content") == "Let me look."
    calls = [(p.name, json.loads(p.arguments)) for p in pieces if p.kind == "tool_call"]
    # string="true": the text as written; otherwise JSON, or the text when it is not JSON
    assert calls == [("read_file", {"path": 'src/"odd" name.py', "lines": [1, 2], "n": "not json"}), ("ls", {})]
    broken = f"<{D}function_calls>\nnothing\n</{D}function_calls>"
    assert "".join(p.text for p in _pieces(broken) if p.kind == "content") == broken  # shown, never lost


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    root = tmp_path_factory.mktemp("v32")
    return standins.build("deepseek_v32", root / "model", standins.family_tokenizer("deepseek_v32", root / "tok"))


def test_the_v3_2_encoder_renders_tools_history_and_a_requests_variables(v32):
    from mtplx.chat import render
    from mtplx.engine.checkpoint import load_checkpoint

    tok = load_checkpoint(v32).tokenizer
    assert chat_template.renderer_name(tok) == "deepseek_v32" and chat_template.present(tok)
    assert tok.convert_tokens_to_ids("<｜tool▁calls▁begin｜>") is not None  # V3's call tokens are still there
    assert tool_formats.format_of(tok) is DSML_FORMAT
    chat = [{"role": "user", "content": "Read a.py"}]
    # no system message: the encoder writes tools after one, so an empty one goes first
    text = tok.decode(render(tok, chat, TOOLS, enable_thinking=False,
                             template_kwargs={"reasoning_effort": "high", "unknown_variable": 1}))
    assert '"name": "read_file"' in text and text.endswith("<｜User｜>Read a.py<｜Assistant｜></think>")
    # a call sent back renders as DSML, and reading that block gives the same arguments back
    args = {"path": "a.py", "lines": [3, 4], "n": 2}
    history = chat + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x = 1"}]
    text = tok.decode(render(tok, history, TOOLS, enable_thinking=False))
    block = text[text.rindex(f"<{D}function_calls>"): text.rindex(f"</{D}function_calls>") + len(f"</{D}function_calls>")]
    assert [(p.name, json.loads(p.arguments)) for p in _pieces(block) if p.kind == "tool_call"] == [("read_file", args)]
    assert "<result>x = 1</result>" in text


def test_a_v3_2_checkpoint_serves_chat_with_tools(v32):
    """Chat and Messages requests with tools (no system message, a reasoning effort, a forced
    call, which DSML's multi-token opening leaves unsteered) are served; the follow-up with the
    call and its result renders and restores the conversation's start; `mtplx models` names DSML."""
    from fastapi.testclient import TestClient

    from mtplx.bank.bank import BankConfig
    from mtplx.catalog import describe
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.server.app import create_app

    assert describe(v32)["template"]["calls"] == "dsml"
    from mtplx.events import Restored

    engine = Engine(v32, EngineConfig(chunk_size=64, depth=2), name="v32", bank=BankConfig()).start()
    seen = []
    engine.listeners.append(lambda e: seen.append(e) if isinstance(e, Restored) else None)
    chat = [{"role": "user", "content": "Read a.py and tell me what it does. " * 4}]
    try:
        assert engine.checkpoint.tool_format is DSML_FORMAT and engine.has_mtp
        with TestClient(create_app(engine, "v32")) as client:
            for extra in ({}, {"reasoning_effort": "high"}, {"tool_choice": "required"}):
                r = client.post("/v1/chat/completions", json={"messages": chat, "tools": TOOLS, "max_tokens": 8,
                                                              "temperature": 0, **extra})
                assert r.status_code == 200, r.text
            r = client.post("/v1/messages", json={"model": "v32", "max_tokens": 8, "messages": chat, "tools": [
                {"name": "read_file", "description": "Read a file.", "input_schema": TOOLS[0]["function"]["parameters"]}]})
            assert r.status_code == 200, r.text
            history = chat + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "read_file", "arguments": json.dumps({"path": "a.py"})}}]}, {"role": "tool", "tool_call_id": "c1", "content": "x = 1"}]
            r = client.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
            # the bank reads the encoder's turn structure (its probes rendered with reasoning off:
            # in reasoning mode it refuses a probe's reply): the turn's reuse ceiling is known
            assert seen[-1].ceiling and seen[-1].ceiling > 100, seen[-1]
    finally:
        engine.stop()


@pytest.mark.parametrize("client", ["claude", "codex", "opencode", "pi", "qwen"])
def test_real_clients_requests_render_through_the_v3_2_encoder(v32, client):
    """Every request recorded from a real agent CLI (tests/fixtures/clients/: their system
    prompts, tools, thinking settings, tool results, streamed or not) renders through mlx-lm's
    V3.2 encoder and is served (output capped: the stand-in's weights are random and would write
    until max_tokens)."""
    from fastapi.testclient import TestClient

    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.server.app import create_app

    fixtures = sorted((Path(__file__).parent / "fixtures" / "clients" / client).glob("*.json"))
    engine = Engine(v32, EngineConfig(chunk_size=512, context_window=65536, use_mtp=False), name="v32").start()
    try:
        with TestClient(create_app(engine, "v32")) as http:
            for path in fixtures:
                recorded = json.loads(path.read_text())
                cap = {"max_output_tokens": 4} if recorded["path"].endswith("responses") else {"max_tokens": 4}
                body = {**recorded["body"], **cap}
                body.pop("previous_response_id", None)  # a recorded id this server never gave
                body.pop("max_completion_tokens", None)
                r = http.post(recorded["path"], json=body, headers=recorded["headers"])
                assert r.status_code == 200, (path.name, r.text[:400])
                assert '"error":{' not in r.text.replace(" ", "") and "response.failed" not in r.text, (path.name, r.text[-400:])
    finally:
        engine.stop()
