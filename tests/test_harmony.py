"""gpt-oss replies (harmony): channels split into reasoning, content and tool calls, whole and
streamed, through the real decode path (harmony's markup tokens are special and stay in the text);
stop strings see only the answer; acceptance by segment follows the channels; history sent back
renders as gpt-oss's template reads it (reasoning as `thinking`, arguments as a mapping); and a
gpt-oss stand-in (MLX layout, sliding-window and full layers, harmony template) is served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import standins
from mtplx.harmony import MARKUP, HarmonyReply, HarmonySegments, kind_of, visible_mask
from mtplx.tool_formats import HARMONY, detect, template_iterates_arguments, template_reads_thinking

TEMPLATE = (Path(__file__).parent / "fixtures" / "harmony_style.jinja").read_text()
ANSWER = "<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!"
CALL = ("<|channel|>analysis<|message|>Need the file.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.read_file <|constrain|>json<|message|>{"path":"a.py"}')
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def _pieces(text: str, size: int | None = None):
    reply = HarmonyReply(TOOLS)
    if size is None:
        return reply.feed(text, final=True)
    out = []
    for i in range(0, len(text), size):
        out += reply.feed(text[i:i + size])
    return out + reply.feed("", final=True)


def _merged(pieces):
    out = []
    for p in pieces:
        if out and p.kind == out[-1][0] and p.kind != "tool_call":
            out[-1] = (p.kind, out[-1][1] + p.text)
        else:
            out.append((p.kind, p.text if p.kind != "tool_call" else (p.name, json.loads(p.arguments))))
    return out


@pytest.mark.parametrize("size", [None, 1, 3, 7])
def test_channels_split_whole_and_streamed(size):
    assert _merged(_pieces(ANSWER, size)) == [("reasoning", "The user greets me."), ("content", "Hello there!")]
    assert _merged(_pieces(CALL, size)) == [("reasoning", "Need the file."), ("tool_call", ("read_file", {"path": "a.py"}))]


def test_recipient_in_the_role_preambles_and_text_outside_the_format():
    role_first = '<|channel|>commentary<|message|>Reading it now.<|end|><|start|>assistant to=functions.ls<|channel|>commentary json<|message|>{}'
    assert _merged(_pieces(role_first)) == [("content", "Reading it now."), ("tool_call", ("ls", {}))]
    assert kind_of("assistant to=browser.search<|channel|>commentary") == ("tool_call", "browser.search")
    assert kind_of("<|channel|>final") == ("content", None) and kind_of("<|channel|>analysis") == ("reasoning", None)
    broken = _pieces('<|channel|>commentary to=functions.ls<|message|>{not json')
    assert _merged(broken) == [("content", "to=ls: {not json")]  # shown, never dropped
    assert _merged(_pieces("plain words with no header at all")) == [("content", "plain words with no header at all")]
    assert _merged(_pieces("x" * 300, 5)) == [("content", "x" * 300)]  # not held forever waiting for a header


def test_stop_strings_see_only_the_answer():
    mask = visible_mask(ANSWER, "\0")
    assert len(mask) == len(ANSWER) and mask.replace("\0", "") == "Hello there!"
    assert visible_mask(CALL, "\0").replace("\0", "") == ""


@pytest.fixture(scope="module")
def gptoss_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptoss")
    tok = standins.family_tokenizer("gptoss", root / "tok")
    specials = {t["content"]: t["id"] for t in json.loads((tok / "tokenizer.json").read_text())["added_tokens"]}
    return standins.build("gpt_oss", root / "model", tok, generation_config={
        "eos_token_id": [specials["<|return|>"], specials["<|call|>"]]})


def test_the_decode_path_keeps_harmonys_special_markup(gptoss_dir):
    """Every harmony token is special in gpt-oss's vocabulary: decoded the usual way (special
    tokens skipped) the reply read "analysisThe user greets me.assistantfinalHello there!"."""
    from transformers import AutoTokenizer

    from mtplx.engine.text_stream import TextStream

    tok = AutoTokenizer.from_pretrained(str(gptoss_dir))
    assert detect(tok) == HARMONY
    ids = tok.encode(ANSWER + "<|return|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "analysisThe user greets me.assistantfinalHello there!"
    stream = TextStream(tok, markup=MARKUP)
    text = "".join(stream.add(i) for i in ids)
    assert text == ANSWER  # the markup kept; <|return|> (end of sequence) still left out
    assert _merged(HarmonyReply().feed(text, final=True))[1] == ("content", "Hello there!")
    segments = HarmonySegments(tok)
    ids = tok.encode(CALL, add_special_tokens=False)
    kinds = [segments.segment_of(i) for i in ids]
    opened = ids.index(tok.convert_tokens_to_ids("<|message|>"))  # counts with the message it opens
    body = tok.encode("Need the file.", add_special_tokens=False)
    assert kinds[:opened] == ["content"] * opened and kinds[opened:opened + 1 + len(body)] == ["reasoning"] * (1 + len(body))
    assert kinds[-1] == "tool_call"


def test_gpt_oss_template_reads_reasoning_as_thinking_and_arguments_as_a_mapping(gptoss_dir, tokenizer):
    from transformers import AutoTokenizer

    from mtplx.chat import render

    assert template_iterates_arguments(TEMPLATE) and template_reads_thinking(TEMPLATE)
    assert not template_iterates_arguments(tokenizer.chat_template) and not template_reads_thinking(tokenizer.chat_template)
    tok = AutoTokenizer.from_pretrained(str(gptoss_dir))
    call = {"id": "c0", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read a.py"},
            {"role": "assistant", "content": "", "reasoning_content": "Need the file.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c0", "content": "x = 1"}]
    text = tok.decode(render(tok, chat, TOOLS))
    assert "<|start|>assistant<|channel|>analysis<|message|>Need the file.<|end|>" in text
    assert 'to=functions.read_file<|channel|>commentary json<|message|>{"path": "a.py"}<|call|>' in text  # not a quoted string
    assert text.endswith("<|start|>assistant") and "type read_file" in text


def test_a_gpt_oss_checkpoint_is_served(gptoss_dir):
    """The stand-in loads as a harmony model (no MTP head: autoregressive), serves a tool turn on
    every route, whole and streamed, and a second identical turn is a 200 too."""
    from fastapi.testclient import TestClient

    from mtplx.bank.bank import BankConfig
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.server.app import create_app

    engine = Engine(gptoss_dir, EngineConfig(chunk_size=64), name="gpt-oss", bank=BankConfig()).start()
    try:
        assert engine.checkpoint.tool_format == HARMONY and not engine.has_mtp
        tok = engine.checkpoint.tokenizer
        assert {tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>")} <= engine.eos_ids
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read a.py"}]
        with TestClient(create_app(engine, "gpt-oss")) as client:
            for body in ({"messages": chat, "tools": TOOLS}, {"messages": chat, "tools": TOOLS, "stream": True},
                         {"messages": chat, "tools": TOOLS, "tool_choice": "required", "stop": ["x"]}):
                r = client.post("/v1/chat/completions", json={**body, "max_tokens": 12, "temperature": 0})
                assert r.status_code == 200, r.text
            r = client.post("/v1/messages", json={"model": "gpt-oss", "max_tokens": 12, "messages": [chat[1]]})
            assert r.status_code == 200, r.text
            r = client.post("/v1/responses", json={"model": "gpt-oss", "max_output_tokens": 12, "input": "hi",
                                                   "reasoning": {"effort": "low"}})
            assert r.status_code == 200, r.text
    finally:
        engine.stop()


def test_reasoning_effort_reaches_a_template_that_takes_it(gptoss_dir):
    """gpt-oss's `Reasoning:` line follows the request's effort on every route (chat's
    `reasoning_effort`, Responses' `reasoning.effort`, Anthropic's `output_config.effort`);
    "none" / "minimal" are its lowest level, Codex's "xhigh" its highest; without one, medium."""
    from fastapi.testclient import TestClient

    from mtplx.bank.bank import BankConfig
    from mtplx.chat import render
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.events import Queued
    from mtplx.server.app import create_app

    engine = Engine(gptoss_dir, EngineConfig(chunk_size=64), name="gpt-oss", bank=BankConfig()).start()
    tok = engine.checkpoint.tokenizer
    chat = [{"role": "user", "content": "hi"}]
    assert "Reasoning: high" in tok.decode(render(tok, chat, template_kwargs={"reasoning_effort": "high"}))
    assert "Reasoning: medium" in tok.decode(render(tok, chat))
    queued: list = []
    engine.listeners.append(lambda e: queued.append(e.request) if isinstance(e, Queued) else None)
    try:
        with TestClient(create_app(engine, "gpt-oss")) as client:
            for effort, level in (("low", "low"), ("minimal", "low"), ("xhigh", "high"), ("medium", "medium")):
                tokens = client.post("/tokenize", json={"messages": chat, "reasoning_effort": effort}).json()["tokens"]
                assert f"Reasoning: {level}\n" in tok.decode(tokens), effort
            for route, body in (("/v1/responses", {"input": "hi", "reasoning": {"effort": "low"}, "max_output_tokens": 4}),
                                ("/v1/messages", {"messages": chat, "max_tokens": 4, "output_config": {"effort": "low"}}),
                                ("/v1/chat/completions", {"messages": chat, "max_tokens": 4, "reasoning_effort": "low"})):
                r = client.post(route, json={"model": "gpt-oss", **body})
                assert r.status_code == 200, r.text
                assert "Reasoning: low\n" in tok.decode(list(queued[-1].prompt)), route
                # render-ahead renders the next turn with the same variables
                assert queued[-1].chat["template_kwargs"] == {"reasoning_effort": "low"}
            bad = client.post("/v1/messages", json={"model": "gpt-oss", "messages": chat, "max_tokens": 4,
                                                    "output_config": {"effort": 3}})
            assert bad.status_code == 400 and "output_config.effort" in bad.text
            # chat_template_kwargs reach the template whole (vLLM's extension), and name the level themselves
            tokens = client.post("/tokenize", json={"messages": chat, "reasoning_effort": "low",
                                                    "chat_template_kwargs": {"reasoning_effort": "high"}}).json()["tokens"]
            assert "Reasoning: high\n" in tok.decode(tokens)
            bad = client.post("/v1/chat/completions", json={"messages": chat, "chat_template_kwargs": {"tokenize": False}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs.tokenize"
    finally:
        engine.stop()


def test_a_forced_call_on_gpt_oss_is_held_to_harmony(gptoss_dir):
    """tool_choice required or named holds a gpt-oss reply to a grammar of harmony messages: an
    optional analysis, then a commentary message to the tool with JSON arguments that follow its
    schema. (A random-weight stand-in would reason forever, so a bias keeps it off the analysis
    channel; the grammar allows one.)"""
    from fastapi.testclient import TestClient

    from mtplx.bank.bank import BankConfig
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.server.app import create_app

    tools = TOOLS + [{"type": "function", "function": {"name": "ls", "parameters": {
        "type": "object", "properties": {"dir": {"type": "string", "enum": ["src", "tests"]}}, "required": ["dir"],
        "additionalProperties": False}}}]
    tools[0] = {"type": "function", "function": {**TOOLS[0]["function"], "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "enum": ["a.py", "b.py"]}}, "required": ["path"],
        "additionalProperties": False}}}
    engine = Engine(gptoss_dir, EngineConfig(chunk_size=64), name="gpt-oss", bank=BankConfig()).start()
    tok = engine.checkpoint.tokenizer
    bias = {str(tok.encode("analysis", add_special_tokens=False)[0]): -100}
    chat = [{"role": "user", "content": "Read a.py"}]
    try:
        with TestClient(create_app(engine, "gpt-oss")) as client:
            for choice, names in (({"type": "function", "function": {"name": "ls"}}, {"ls"}),
                                  ("required", {"read_file", "ls"})):
                r = client.post("/v1/chat/completions", json={
                    "messages": chat, "tools": tools, "tool_choice": choice, "max_tokens": 64, "temperature": 0,
                    "logit_bias": bias})
                assert r.status_code == 200, r.text
                message = r.json()["choices"][0]["message"]
                (call,) = message["tool_calls"]
                assert call["function"]["name"] in names, message
                args = json.loads(call["function"]["arguments"])
                assert args in ({"dir": "src"}, {"dir": "tests"}, {"path": "a.py"}, {"path": "b.py"}), args
            free = client.post("/v1/chat/completions", json={"messages": chat, "tools": tools, "max_tokens": 8,
                                                             "temperature": 0, "logit_bias": bias})
            assert free.status_code == 200 and "tool_calls" not in free.json()["choices"][0]["message"]
    finally:
        engine.stop()


def test_a_forced_call_with_an_output_schema_and_logprobs_is_served(gptoss_dir):
    """Found by a probe that mutates every field of valid requests: on gpt-oss a forced call and a
    JSON output schema were both applied to the whole reply, no token satisfied both, and the
    answer was a 500 (a log-probability of -inf is not JSON). The forced call is the reply, as
    "required" is elsewhere; and a template's error on /tokenize without a generation prompt is
    the request's 400."""
    from fastapi.testclient import TestClient

    from mtplx.bank.bank import BankConfig
    from mtplx.engine.engine import Engine, EngineConfig
    from mtplx.server.app import create_app

    engine = Engine(gptoss_dir, EngineConfig(chunk_size=64), name="gpt-oss", bank=BankConfig()).start()
    tool = {"type": "function", "name": "get", "strict": True, "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "enum": ["x", "y"]}}, "required": ["q"],
        "additionalProperties": False}}
    try:
        with TestClient(create_app(engine, "gpt-oss")) as client:
            r = client.post("/v1/responses", json={
                "model": "m", "input": "hi", "tools": [tool], "tool_choice": {"type": "function", "name": "get"},
                "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                "include": ["message.output_text.logprobs"], "top_logprobs": 2, "max_output_tokens": 48,
                "temperature": 0, "reasoning": {"effort": "low"}})
            assert r.status_code == 200, r.text
            r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False,
                                               "tools": [{"type": "function", "function": {"name": "f", "description": 5}}]})
            assert r.status_code == 400 and "chat template" in r.json()["error"]["message"], r.text
    finally:
        engine.stop()


def test_a_position_with_no_finite_log_probability_reads_as_openais_floor():
    import mlx.core as mx

    from mtplx.engine.logprobs import of

    entry = of(mx.full((8,), -mx.inf), 3, 2, type("T", (), {"decode": lambda self, ids: "x"})())
    assert entry.logprob == -9999.0 and entry.top == ()
