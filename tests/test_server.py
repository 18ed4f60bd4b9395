"""The in-process server, driven by the real OpenAI and Anthropic SDKs and by raw bad input."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from mtplx.bank.bank import BankConfig
from mtplx.catalog import resolve
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.server.app import create_app

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]
SYSTEM = "You are a careful coding agent working inside a software repository."


@pytest.fixture(scope="module")
def server():
    import uvicorn

    engine = Engine(resolve("tiny-dense"), EngineConfig(chunk_size=64), name="tiny-dense", bank=BankConfig()).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    srv = uvicorn.Server(uvicorn.Config(create_app(engine, "tiny-dense"), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(10)
    engine.stop()


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, _strict_response_validation=True)


def ask(text="Explain what src/ledger/events.py does"):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-dense"]
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"
    assert httpx.head(server[0] + "/health").status_code == 200  # supervisors probe with HEAD
    # OpenAI's retrieve-model route: the served model's card; another name is a JSON 404
    assert client.models.retrieve("tiny-dense").id == "tiny-dense"
    missing = httpx.get(server[0] + "/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    import anthropic  # Anthropic's SDK lists and retrieves models from the same routes, strictly validated

    claude = anthropic.Anthropic(base_url=server[0], api_key="x", max_retries=0, _strict_response_validation=True)
    assert [m.id for m in claude.models.list().data] == ["tiny-dense"]
    assert claude.models.retrieve("tiny-dense").display_name == "tiny-dense"


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
])
def test_null_optional_fields_mean_their_defaults(server, route, body):
    """Clients that serialise every field of their request model send unset ones as null."""
    nulls = {"stream": None, "temperature": None, "top_p": None}
    limit = {"/v1/responses": "max_output_tokens"}.get(route, "max_tokens")
    r = httpx.post(server[0] + route, json=body | nulls | {limit: 4}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")  # null stream: not streamed


def test_chat_non_stream_with_usage(client):
    r = client.chat.completions.create(model="tiny-dense", messages=ask(), tools=TOOLS, max_tokens=60, temperature=0)
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0 and u.completion_tokens_details.reasoning_tokens >= 0
    msg = r.choices[0].message
    assert msg.content or msg.tool_calls
    assert "<think>" not in (msg.content or "")


def test_stream_matches_non_stream_and_usage_only_when_asked(client):
    kw = dict(model="tiny-dense", messages=ask(), tools=TOOLS, max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert all(c.usage is None for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert content == (whole.choices[0].message.content or "")
    assert reasoning == (getattr(whole.choices[0].message, "reasoning_content", None) or "")
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert all(isinstance(tc.index, int) for tc in calls)
    if calls:
        assert calls[0].id and calls[0].type == "function" and calls[0].function.name
        json.loads("".join(tc.function.arguments or "" for tc in calls))
    with_usage = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in with_usage[:-1])


def test_tool_call_round_trip(client):
    messages = ask("The test for parse in tests/test_parser.py is failing. Please find the cause and fix it.")
    r = client.chat.completions.create(model="tiny-dense", messages=messages, tools=TOOLS, max_tokens=120, temperature=0)
    msg = r.choices[0].message
    follow = messages + [msg.model_dump(exclude_none=True)]
    if msg.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        follow.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "def parse():\n    return None"})
    else:
        follow.append({"role": "user", "content": "Go on."})
    again = client.chat.completions.create(model="tiny-dense", messages=follow, tools=TOOLS, max_tokens=30, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the bank restored the previous turn


def test_cached_tokens_equal_bank_restores(server, client):
    url, engine = server
    messages = ask("Where is parse used in the parser package?")
    seen = []
    engine.listeners.append(lambda e: seen.append(e) if type(e).__name__ == "Restored" else None)
    for _ in range(3):
        r = client.chat.completions.create(model="tiny-dense", messages=messages, max_tokens=40, temperature=0,
                                           extra_headers={"x-session-id": "s-cached"})
        assert r.usage.prompt_tokens_details.cached_tokens == seen[-1].cached_tokens
        messages = messages + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    assert seen[-1].cached_tokens > 0


def test_anthropic_sdk(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server[0], api_key="x", max_retries=0)
    tools = [{"name": "read_file", "description": "Read a file.",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    msg = client.messages.create(model="tiny-dense", max_tokens=60, system=SYSTEM, tools=tools,
                                 messages=[{"role": "user", "content": "Explain what src/app/cli.py does"}], extra_body={"temperature": 0})
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use") and msg.usage.output_tokens > 0
    with client.messages.stream(model="tiny-dense", max_tokens=60, system=SYSTEM, tools=tools, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Explain what src/app/cli.py does"}]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [b.type for b in final.content] == [b.type for b in msg.content]
    count = client.messages.count_tokens(model="tiny-dense", system=SYSTEM,
                                         messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens > 0


BAD = [b"{not json", b"[]", b'"x"', b"42", b"null", b'{"messages": "hi"}', b'{"messages": []}',
       b'{"messages": [{"role": "wizard", "content": "x"}]}', b'{"messages": [{"role": "user", "content": 5}]}',
       b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
       b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}',
       b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000000000000}',
       b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}',
       b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
       b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}',
       b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
       b'{"messages": [{"role": "user", "content": "x"}], "n": 17}',
       b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
       b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}',
       b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": 5}}',
       b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
       b'"json_schema": {"name": "t", "schema": {"type": "objectx"}}}}',
       b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 500}}',
       b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"five": 1}}',
       b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 1}}',
       b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": [5]}',
       b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": '
       b'{"name": "f", "parameters": "none"}}]}',
       b'{"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}',
       b'{"messages": [{"role": "user", "content": "x"}], "web_search_options": {}}',
       b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": "x"}',
       b'{"messages": [{"role": ["user"], "content": "x"}]}',  # unhashable where a name belongs
       b'{"messages": [{"role": {"a": 1}, "content": "x"}]}',
       b'{"messages": [{"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}]}',
       b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,  # past the parser's recursion limit
       b'{"messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 200 + b"]" * 200 + b"}"]


@pytest.mark.parametrize("body", BAD)
def test_bad_input_gets_clean_400(server, body):
    r = httpx.post(server[0] + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text and "/work" not in r.text and ".py" not in r.text


def test_more_bad_input_and_routes(server, client):
    url = server[0]
    assert httpx.post(url + "/v1/completions", json={"prompt": ""}).status_code == 400
    assert httpx.post(url + "/v1/completions", json={}).status_code == 400
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (20 << 20) + b'"}]}'
    assert httpx.post(url + "/v1/chat/completions", content=big).status_code == 413
    r = httpx.get(url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(url + "/v1/chat/completions").status_code == 405
    too_long = [{"role": "user", "content": "word " * 9000}]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": too_long, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert httpx.post(url + "/v1/messages", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 400
    schema = httpx.post(url + "/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
                                                    "tools": [{"name": "f", "input_schema": "x"}]})
    assert schema.status_code == 400 and "input_schema" in schema.json()["error"]["message"]
    for tool, status in (({"type": "web_search_20250305", "name": "web_search", "max_uses": 3}, 400),
                         ({"type": "bash_20250124", "name": "bash"}, 200)):  # a client tool: the client runs it
        r = httpx.post(url + "/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
                                                   "tools": [tool]})
        assert r.status_code == status, r.text
    mcp = httpx.post(url + "/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
                                                 "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]})
    assert mcp.status_code == 400 and "mcp_servers" in mcp.json()["error"]["message"]
    for bad in ({"tools": [{"type": "function", "name": "f", "parameters": [1]}]}, {"max_output_tokens": 0}):
        r = httpx.post(url + "/v1/responses", json={"input": "x", **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] in ("tools[0].parameters", "max_output_tokens"), r.text
    # and the next normal request works
    assert client.chat.completions.create(model="tiny-dense", messages=ask(), max_tokens=5).usage.completion_tokens == 5


def test_an_unexpected_error_is_a_json_500_and_the_connection_stays_usable(server, monkeypatch):
    import mtplx.server.app as app_module

    def broken(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "parse_chat", broken)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    with httpx.Client(base_url=server[0]) as c:
        first = c.post("/v1/chat/completions", json=body)
        assert first.status_code == 500 and first.json()["error"]["type"] == "server_error"
        assert "a bug" not in first.text  # details stay in the server's log
        port = first.extensions["network_stream"].get_extra_info("socket").getsockname()[1]
        monkeypatch.undo()
        # the kept-alive connection serves the next request (uvicorn dropped it after a 500 before)
        second = c.post("/v1/chat/completions", json=body)
        assert second.status_code == 200, second.text
        assert second.extensions["network_stream"].get_extra_info("socket").getsockname()[1] == port
    # a bad part in Responses input is a 400 too, not a crash
    r = httpx.post(server[0] + "/v1/responses", json={"input": [{"role": "user", "content": [{"type": ["x"], "text": "x"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0]", r.text


def test_reasoning_effort_none_turns_thinking_off_on_chat_as_on_responses(server):
    url = server[0] + "/v1/chat/completions"
    base = {"messages": ask(), "max_tokens": 12, "temperature": 0}
    off = httpx.post(url, json={**base, "enable_thinking": False}).json()
    for effort in ("none", "minimal"):
        r = httpx.post(url, json={**base, "reasoning_effort": effort}).json()
        assert r["choices"][0]["message"] == off["choices"][0]["message"]
        assert r["usage"]["prompt_tokens"] == off["usage"]["prompt_tokens"]
    default = httpx.post(url, json=base).json()
    assert httpx.post(url, json={**base, "reasoning_effort": "xhigh"}).json()["usage"] == default["usage"]
    assert default["usage"]["prompt_tokens"] != off["usage"]["prompt_tokens"]  # the switch reached the template
    bad = [(url, {**base, "reasoning_effort": 5}, "reasoning_effort"),
           (server[0] + "/v1/responses", {"input": "x", "reasoning": "high"}, "reasoning"),
           (server[0] + "/v1/responses", {"input": "x", "reasoning": {"effort": ["low"]}}, "reasoning.effort")]
    for route, body, param in bad:
        r = httpx.post(route, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_anthropic_message_threads_hold_the_conversation_for_a_continue(server):
    """The Anthropic SDK's tool runner threads by default (`thread: create`, then `continue` with
    only the tool result): the continue reached the model as a lone tool result, without history
    or tools (a 400 with tool_choice any). Now a continue renders the whole conversation, as the
    unthreaded request with everything would."""
    from anthropic import Anthropic

    url = server[0] + "/v1/messages"
    tools = [{"name": "read_file", "description": "Read a file.", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
    first = [{"role": "user", "content": "Explain what src/ledger/events.py does"}]
    base = {"model": "m", "max_tokens": 40, "temperature": 0, "system": SYSTEM, "tools": tools,
            "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"}}
    for stream in (False, True):
        body = {**base, "messages": first, "thread": {"type": "create"}, "stream": stream}
        if stream:
            with httpx.stream("POST", url, json=body, timeout=120) as r:
                frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
            reply_id = frames[0]["message"]["id"]
            use = next(f["content_block"] for f in frames if f["type"] == "content_block_start"
                       and f["content_block"]["type"] == "tool_use")
            use["input"] = json.loads("".join(f["delta"]["partial_json"] for f in frames
                                              if f["type"] == "content_block_delta" and f["delta"]["type"] == "input_json_delta"))
            content = [use]
        else:
            reply = httpx.post(url, json=body, timeout=120).json()
            reply_id, content = reply["id"], reply["content"]
            use = next(b for b in content if b["type"] == "tool_use")
        result = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "def emit(): ..."}]}]
        cont = httpx.post(url, json={**{k: v for k, v in base.items() if k not in ("system", "tools")}, "messages": result,
                                     "thread": {"type": "continue", "previous_message_id": reply_id},
                                     "tool_choice": {"type": "auto"}}, timeout=120)
        assert cont.status_code == 200, cont.text
        whole = httpx.post(url + "/count_tokens", json={**base, "messages": first + [{"role": "assistant", "content": content}] + result})
        got = cont.json()["usage"]
        assert got["input_tokens"] + got["cache_read_input_tokens"] == whole.json()["input_tokens"]
        assert got["cache_read_input_tokens"] > 0  # the bank restored the thread's history
        # and the continue of a continue goes on from there
        again = httpx.post(url, json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Thanks."}],
                                      "thread": {"type": "continue", "previous_message_id": cont.json()["id"]}}, timeout=120)
        assert again.status_code == 200 and again.json()["usage"]["cache_read_input_tokens"] > got["cache_read_input_tokens"]
    lost = httpx.post(url, json={"model": "m", "max_tokens": 4, "messages": result,
                                 "thread": {"type": "continue", "previous_message_id": "msg_gone"}})
    assert lost.status_code == 400 and lost.json()["error"]["details"]["error_code"] == "thread_not_found", lost.text
    for bad in ({"type": "resume"}, {"type": "continue"}, "create"):
        r = httpx.post(url, json={"model": "m", "max_tokens": 4, "messages": first, "thread": bad})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    repeated = httpx.post(url, json={**base, "messages": result, "thread": {"type": "continue", "previous_message_id": reply_id}})
    assert repeated.status_code == 400 and "from the thread" in repeated.json()["error"]["message"]

    # the SDK's own tool runner, threaded as it is by default (in SDKs that have message threads)
    if not getattr(Anthropic, "_supports_message_threads", False):
        return
    from anthropic import beta_tool

    sent = []

    @beta_tool
    def read_file(path: str) -> str:
        """Read a file."""
        sent.append(path)
        return "def emit(): ..."

    client = Anthropic(base_url=server[0], api_key="x", max_retries=0)
    runner = client.beta.messages.tool_runner(model="m", max_tokens=60, system=SYSTEM, tools=[read_file], thinking={"type": "disabled"},
                                              messages=first, tool_choice={"type": "any"}, max_iterations=2)
    replies = list(runner)
    assert len(replies) == 2 and len(sent) >= 1 and all(m.content for m in replies)
    assert replies[1].usage.cache_read_input_tokens > 0


def test_a_prewarm_computes_the_prompt_and_generates_nothing(server):
    """Responses' `prompt_cache_options.prewarm` and legacy completions' `max_tokens: 0`: the
    prompt goes into the bank, nothing is generated, and the same request sent next restores it."""
    url = server[0]
    body = {"model": "m", "instructions": SYSTEM, "input": "Describe the ledger's event schema, field by field.",
            "max_output_tokens": 16, "temperature": 0}
    warm = httpx.post(url + "/v1/responses", json={**body, "prompt_cache_options": {"prewarm": True, "ttl": "12h"}}).json()
    assert warm["status"] == "completed" and warm["output"] == [] and warm["usage"]["output_tokens"] == 0, warm
    assert warm["prompt_cache_options"] == {"mode": "implicit", "ttl": "12h", "comparison_response_id": None}
    real = httpx.post(url + "/v1/responses", json=body).json()
    assert real["usage"]["input_tokens_details"]["cached_tokens"] >= warm["usage"]["input_tokens"] - 1
    assert real["usage"]["output_tokens"] > 0
    bad = httpx.post(url + "/v1/responses", json={**body, "prompt_cache_options": {"prewarm": "yes"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_options.prewarm"
    bad = httpx.post(url + "/v1/responses", json={**body, "prompt_cache_options": {"comparison_response_id": ["r"]}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_options.comparison_response_id"

    prompt = "def ledger_total(events):\n    return sum(e.amount for e in events)\n"
    scored = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    choice = scored["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length" and scored["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == scored["usage"]["prompt_tokens"]
    one = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1,
                                                    "temperature": 0}).json()
    assert one["choices"][0]["logprobs"]["token_logprobs"][:-1] == lp["token_logprobs"]  # the same scores
    plain = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 0}).json()
    assert plain["choices"][0]["text"] == "" and plain["usage"]["completion_tokens"] == 0
    for bad in (-1, False):
        assert httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": bad}).status_code == 400
    assert httpx.post(url + "/v1/chat/completions", json={"messages": ask(), "max_tokens": 0}).status_code == 400


def test_cache_diagnostics_say_whether_the_previous_prompt_was_reused_and_what_changed(server):
    """Anthropic's `diagnostics.previous_message_id` and Responses' `comparison_response_id`: the
    bank's own restore decides hit or miss; a miss names the first thing that changed."""
    url = server[0] + "/v1/messages"
    read = {"name": "read_file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
    base = {"model": "m", "max_tokens": 4, "system": SYSTEM + " Diagnose.", "tools": [read],
            "messages": [{"role": "user", "content": "Which module owns the event schema?"},
                         {"role": "assistant", "content": "The ledger."}, {"role": "user", "content": "Show it."}]}

    def ask_with(previous, stream=False, **change):
        body = {**base, **change, "diagnostics": {"previous_message_id": previous}}
        if not stream:
            r = httpx.post(url, json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
            return json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])["message"]

    first = ask_with(None)
    assert "diagnostics" in first and first["diagnostics"] is None  # opted in, nothing to compare
    again = ask_with(first["id"])
    assert again["diagnostics"] is None and again["usage"]["cache_read_input_tokens"] > 0  # a hit
    system = ask_with(again["id"], system=SYSTEM + " Changed.")["diagnostics"]["cache_miss_reason"]
    assert system["type"] == "system_changed" and system["cache_missed_input_tokens"] > 0
    tools = ask_with(again["id"], tools=[{**read, "description": "Read one file."}])["diagnostics"]["cache_miss_reason"]
    assert tools["type"] == "tools_changed"
    edited = [{"role": "user", "content": "Which package owns the event schema?"}] + base["messages"][1:]
    assert ask_with(again["id"], messages=edited)["diagnostics"]["cache_miss_reason"]["type"] == "messages_changed"
    assert ask_with("msg_unknown")["diagnostics"]["cache_miss_reason"] == {"type": "previous_message_not_found"}
    started = ask_with(again["id"], stream=True)  # streamed: message_start carries it
    assert "diagnostics" in started and started["diagnostics"] is None
    assert "diagnostics" not in httpx.post(url, json=base, timeout=120).json()  # not asked: not answered
    assert httpx.post(url, json={**base, "diagnostics": {"previous_message_id": 5}}).status_code == 400

    rurl = server[0] + "/v1/responses"
    counted = httpx.post(rurl + "/input_tokens", json={"model": "m", "instructions": SYSTEM, "input": "Which module?"}).json()
    answered = httpx.post(rurl, json={"model": "m", "instructions": SYSTEM, "input": "Which module?", "max_output_tokens": 1}).json()
    assert counted == {"object": "response.input_tokens", "input_tokens": answered["usage"]["input_tokens"]}
    rbase = {"model": "m", "instructions": SYSTEM, "input": "Which module owns the event schema?", "max_output_tokens": 4,
             "tools": [{"type": "function", "name": "read_file", "parameters": read["input_schema"]}]}
    r1 = httpx.post(rurl, json={**rbase, "prompt_cache_options": {}}, timeout=120).json()  # opted in: remembered
    assert "prompt_cache_diagnostics" not in r1
    unasked = httpx.post(rurl, json=rbase, timeout=120).json()  # not opted in: not remembered
    later = httpx.post(rurl, json={**rbase, "prompt_cache_options": {"comparison_response_id": unasked["id"]}}, timeout=120)
    assert later.json()["prompt_cache_diagnostics"] == {"type": "comparison_response_not_found"}
    r2 = httpx.post(rurl, json={**rbase, "prompt_cache_options": {"comparison_response_id": r1["id"]}}, timeout=120).json()
    assert r2["prompt_cache_diagnostics"] == {"type": "cache_hit"}
    assert r2["prompt_cache_options"]["comparison_response_id"] == r1["id"]
    r3 = httpx.post(rurl, json={**rbase, "tools": [], "prompt_cache_options": {"comparison_response_id": r1["id"]}},
                    timeout=120).json()["prompt_cache_diagnostics"]
    assert r3["type"] == "cache_miss" and r3["reason"] == "tools_changed"
    assert r3["comparison_reusable_tokens"] == r1["usage"]["input_tokens"] and r3["cache_missed_tokens"] > 0
    with httpx.stream("POST", rurl, json={**rbase, "stream": True, "prompt_cache_options": {"comparison_response_id": "resp_x"}},
                      timeout=120) as r:
        done = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")][-1]
    assert done["type"] == "response.completed"
    assert done["response"]["prompt_cache_diagnostics"] == {"type": "comparison_response_not_found"}


def test_a_compaction_request_summarises_the_conversation_into_one_block_that_can_be_sent_back(server):
    """Anthropic's `compaction: {"type": "summarize"}` (the SDK tool runner's
    compact_before_next_turn): one signed `compaction` block, stop reason "compaction"; the
    conversation's prefix is restored from the bank; sent back, the block stands for what it
    summarised (a null one is nothing)."""
    url = server[0] + "/v1/messages"
    convo = [{"role": "user", "content": "We are renaming the ledger's `amount` field to `value`."},
             {"role": "assistant", "content": "Understood: I will update events.py and its tests."},
             {"role": "user", "content": "Done with events.py; tests next."}]
    base = {"model": "m", "max_tokens": 48, "temperature": 0, "system": SYSTEM, "messages": convo}
    first = httpx.post(url, json={**base, "max_tokens": 4}).json()
    whole = httpx.post(url, json={**base, "compaction": {"type": "summarize"}}, timeout=120).json()
    assert whole["stop_reason"] == "compaction" and [b["type"] for b in whole["content"]] == ["compaction"], whole
    made = whole["content"][0]
    assert isinstance(made["content"], str) and made["content"] and made["signature"]
    assert whole["usage"]["cache_read_input_tokens"] >= first["usage"]["input_tokens"] - 8  # the conversation restored
    with httpx.stream("POST", url, json={**base, "stream": True, "compaction": {"type": "summarize", "instructions": "Summarise in one line."}},
                      timeout=120) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [f["type"] for f in frames]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert frames[-2]["delta"]["stop_reason"] == "compaction"
    deltas = [f["delta"] for f in frames if f["type"] == "content_block_delta"]
    assert [d["type"] for d in deltas] == ["compaction_delta"] and deltas[0]["content"]

    go_on = {"role": "user", "content": "Go on with the tests."}
    counted = {}
    for name, block in (("summary", made), ("failed", {"type": "compaction", "content": None}), ("none", None)):
        messages = ([{"role": "assistant", "content": [block]}] if block else []) + [go_on]
        r = httpx.post(url + "/count_tokens", json={"model": "m", "system": SYSTEM, "messages": messages})
        assert r.status_code == 200, r.text
        counted[name] = r.json()["input_tokens"]
    assert counted["summary"] > counted["failed"] == counted["none"]
    after = httpx.post(url, json={**base, "max_tokens": 4, "messages": [{"role": "assistant", "content": [made]}, go_on]})
    assert after.status_code == 200
    for bad in ({"type": "truncate"}, {"type": "summarize", "instructions": 5}, "summarize"):
        r = httpx.post(url, json={**base, "compaction": bad})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_context_management_edits_clear_old_tool_results_and_say_how_much(server):
    """`clear_tool_uses_20250919` past its trigger: the older tool results are cleared before the
    prompt is rendered, and the reply (and a stream's message_delta) reports what went."""
    url = server[0] + "/v1/messages"
    messages = [{"role": "user", "content": "Find where totals are computed."}]
    for i in range(4):
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "read_file",
                                                        "input": {"path": f"src/m{i}.py"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                                   "content": f"def total_{i}(events):\n    return 0\n" * 20}]}]
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2}, "keep": {"type": "tool_uses", "value": 1}}
    base = {"model": "m", "max_tokens": 4, "system": SYSTEM, "messages": messages,
            "tools": [{"name": "read_file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]}
    plain = httpx.post(url + "/count_tokens", json=base).json()
    counted = httpx.post(url + "/count_tokens", json={**base, "context_management": {"edits": [edit]}}).json()
    assert counted["context_management"]["original_input_tokens"] == plain["input_tokens"] > counted["input_tokens"]
    reply = httpx.post(url, json={**base, "context_management": {"edits": [edit]}}, timeout=120).json()
    applied = reply["context_management"]["applied_edits"]
    assert applied == [{"type": "clear_tool_uses_20250919", "cleared_tool_uses": 3,
                        "cleared_input_tokens": plain["input_tokens"] - counted["input_tokens"]}]
    assert reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"] == counted["input_tokens"]
    # a thread keeps the conversation as sent: a continue without the edit renders every result
    made = httpx.post(url, json={**base, "context_management": {"edits": [edit]}, "thread": {"type": "create"}}, timeout=120).json()
    thanks = {"role": "user", "content": "Thanks."}
    cont = httpx.post(url, json={"model": "m", "max_tokens": 4, "messages": [thanks],
                                 "thread": {"type": "continue", "previous_message_id": made["id"]}}, timeout=120).json()
    full = httpx.post(url + "/count_tokens", json={**base, "messages": messages + [
        {"role": "assistant", "content": made["content"]}, thanks]}).json()["input_tokens"]
    assert cont["usage"]["input_tokens"] + cont["usage"]["cache_read_input_tokens"] == full
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}  # Claude Code's: nothing applied
    with httpx.stream("POST", url, json={**base, "stream": True, "context_management": keep_all}, timeout=120) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    delta = next(f for f in frames if f["type"] == "message_delta")
    assert delta["context_management"] == {"applied_edits": []}
    assert "context_management" not in httpx.post(url, json=base, timeout=120).json()
    bad = httpx.post(url, json={**base, "context_management": {"edits": [{"type": "forget_everything"}]}})
    assert bad.status_code == 400 and "context_management" in bad.json()["error"]["message"]


def test_dropped_stream_cancels_generation(server):
    url, engine = server
    finished = []
    engine.listeners.append(lambda e: finished.append(e) if type(e).__name__ == "Finished" else None)
    with httpx.stream("POST", url + "/v1/chat/completions",
                      json={"messages": ask(), "max_tokens": 2000, "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():  # leave at the first text, reasoning or not (the model decides which)
            if line.startswith("data: {"):
                delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content"):
                    break
    deadline = time.time() + 20
    while not finished and time.time() < deadline:
        time.sleep(0.05)
    assert finished and finished[-1].finish_reason == "cancelled" and finished[-1].completion_tokens < 2000
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ask(), "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_metrics_and_events_stream(server, client):
    client.chat.completions.create(model="tiny-dense", messages=ask(), max_tokens=5)
    text = httpx.get(server[0] + "/metrics").text
    assert "mtplx_ttft_seconds_bucket" in text and "mtplx_cache_restored_tokens_total" in text
    rounds = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("mtplx_decode_rounds_total")}
    assert rounds['mtplx_decode_rounds_total{batched="false"}'] > 0  # the turn's rounds, alone
    assert "mtplx_waited_on_others_seconds_total" in text and "mtplx_queued_seconds_total" in text
    # labels are declared routes: a scanner's paths (one with a quote in it) do not each add a series
    for path in ("/wp-admin/x", '/a"b', "/v1/models/tiny-dense", "/v1/models/other"):
        httpx.get(server[0] + path)
    text = httpx.get(server[0] + "/metrics").text
    routes = {line.split('route="', 1)[1].split('"', 1)[0] for line in text.splitlines() if "mtplx_requests_total{" in line}
    assert {"/v1/chat/completions", "/v1/models/{model_id:path}", "unmatched"} <= routes
    assert not any(r.startswith(("/wp-admin", "/a")) or r == "/v1/models/tiny-dense" for r in routes)


def test_the_event_stream_carries_every_event_of_a_turn_in_order(server):
    """GET /v1/mtplx/events (what `mtplx tui --attach` follows) sends the events in batches: a
    streamed turn's events all arrive, in order, and its Tokens make up its Finished reply."""
    import threading

    from mtplx.events import event_from_dict

    seen, connected, done = [], threading.Event(), threading.Event()

    def watch():
        with httpx.stream("GET", server[0] + "/v1/mtplx/events", timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith(": connected"):
                    connected.set()
                elif line.startswith("data: "):
                    event = event_from_dict(json.loads(line[6:]))
                    seen.append(event)
                    if type(event).__name__ == "Finished" and event.completion_tokens == 24:
                        done.set()
                        return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert connected.wait(30)
    with httpx.stream("POST", server[0] + "/v1/chat/completions",
                      json={"messages": ask("List the files"), "max_tokens": 24, "ignore_eos": True, "stream": True}) as r:
        for _ in r.iter_lines():
            pass
    assert done.wait(30)
    rid = seen[-1].request_id
    mine = [type(e).__name__ for e in seen if getattr(e, "request_id", None) == rid]
    assert mine[-1] == "Finished" and mine.index("FirstToken") < mine.index("Tokens")
    tokens = [t for e in seen if getattr(e, "request_id", None) == rid and type(e).__name__ == "Tokens" for t in e.token_ids]
    assert tuple(tokens) == seen[-1].token_ids


def test_sdk_errors_are_clean(server, client):
    import anthropic
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-dense", messages=ask(), temperature=-1)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-dense", messages=ask(), n=17)
    claude = anthropic.Anthropic(base_url=server[0], api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="tiny-dense", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"thinking": {"type": "sometimes"}})
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"


def test_completions_stream_and_parameter_rules(server):
    url = server[0] + "/v1/completions"
    body = {"model": "tiny-dense", "prompt": "import os\nimport sys\n\n\ndef main():", "max_tokens": 24, "temperature": 0}
    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    chunks, usage = [], None
    with httpx.stream("POST", url, json=dict(body, stream=True, stream_options={"include_usage": True}), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                chunks += [c["text"] for c in data["choices"]]
                usage = data.get("usage") or usage
    assert "".join(chunks) == whole and usage["completion_tokens"] == 24
    chat = server[0] + "/v1/chat/completions"
    ask_body = {"model": "tiny-dense", "messages": ask(), "max_tokens": 4}
    assert httpx.post(chat, json=dict(ask_body, stream_options={"include_usage": True})).status_code == 400
    assert httpx.post(chat, json=dict(ask_body, seed=-1)).status_code == 200  # int64 seeds are valid
    bad = httpx.post(chat, json=dict(ask_body, seed=2**70))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"


def test_completions_take_token_ids_and_echo(server):
    """`prompt` as token ids (or a one-item list) is the same prompt as its text; `echo` puts the
    prompt before the completion, whole and streamed; what cannot be honoured is a 400 (a batch of
    prompts: test_text_completions_take_a_batch_of_prompts)."""
    url, engine = server[0] + "/v1/completions", server[1]
    text = "import os\nimport sys\n\n\ndef main():"
    ids = engine.checkpoint.tokenizer.encode(text)
    body = {"model": "tiny-dense", "max_tokens": 12, "temperature": 0}
    answers = [httpx.post(url, json={**body, "prompt": p}, timeout=60).json() for p in (text, ids, [ids], [text])]
    assert len({a["choices"][0]["text"] for a in answers}) == 1
    assert {a["usage"]["prompt_tokens"] for a in answers} == {len(ids)}
    completion = answers[0]["choices"][0]["text"]
    for prompt in (text, ids):
        echoed = httpx.post(url, json={**body, "prompt": prompt, "echo": True}, timeout=60).json()
        assert echoed["choices"][0]["text"] == text + completion
    with httpx.stream("POST", url, json={**body, "prompt": text, "echo": True, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[0] == text and "".join(chunks) == text + completion
    for extra, param in [({"prompt": [1, 10**7]}, "prompt"),
                         ({"prompt": [True]}, "prompt"), ({"prompt": []}, "prompt"),
                         ({"prompt": text, "suffix": "x"}, "suffix"), ({"prompt": text, "best_of": 3}, "best_of"),
                         ({"prompt": text, "echo": "yes"}, "echo"), ({"prompt": text, "echo": True, "logprobs": 1, "stream": True}, "stream")]:
        bad = httpx.post(url, json={**body, **extra}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (extra, bad.text)


def test_parallel_tool_calls_off_gives_one_call(server):
    """Chat's parallel_tool_calls: false (and Anthropic's disable_parallel_tool_use, Responses'
    parallel_tool_calls) allows one call a reply, enforced on the logits; the model is nudged here
    to call again and again (the opening token favoured, ending the turn banned)."""
    from mtplx.server.tool_choice import from_anthropic, from_openai
    from mtplx.vocab import token_id

    url, engine = server
    tokenizer = engine.checkpoint.tokenizer
    nudge = {str(token_id(tokenizer, "<tool_call>")): 3} | {str(e): -100 for e in engine.eos_ids}
    body = {"messages": [{"role": "system", "content": "You are a coding agent."},
                         {"role": "user", "content": "Read core/billing/mac_turkish.py and tests/test_mac_turkish.py"}],
            "tools": TOOLS, "max_tokens": 120, "temperature": 0, "logit_bias": nudge, "enable_thinking": False}
    calls = lambda **extra: httpx.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=60).json()[
        "choices"][0]["message"].get("tool_calls") or []
    assert len(calls()) >= 2 and len(calls(parallel_tool_calls=False)) == 1
    assert from_anthropic({"type": "auto", "disable_parallel_tool_use": True}, TOOLS).parallel is False
    assert from_anthropic({"type": "any"}, TOOLS).parallel and from_openai("required", TOOLS, False).parallel is False
    bad = httpx.post(url + "/v1/chat/completions", json={**body, "parallel_tool_calls": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "parallel_tool_calls"
    told = httpx.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, "parallel_tool_calls": False}).json()
    assert told["parallel_tool_calls"] is False


def test_a_long_render_never_holds_the_other_clients(server, monkeypatch):
    """Rendering and tokenizing run on a worker thread: while one request's conversation is
    encoded (a 100k-token history takes ~0.5 s here; here it is held for 3 s), other clients'
    requests are answered."""
    import mtplx.server.turns as turns

    render = turns.render

    def slow_for_the_long_one(tokenizer, messages, *args, **kwargs):
        if "LONG CONVERSATION" in json.dumps(messages):
            time.sleep(3)
        return render(tokenizer, messages, *args, **kwargs)

    monkeypatch.setattr(turns, "render", slow_for_the_long_one)
    url, done = server[0], {}

    def send(name, text):
        httpx.post(url + "/v1/chat/completions", json={"model": "tiny-dense", "messages": ask(text), "max_tokens": 4},
                   timeout=60).raise_for_status()
        done[name] = time.monotonic()

    long = threading.Thread(target=send, args=("long", "LONG CONVERSATION"))
    long.start()
    time.sleep(0.3)
    started = time.monotonic()
    send("short", "hi")
    assert httpx.get(url + "/health", timeout=60).status_code == 200
    long.join()
    assert done["short"] < done["long"] and done["short"] - started < 2.5


def test_a_server_that_stops_ends_a_watchers_stream_cleanly(dense_engine):
    """A watcher (`mtplx tui --attach`) never ends its event stream by itself: a stopping server
    ends it (the client sees the stream close) well before uvicorn's graceful timeout would cut it
    with a traceback in the log."""
    from mtplx.server.background import BackgroundServer

    served = BackgroundServer(create_app(dense_engine, "tiny-dense")).start()
    connected, ended, errors = threading.Event(), threading.Event(), []

    def watch():
        try:
            with httpx.stream("GET", served.url + "/v1/mtplx/events", timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith(": connected"):
                        connected.set()
            ended.set()
        except Exception as exc:  # a cut connection, not a closed stream
            errors.append(exc)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        assert connected.wait(30)
    finally:
        start = time.monotonic()
        served.stop()
    thread.join(10)
    assert ended.is_set() and not errors, errors
    assert time.monotonic() - start < 1.5  # uvicorn waits up to 2 s here, then cancels
    assert not [f for f in dense_engine.listeners if getattr(f, "__qualname__", "").startswith("Watchers")]


def test_a_model_without_a_chat_template_says_so(tmp_path):
    import shutil

    from mtplx.server.background import BackgroundServer

    model = tmp_path / "base-model"
    shutil.copytree(resolve("tiny-dense"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert not (model / "chat_template.jinja").exists()
    engine = Engine(model, EngineConfig(chunk_size=64)).start()
    served = BackgroundServer(create_app(engine, "base-model")).start()
    try:
        chat = httpx.post(served.url + "/v1/chat/completions", json={"model": "base-model", "max_tokens": 4,
                                                                  "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "no_chat_template"
        assert "/v1/completions" in chat.json()["error"]["message"]
        text = httpx.post(served.url + "/v1/completions", json={"model": "base-model", "prompt": "def f(",
                                                                "max_tokens": 4})
        assert text.status_code == 200
    finally:
        served.stop()
        engine.stop()


def test_compressed_and_oversized_bodies(server):
    import gzip
    import zlib

    url = server[0] + "/v1/chat/completions"
    body = json.dumps({"model": "tiny-dense", "messages": ask("hi"), "max_tokens": 2}).encode()
    for encoding, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        sent = httpx.post(url, content=data, headers={"content-type": "application/json", "content-encoding": encoding})
        assert sent.status_code == 200, sent.text
    refused = httpx.post(url, content=body, headers={"content-type": "application/json", "content-encoding": "br"})
    assert refused.status_code == 415 and refused.json()["error"]["code"] == "unsupported_encoding"
    bomb = gzip.compress(b" " * (20 << 20))  # 20 KB that inflates past the 16 MiB limit
    assert len(bomb) < 100_000
    sent = httpx.post(url, content=bomb, headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert sent.status_code == 413 and sent.json()["error"]["code"] == "body_too_large"
    broken = httpx.post(url, content=b"not gzip", headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert broken.status_code == 400

    def chunks():  # no content-length: the limit holds while the body arrives
        for _ in range(20):
            yield b" " * (1 << 20)

    sent = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
    assert sent.status_code == 413
    assert httpx.get(server[0] + "/health").status_code == 200


def test_openai_routes_answer_without_the_v1_prefix(server):
    from openai import OpenAI

    bare = OpenAI(base_url=server[0], api_key="x", max_retries=0)  # the server URL as given, no /v1
    assert [m.id for m in bare.models.list().data] == ["tiny-dense"]
    reply = bare.chat.completions.create(model="tiny-dense", messages=ask("hi"), max_tokens=2)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert httpx.post(server[0] + "/completions", json={"model": "tiny-dense", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_an_api_key_is_asked_of_every_route_but_health(server):
    """--api-key: OpenAI clients send it as a bearer token, Anthropic's as x-api-key; a wrong or
    missing key is a 401 in the error shape, and /health stays open for supervisors."""
    from fastapi.testclient import TestClient

    with TestClient(create_app(server[1], "tiny-dense", api_key="sekret")) as app:
        assert app.get("/health").status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "sekr"}, {"authorization": "sekret"}):
            r = app.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", headers
        assert app.get("/v1/models", headers={"authorization": "Bearer sekret"}).status_code == 200
        assert app.get("/v1/models", headers={"x-api-key": "sekret"}).status_code == 200


def test_browser_pages_of_this_machine_may_call_the_endpoint_and_others_only_when_named(server):
    """CORS: a page served from localhost (any port) passes the preflight and reads the answer;
    another site's page does not, unless --cors-origin names it (or `*`). The preflight is answered
    before the API key check (browsers send it without credentials); the request itself still
    needs the key."""
    from fastapi.testclient import TestClient

    def preflight(app, origin):
        return app.options("/v1/chat/completions", headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})

    with TestClient(create_app(server[1], "tiny-dense", api_key="sekret")) as app:
        for origin in ("http://localhost:3000", "http://127.0.0.1:5173", "https://localhost", "http://[::1]:8000"):
            r = preflight(app, origin)
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, origin
        for origin in ("https://evil.example", "http://localhost.evil.example", "http://127.0.0.1.evil.example:80"):
            r = preflight(app, origin)
            assert r.status_code == 400 and "access-control-allow-origin" not in r.headers, origin
        keyed = app.get("/v1/models", headers={"origin": "http://localhost:3000", "authorization": "Bearer sekret"})
        assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert app.get("/v1/models", headers={"origin": "http://localhost:3000"}).status_code == 401
        assert "access-control-allow-origin" not in app.get("/v1/models", headers={
            "origin": "https://evil.example", "authorization": "Bearer sekret"}).headers
    with TestClient(create_app(server[1], "tiny-dense", cors_origins=("https://app.example",))) as app:
        assert preflight(app, "https://app.example").status_code == 200
        assert preflight(app, "https://app.example.evil").status_code == 400
    with TestClient(create_app(server[1], "tiny-dense", cors_origins=("*",))) as app:
        assert preflight(app, "https://anywhere.example").status_code == 200


def test_n_choices_are_turns_of_their_own_in_one_completion(server, client):
    """Chat's `n`: one completion with a choice per turn, decoded together. Seeded, choice i draws
    with seed + i (the choices differ and each repeats); greedy, every choice is the one greedy
    reply; streamed, each chunk names its choice and the text per choice equals the whole answer's;
    usage counts the prompt once and every choice's reply tokens."""
    def text(message) -> str:
        return (message.content or "") + (message.model_extra.get("reasoning_content") or "")

    asked = dict(model="tiny-dense", messages=ask("Name a file in the repo."), max_tokens=12)
    drawn = client.chat.completions.create(**asked, n=3, temperature=1.0, seed=5)
    assert [c.index for c in drawn.choices] == [0, 1, 2]
    assert len({text(c.message) for c in drawn.choices}) > 1
    again = client.chat.completions.create(**asked, n=3, temperature=1.0, seed=5)
    assert [text(c.message) for c in again.choices] == [text(c.message) for c in drawn.choices]
    one = client.chat.completions.create(**asked, temperature=1.0, seed=6)  # choice 1 alone: seed + 1
    assert text(one.choices[0].message) == text(drawn.choices[1].message)
    assert drawn.usage.prompt_tokens == one.usage.prompt_tokens
    assert drawn.usage.completion_tokens == 36  # three replies of max_tokens each (12 tokens, cut by length)
    assert all(c.finish_reason == "length" for c in drawn.choices)

    greedy = client.chat.completions.create(**asked, n=2, temperature=0)
    alone = client.chat.completions.create(**asked, temperature=0)
    assert [text(c.message) for c in greedy.choices] == [text(alone.choices[0].message)] * 2
    assert greedy.usage.completion_tokens == 2 * alone.usage.completion_tokens

    streamed, usage = {}, None
    for chunk in client.chat.completions.create(**asked, n=3, temperature=1.0, seed=5, stream=True,
                                                stream_options={"include_usage": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "") + \
                (c.delta.model_extra.get("reasoning_content") or "")
        usage = chunk.usage or usage
    assert [streamed[i] for i in range(3)] == [text(c.message) for c in drawn.choices]
    assert usage.completion_tokens == drawn.usage.completion_tokens

    for body, route in (({"messages": ask(), "n": 17}, "/v1/chat/completions"), ({"messages": ask(), "n": 0}, "/v1/chat/completions"),
                        ({"prompt": "x", "n": 17}, "/v1/completions")):
        r = httpx.post(server[0] + route, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", body


def test_n_choices_share_one_prefill(server, client):
    """`n` choices over a long prompt compute it once: the choices queue together, the first
    prefills the prompt and the others wait for it and restore it from the bank
    (engine/shared_prompt.py; before, each choice prefilled the whole prompt: 4 choices over 4,191
    tokens took 4.8 s against 0.9-1.4 s for one), streamed or not. The choices are the ones drawn
    without sharing (seed + i, each equal to a lone request), and usage's cached tokens are what
    the bank held before the request (the first choice's)."""
    url, engine = server
    tokenizer = engine.checkpoint.tokenizer
    notes = " ".join(f"note {i}: the ledger module rounds amount {i} half to even." for i in range(40))
    assert len(tokenizer.apply_chat_template(ask(notes), add_generation_prompt=True)) >= 256 + 64
    for stream in (False, True):
        messages = ask(f"Summarise these notes ({'streamed' if stream else 'whole'}). " + notes)  # new to the bank
        seen = []
        listen = lambda e: seen.append(e) if type(e).__name__ == "Restored" else None  # noqa: E731
        engine.listeners.append(listen)
        try:
            asked = dict(model="tiny-dense", messages=messages, max_tokens=6, n=3, temperature=1.0, seed=21)
            if stream:
                texts, usage = {}, None
                for chunk in client.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True}):
                    for c in chunk.choices:
                        texts[c.index] = texts.get(c.index, "") + (c.delta.model_extra.get("reasoning_content") or "") \
                            + (c.delta.content or "")
                    usage = chunk.usage or usage
            else:
                drawn = client.chat.completions.create(**asked)
                usage = drawn.usage
                texts = {c.index: (c.message.model_extra.get("reasoning_content") or "") + (c.message.content or "")
                         for c in drawn.choices}
        finally:
            engine.listeners.remove(listen)
        prompt = usage.prompt_tokens
        assert len(seen) == 3 and seen[0].cached_tokens < prompt - 256  # the first choice computed the new part
        assert all(r.cached_tokens >= prompt - 16 for r in seen[1:]), [r.cached_tokens for r in seen]
        assert usage.prompt_tokens_details.cached_tokens == seen[0].cached_tokens
        for i in range(3):  # each choice as a lone request draws it (seed + i)
            alone = client.chat.completions.create(**{**asked, "n": 1, "seed": 21 + i})
            message = alone.choices[0].message
            assert (message.model_extra.get("reasoning_content") or "") + (message.content or "") == texts[i]


def test_echo_with_logprobs_scores_the_prompt(server):
    """Legacy completions' echo + logprobs (what lm-evaluation-harness sends to score a context and
    continuation) was a 400: now each prompt token after the first gets its log-probability given
    the ones before it, equal to one plain forward over the prompt, then the completion's own;
    the first is null, as OpenAI reports it. Every position is computed: a repeat, with the
    prompt in the bank, scores the same and restores nothing."""
    import mlx.core as mx

    url, engine = server[0] + "/v1/completions", server[1]
    text = "The session bank keeps attention and recurrent state at exact anchors. " * 4  # > one 64-token chunk
    ids = engine.checkpoint.tokenizer.encode(text)
    body = {"prompt": text, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}
    first = httpx.post(url, json=body, timeout=120).json()
    again = httpx.post(url, json=body, timeout=120).json()
    plain = httpx.post(url, json={**body, "echo": False}, timeout=120).json()

    def forward():
        hidden = engine.runner.hidden(ids, engine.runner.new_trunk_cache())
        logits = engine.runner.logits(hidden)[0]
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]

    want = engine.call(forward)
    lp = first["choices"][0]["logprobs"]
    assert first["choices"][0]["text"] == text + plain["choices"][0]["text"]
    assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp["token_logprobs"][1 : len(ids)], want))
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    # the completion's own entries as without echo (to rounding: that request restored its prefix)
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp["token_logprobs"][len(ids):],
                                                 plain["choices"][0]["logprobs"]["token_logprobs"], strict=True))
    assert "".join(lp["tokens"][: len(ids)]) == text and lp["text_offset"][: 2] == [0, len(lp["tokens"][0])]
    assert again["choices"][0]["logprobs"] == lp and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    batch = httpx.post(url, json={**body, "prompt": [text, "import os"], "max_tokens": 1, "logprobs": 1}, timeout=120).json()
    assert [c["text"][: len(p)] for c, p in zip(batch["choices"], (text, "import os"))] == [text, "import os"]
    assert batch["choices"][0]["logprobs"]["token_logprobs"][: len(ids)] == lp["token_logprobs"][: len(ids)]


def test_vllm_tokenizer_endpoints_answer_as_lm_eval_reads_them(server):
    """lm-evaluation-harness's local-completions asks GET /tokenizer_info (needs eos_token) and
    POST /tokenize before it runs; without them it wants a Hugging Face tokenizer id. A text's
    tokens, a chat's (the very prompt the chat route prefills), and back again."""
    url, engine = server[0], server[1]
    tokenizer = engine.checkpoint.tokenizer
    info = httpx.get(url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] and info["model_max_length"] > 0
    text = "def main():\n    print('hello')"
    made = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()
    assert made["tokens"] == tokenizer.encode(text, add_special_tokens=False) and made["count"] == len(made["tokens"])
    back = httpx.post(url + "/detokenize", json={"tokens": made["tokens"]}, timeout=30).json()
    assert back == {"prompt": text}
    messages = [{"role": "user", "content": "What does app.py do?"}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages, "return_token_strs": True}, timeout=30).json()
    served = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60).json()
    assert chat["count"] == served["usage"]["prompt_tokens"] and len(chat["token_strs"]) == chat["count"]
    bare = httpx.post(url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}, timeout=30).json()
    assert chat["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
    for route, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
                               ("/detokenize", {"tokens": "12"}, "tokens")):
        r = httpx.post(url + route, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, body


def _streamed_choices(url: str, body: dict) -> tuple[dict, dict | None]:
    """A streamed /v1/completions answer: each choice's text by index, and the usage chunk."""
    streamed, usage = {}, None
    with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=180) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
                usage = chunk.get("usage") or usage
    return streamed, usage


def test_text_completions_take_n_choices_too(server):
    """/v1/completions' `n` as chat's: a choice per turn, seeded seed + i, echo on every choice, the
    stream's text per index equal to the whole answer's, usage counting the prompt once."""
    url = server[0] + "/v1/completions"
    body = {"prompt": "def parse(", "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 3, "echo": True}
    whole = httpx.post(url, json=body, timeout=120).json()
    texts = [c["text"] for c in whole["choices"]]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and all(t.startswith("def parse(") for t in texts)
    assert len(set(texts)) > 1
    alone = httpx.post(url, json={**body, "n": 1, "seed": 12}, timeout=120).json()
    assert alone["choices"][0]["text"] == texts[1]
    assert whole["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
    assert whole["usage"]["completion_tokens"] == 24
    streamed, usage = _streamed_choices(url, body)
    assert [streamed[i] for i in range(3)] == texts and usage == whole["usage"]


def test_text_completions_take_a_batch_of_prompts(server):
    """A list of prompts (what evaluation harnesses send) was a 400: each prompt is now a turn of
    its own with its `n` choices, choice p * n + j being prompt p's choice j, equal to a lone
    request for that prompt; usage counts each prompt once."""
    url = server[0] + "/v1/completions"
    prompts = ["def parse(", [5, 6, 7, 8], "import os"]
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 2, "echo": True}
    whole = httpx.post(url, json=body, timeout=180).json()
    assert [c["index"] for c in whole["choices"]] == list(range(6))
    alone = [httpx.post(url, json={**body, "prompt": p}, timeout=120).json() for p in prompts]
    for p, answer in enumerate(alone):
        assert [c["text"] for c in whole["choices"][2 * p : 2 * p + 2]] == [c["text"] for c in answer["choices"]]
    assert whole["choices"][0]["text"].startswith("def parse(") and whole["choices"][4]["text"].startswith("import os")
    assert whole["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert whole["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    streamed, usage = _streamed_choices(url, body)
    assert [streamed[i] for i in range(6)] == [c["text"] for c in whole["choices"]]
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    for bad, param in (({"prompt": ["a", ""]}, "prompt[1]"), ({"prompt": ["a"] * 33, "n": 2}, "prompt"),
                       ({"prompt": ["a", [1, 10**9]]}, "prompt[1]")):
        r = httpx.post(url, json={"max_tokens": 2, **bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, bad


@pytest.mark.parametrize("field, value", [("prompt", {"id": "pmpt_1"}), ("conversation", "conv_1")])
def test_responses_refuse_context_kept_by_other_apis(server, field, value):
    """A stored prompt or a Conversations API conversation holds context this server does not
    have: answering without it would answer another conversation, so it is a 400 naming the field."""
    r = httpx.post(server[0] + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, field: value}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
