"""`tool_choice: none` where the model's format cannot be steered away from a call (gpt-oss's
harmony, Llama 3.x's bare JSON, DeepSeek-V3.2's DSML, the formats whose opening is several tokens):
a call the model writes anyway reaches the client as the text it was, never as a tool call the
request did not allow. (Where one opening token exists, `<tool_call>`, the rule bans it.)"""

from __future__ import annotations

from mtplx.harmony import HarmonyReply
from mtplx.reply_stream import ReplyStream
from mtplx.tool_formats import DSML_FORMAT, LLAMA_JSON, TAGGED

D = "｜DSML｜"
REPLIES = {
    "dsml": (DSML_FORMAT, f'Sure.<{D}function_calls>\n<{D}invoke name="ls">\n</{D}invoke>\n</{D}function_calls>'),
    "llama": (LLAMA_JSON, '{"name": "ls", "parameters": {}}'),
    "tagged": (TAGGED, 'Sure.<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'),
}


def _kinds(pieces):
    return [p.kind for p in pieces]


def test_a_call_is_text_when_the_request_allows_none():
    for name, (fmt, reply) in REPLIES.items():
        allowed = ReplyStream(False, fmt).feed(reply, final=True)
        assert "tool_call" in _kinds(allowed), name  # read as a call where calls are allowed
        pieces = ReplyStream(False, fmt, calls=False).feed(reply, final=True)
        assert set(_kinds(pieces)) == {"content"}, name
        assert "".join(p.text for p in pieces) == reply.strip(), name  # all of it, as written


def test_a_harmony_message_to_a_tool_is_text_when_the_request_allows_none():
    reply = ('<|channel|>analysis<|message|>List them.<|end|><|start|>assistant to=functions.ls'
             '<|channel|>commentary <|constrain|>json<|message|>{"path": "."}<|call|>')
    assert [(p.kind, p.name) for p in HarmonyReply().feed(reply, final=True)] == [("reasoning", None), ("tool_call", "ls")]
    pieces = HarmonyReply(calls=False).feed(reply, final=True)
    assert _kinds(pieces) == ["reasoning", "content"]
    assert pieces[1].text == 'to=ls: {"path": "."}'


def test_the_server_asks_for_no_calls_exactly_when_the_choice_is_none(dense_engine):
    from fastapi.testclient import TestClient

    from mtplx.server.app import create_app

    seen = []
    submit = dense_engine.submit
    dense_engine.submit = lambda request: seen.append(request) or submit(request)
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]
    chat = [{"role": "user", "content": "List the files."}]
    try:
        with TestClient(create_app(dense_engine, "tiny-dense")) as client:
            for choice in ("none", "auto", "required", None):
                body = {"messages": chat, "tools": tools, "max_tokens": 2, **({"tool_choice": choice} if choice else {})}
                assert client.post("/v1/chat/completions", json=body).status_code == 200
            r = client.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": chat,
                                                  "tool_choice": {"type": "none"},
                                                  "tools": [{"name": "ls", "input_schema": {"type": "object"}}]})
            assert r.status_code == 200, r.text
    finally:
        dense_engine.submit = submit
    assert [r.calls for r in seen if r.source == "api"] == [False, True, True, True, False]
