"""Tool-call formats: JSON and Qwen3.5 XML bodies in <tool_call>, the delegated formats, streaming
across chunk boundaries, arguments reaching templates that iterate them, and a Qwen3.5-format call
round-tripping through the server (emitted -> parsed -> sent back -> 200)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtplx.chat import render
from mtplx.reply_stream import ReplyStream, message as reply_message
from mtplx.tool_formats import by_name, template_iterates_arguments

XML_CALL = ("<tool_call>\n<function=edit_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
            "<parameter=line>\n12\n</parameter>\n<parameter=text>\nx = 1\ny = [2]\n</parameter>\n</function>\n</tool_call>")
TOOLS = [{"type": "function", "function": {"name": "edit_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "text": {"type": "string"}}}}}]


def _stream(text, size=3, **kw):
    stream, pieces = ReplyStream(**kw), []
    for i in range(0, len(text), size):
        pieces += stream.feed(text[i:i + size])
    return pieces + stream.feed("", final=True)


def test_xml_call_streamed_in_small_chunks():
    pieces = _stream("<think>\nplan\n</think>\n\n" + XML_CALL, tools=TOOLS)
    assert [p.kind for p in pieces if p.kind != "reasoning"] == ["tool_call"]
    call = pieces[-1]
    assert call.name == "edit_file"
    assert json.loads(call.arguments) == {"path": "src/a.py", "line": 12, "text": "x = 1\ny = [2]"}


def test_xml_values_without_a_schema_stay_text():
    call = _stream(XML_CALL)[-1]
    assert json.loads(call.arguments) == {"path": "src/a.py", "line": "12", "text": "x = 1\ny = [2]"}


def test_json_call_and_broken_call():
    pieces = _stream('<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>')
    assert (pieces[0].name, json.loads(pieces[0].arguments)) == ("read_file", {"path": "a.py"})
    broken = _stream("<tool_call>\n{not json</tool_call> after")
    assert {p.kind for p in broken} == {"content"}
    assert "".join(p.text for p in broken) == "<tool_call>\n{not json</tool_call>after"


def test_delegated_format_without_a_closing_tag():
    """Mistral's [TOOL_CALLS] runs to the end of the output; mlx-lm's own parser reads the body."""
    fmt = by_name("mistral")
    pieces = _stream('Sure.[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "a.py"}}]', tool_format=fmt)
    assert pieces[0].kind == "content" and pieces[-1].kind == "tool_call" and pieces[-1].name == "read_file"


def test_registry_names_every_parser_mlx_lm_recognises():
    import importlib
    import pkgutil

    import mlx_lm.tool_parsers as parsers

    for module in pkgutil.iter_modules(parsers.__path__):
        fmt = by_name(module.name)
        mod = importlib.import_module(f"mlx_lm.tool_parsers.{module.name}")
        assert (fmt.start, fmt.end) == (mod.tool_call_start, mod.tool_call_end), module.name


def test_a_reply_splits_an_xml_call():
    message = reply_message(ReplyStream().feed("<think>\nok\n</think>\n\n" + XML_CALL, final=True))
    assert message["reasoning_content"] == "ok" and message["content"] == ""
    assert message["tool_calls"][0]["function"]["name"] == "edit_file"


def test_arguments_reach_an_items_template_as_a_mapping(tokenizer):
    template = (Path(__file__).parent / "fixtures" / "qwen3_5_style.jinja").read_text()
    assert template_iterates_arguments(template) and not template_iterates_arguments(tokenizer.chat_template)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    import standins

    path = standins.qwen3_5_from_tiny(tmp_path_factory.mktemp("q35") / "model")
    (path / "chat_template.jinja").write_text((Path(__file__).parent / "fixtures" / "qwen3_5_style.jinja").read_text())
    from mtplx.bank.bank import BankConfig
    from mtplx.engine.engine import Engine, EngineConfig

    engine = Engine(path, EngineConfig(chunk_size=64), name="qwen3_5", bank=BankConfig()).start()
    yield engine
    engine.stop()


def test_qwen35_call_round_trips_through_the_server(qwen35):
    """The call as the template writes it (the form the model is trained to emit) is parsed into an
    OpenAI tool call, sent back with its result (arguments as a JSON string, as clients send
    them), accepted with 200, and re-rendered as exactly the text that was emitted."""
    from fastapi.testclient import TestClient

    from mtplx.server.app import create_app

    tok = qwen35.checkpoint.tokenizer
    assert (qwen35.checkpoint.tool_format.name, qwen35.checkpoint.tool_format.body) == ("tool_call", "xml")
    history = [{"role": "system", "content": "You edit files."}, {"role": "user", "content": "Fix line 12 of src/a.py."}]
    pieces = _stream(XML_CALL, tools=TOOLS)
    sent = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": p.name, "arguments": p.arguments}}
        for p in pieces if p.kind == "tool_call"]}
    messages = history + [sent, {"role": "tool", "tool_call_id": "call_0", "content": "ok"}]
    rendered = tok.decode(render(tok, messages, TOOLS))
    assert XML_CALL in rendered
    with TestClient(create_app(qwen35, "qwen3_5")) as client:
        r = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 4})
        assert r.status_code == 200, r.text
        r = client.post("/v1/messages", json={"model": "qwen3_5", "max_tokens": 4, "messages": [
            {"role": "user", "content": "Fix line 12 of src/a.py."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_0", "name": "edit_file",
                                               "input": json.loads(sent["tool_calls"][0]["function"]["arguments"])}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_0", "content": "ok"}]}],
            "tools": [{"name": "edit_file", "input_schema": TOOLS[0]["function"]["parameters"]}]})
        assert r.status_code == 200, r.text


def test_qwen35_call_becomes_openai_tool_calls():
    """What the server returns for a Qwen3.5-format reply: an OpenAI tool call with JSON arguments."""
    from mtplx.events import Finished
    from mtplx.reply_stream import ReplyStream
    from mtplx.server.openai_response import completion

    text = "<think>\nok\n</think>\n\n" + XML_CALL
    fin = Finished("r", "stop", 10, 30, 0, text, (), {}, tuple(ReplyStream().feed(text, final=True)))
    message = completion("m", fin)["choices"][0]["message"]
    call = message["tool_calls"][0]["function"]
    assert call["name"] == "edit_file" and json.loads(call["arguments"])["path"] == "src/a.py"
    assert message["reasoning_content"] == "ok" and not message["content"]


def test_qwen35_tool_turn_restores_its_ceiling(qwen35):
    """The warm turn that sends a Qwen3.5-format call back restores its whole reuse ceiling."""
    from fastapi.testclient import TestClient

    from mtplx.bank.spans import reuse_ratio
    from mtplx.events import Restored
    from mtplx.server.app import create_app

    seen = []
    listener = lambda e: seen.append(e) if isinstance(e, Restored) else None
    qwen35.listeners.append(listener)
    history = [{"role": "system", "content": "You edit files. " * 20}, {"role": "user", "content": "Fix line 12 of src/a.py."}]
    call = {"id": "call_0", "type": "function", "function": {"name": "edit_file", "arguments": json.dumps(
        {"path": "src/a.py", "line": 12, "text": "x = 1"})}}
    try:
        with TestClient(create_app(qwen35, "qwen3_5")) as client:
            for messages in (history, history + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                                 {"role": "tool", "tool_call_id": "call_0", "content": "ok"}]):
                r = client.post("/v1/chat/completions", headers={"x-session-id": "xml"},
                                json={"messages": messages, "tools": TOOLS, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                qwen35.settle()
    finally:
        qwen35.listeners.remove(listener)
    assert reuse_ratio(seen[-1].cached_tokens, seen[-1].ceiling) >= 0.99, seen[-1]


def test_call_head_follows_the_templates_body():
    """What forcing a named tool must pin differs by format: JSON's name key, or Qwen3.5's
    <function=...> line; the detected format knows which its template writes."""
    json_head, xml_head = by_name("json_tools").call_head("read_file"), by_name("qwen3_coder").call_head("read_file")
    assert json_head == '\n{"name": "read_file", "arguments":' and xml_head == "\n<function=read_file>\n"
    call = '<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n</function>\n</tool_call>'
    assert call.startswith("<tool_call>" + xml_head) and by_name("glm47").call_head("x") is None


def test_every_route_maps_a_model_format_call_to_its_tool_call_shape():
    """Replies split with the model's own format (as the engine splits them): a Mistral-style call
    comes back as OpenAI tool_calls (whole and streamed) and an Anthropic tool_use block."""
    from mtplx.events import Finished, Tokens
    from mtplx.reply_stream import ReplyStream
    from mtplx.server import anthropic_map, openai_response
    from mtplx.server.signature import Signer

    text = 'Sure.[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "a.py"}}]'
    streamed = tuple(ReplyStream(False, by_name("mistral")).feed(text))  # a call without a close: held to the end
    fin = Finished("r", "stop", 10, 12, 0, text, (1,), {"tokens_by_segment": {}},
                   tuple(ReplyStream(False, by_name("mistral")).feed(text, final=True)))
    whole = openai_response.completion("m", fin)
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "read_file"
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    stream = openai_response.ChatStream("m")
    chunks = stream.tokens(Tokens("r", (1,), text, "content", streamed)) + stream.finish(fin, False)
    assert [c["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] for c in chunks
            if c["choices"][0]["delta"].get("tool_calls") and "name" in c["choices"][0]["delta"]["tool_calls"][0].get(
                "function", {})] == ["read_file"]
    message = anthropic_map.message("m", fin, Signer(b"k" * 32))
    assert [b["name"] for b in message["content"] if b["type"] == "tool_use"] == ["read_file"]


def test_qwen35_forced_call_is_held_to_the_xml_grammar(qwen35):
    """On a model whose template writes Qwen3.5 XML calls (its weights were trained on JSON calls, so
    free it does not write this format), `tool_choice: required` holds the call to the declared
    function, its parameters (each once, in the schema's order) and, for a typed parameter, a JSON
    value of its type (mtplx/call_grammar.py's XML body); the reply parses into that one call."""
    from fastapi.testclient import TestClient

    from mtplx.server.app import create_app

    goto = [{"type": "function", "function": {"name": "goto_line", "parameters": {
        "type": "object", "properties": {"line": {"type": "integer"}}, "required": ["line"],
        "additionalProperties": False}}}]
    with TestClient(create_app(qwen35, "qwen3_5")) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Go to line 12 of src/a.py."}], "tools": goto,
            "tool_choice": "required", "max_tokens": 200, "temperature": 0, "enable_thinking": False})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls", message
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "goto_line"
    args = json.loads(call["function"]["arguments"])
    assert set(args) == {"line"} and isinstance(args["line"], int)


def test_a_call_delimiter_the_tokenizer_marks_special_stays_in_the_reply_text(tmp_path):
    """Mistral's tokenizers mark `[TOOL_CALLS]` special. Decoded with every special token skipped,
    the delimiter vanished and the call reached the client as text; the reply text keeps the
    format's delimiters and still drops the other special tokens."""
    import standins
    from transformers import AutoTokenizer

    from mtplx.engine.text_stream import TextStream

    data = json.loads((standins.TINY.parent / "tiny-dense" / "tokenizer.json").read_text())
    new_id = max(list(data["model"]["vocab"].values()) + [t["id"] for t in data["added_tokens"]]) + 1
    for i, content in enumerate(("[TOOL_CALLS]", "[ARGS]")):  # both control tokens in Mistral's tokenizers
        data["added_tokens"].append({"id": new_id + i, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((standins.TINY.parent / "tiny-dense" / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    fmt = by_name("mistral")
    for reply in ('Sure.[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "a.py"}}]',
                  'Sure.[TOOL_CALLS]read_file[ARGS]{"path": "a.py"}'):  # the older form, and Devstral's
        ids = tok.encode(reply + "<|im_end|>", add_special_tokens=False)
        assert new_id in ids and "[TOOL_CALLS]" not in tok.decode(ids, skip_special_tokens=True)  # what was lost
        stream = TextStream(tok, call_tags=(fmt.start, fmt.end), markup=fmt.markup)
        text = "".join(stream.add(i) for i in ids)
        assert text == reply  # <|im_end|> still dropped
        pieces = ReplyStream(False, fmt).feed(text, final=True)
        assert [(p.kind, p.name) for p in pieces] == [("content", None), ("tool_call", "read_file")], pieces


def test_harmonys_markup_is_the_formats_own():
    from mtplx.harmony import MARKUP
    from mtplx.tool_formats import HARMONY

    assert HARMONY.markup == MARKUP and by_name("mistral").markup == ("[ARGS]",)
