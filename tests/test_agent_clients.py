"""Requests recorded from real agent CLIs (tests/fixtures/clients/, trimmed by
bench/client_fixtures.py) replayed against the in-process server, plus the behaviours they
need on both routes: system messages anywhere, thinking types and signatures, media
placeholders, tool_choice on the logits, max_tokens capping, Anthropic-shaped errors and usage,
the Responses API with previous_response_id, session identity and canonical tool arguments."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from mtplx.bank.bank import BankConfig
from mtplx.catalog import resolve
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.server.app import create_app
from mtplx.server.tool_args import canonical
from mtplx.server.turns import session_from

FIXTURES = Path(__file__).parent / "fixtures" / "clients"
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
A_TOOLS = [{"name": "read_file", "description": "Read a file.", "input_schema": TOOLS[0]["function"]["parameters"]}]
ASK = "Read src/ledger/events.py and explain what it does."


class Served(str):
    """The server's URL, with its engine at hand for tests that watch engine events."""

    def __new__(cls, url: str, engine):
        served = super().__new__(cls, url)
        served.engine = engine
        return served


def fixture(client: str, name: str) -> dict:
    return json.loads((FIXTURES / client / name).read_text())


@pytest.fixture(scope="module")
def url(tmp_path_factory):
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
    yield Served(f"http://127.0.0.1:{port}", engine)
    srv.should_exit = True
    thread.join(10)
    engine.stop()


def sse(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line[6:] != "[DONE]":
            events.append((name, json.loads(line[6:])))
    return events


def post(url: str, recorded: dict, **changes) -> httpx.Response:
    body = {**recorded["body"], **changes}
    return httpx.post(url + recorded["path"], json=body, headers=recorded["headers"], timeout=120)


# -- Claude Code ------------------------------------------------------------------------------
def test_claude_code_requests_replay(url):
    title, main = fixture("claude", "0001-v1_messages.json"), fixture("claude", "0002-v1_messages.json")
    assert main["body"]["max_tokens"] == 32000 and main["body"]["thinking"] == {"type": "adaptive"}
    assert any(m["role"] == "system" for m in main["body"]["messages"])  # its agent list, mid-conversation
    for recorded in (title, main):
        r = post(url, recorded, temperature=0)
        assert r.status_code == 200, r.text
        assert int(r.headers["x-mtplx-max-tokens"]) < 32000 and r.headers["x-mtplx-max-tokens-capped-from"] == "32000"
        events = sse(r)
        assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
        start = events[0][1]["message"]["usage"]
        end = [d for n, d in events if n == "message_delta"][0]["usage"]
        assert start["input_tokens"] + start["cache_read_input_tokens"] == end["input_tokens"] + end["cache_read_input_tokens"]
        count = httpx.post(url + "/v1/messages/count_tokens", json={k: v for k, v in recorded["body"].items() if k != "stream"},
                           headers=recorded["headers"])
        assert count.status_code == 200
        assert count.json()["input_tokens"] == start["input_tokens"] + start["cache_read_input_tokens"]


def test_claude_code_second_turn_restores_and_replays_signed_thinking(url):
    main = fixture("claude", "0002-v1_messages.json")
    body = {**main["body"], "stream": False, "temperature": 0, "max_tokens": 48}
    first = httpx.post(url + "/v1/messages", json=body, headers=main["headers"], timeout=120).json()
    thinking = [b for b in first["content"] if b["type"] == "thinking"]
    assert all(b["signature"].startswith("mtplx1.") for b in thinking)
    follow = {**body, "messages": body["messages"] + [{"role": "assistant", "content": first["content"]},
                                                      {"role": "user", "content": "Thanks. And the tests?"}]}
    if first["stop_reason"] == "tool_use":
        follow["messages"][-1] = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b["id"], "content": "ok"}
                                                              for b in first["content"] if b["type"] == "tool_use"]}
    second = httpx.post(url + "/v1/messages", json=follow, headers=main["headers"], timeout=120).json()
    usage, before = second["usage"], first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"]
    # at least the first turn's whole prompt comes back from the bank (the template drops the
    # reply's reasoning once a new user message follows, so the reply itself may not)
    assert usage["cache_read_input_tokens"] >= before - 1 and usage["input_tokens"] > 0


def test_images_and_documents_become_placeholders_also_in_tool_results(url):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}, "title": "notes.txt"}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look at this."}, image]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a.png"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image, doc]}]}]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(url + path, json={"max_tokens": 8, "tools": A_TOOLS, "messages": messages}, timeout=60)
        assert r.status_code == 200, r.text
    chat = [{"role": "user", "content": [{"type": "text", "text": "Look."}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    assert httpx.post(url + "/v1/chat/completions", json={"messages": chat, "max_tokens": 4}, timeout=60).status_code == 200


def test_text_documents_and_search_results_reach_the_model_as_text():
    from mtplx.server.media import attached
    from mtplx.server.openai_request import parse_messages

    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "line one"}, "title": "notes.txt"}
    assert attached(doc) == "[document 'notes.txt']\nline one"
    blocks = {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}}
    assert attached(blocks) == "[document]\na\nb"
    found = {"type": "search_result", "source": "https://docs.example/x", "title": "X",
             "content": [{"type": "text", "text": "X does y."}]}
    assert attached(found) == "[search result: X — https://docs.example/x]\nX does y."
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    assert "attached; this model reads text only" in attached(pdf)
    # an OpenAI assistant turn that refused comes back as its refusal text
    said = parse_messages([{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}])
    assert said[1]["content"] == "I can't."


def test_anthropic_errors_have_anthropic_shape(url):
    r = httpx.post(url + "/v1/messages", json={"max_tokens": 2**31, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/messages", json={"max_tokens": 10, "messages": [{"role": "user", "content": "word " * 9000}]})
    assert r.status_code == 400 and "context window" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# -- tool choice on both routes ---------------------------------------------------------------
def _calls_openai(url, **kw) -> int:
    body = {"messages": [{"role": "user", "content": ASK}], "max_tokens": 96, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return len(r.json()["choices"][0]["message"].get("tool_calls") or [])


def _calls_anthropic(url, **kw) -> int:
    body = {"messages": [{"role": "user", "content": ASK}], "max_tokens": 96, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return sum(b["type"] == "tool_use" for b in r.json()["content"])


def test_tool_calls_only_when_allowed_and_forced_when_required(url):
    assert _calls_openai(url, tools=TOOLS) >= 1  # the model calls read_file on its own here...
    assert _calls_openai(url, tools=TOOLS, tool_choice="none") == 0  # ...but cannot under none
    assert _calls_openai(url) == 0  # nor without tools (OpenCode's title request)
    assert _calls_anthropic(url, tools=A_TOOLS) >= 1
    assert _calls_anthropic(url, tools=A_TOOLS, tool_choice={"type": "none"}) == 0
    hello = [{"role": "user", "content": "Say hello."}]
    assert _calls_openai(url, tools=TOOLS, tool_choice="required", messages=hello) >= 1
    assert _calls_anthropic(url, tools=A_TOOLS, tool_choice={"type": "any"}, messages=hello) >= 1
    named = {"type": "function", "function": {"name": "read_file"}}
    assert _calls_openai(url, tools=TOOLS, tool_choice=named, messages=hello) >= 1
    bad = httpx.post(url + "/v1/chat/completions", json={"messages": hello, "tool_choice": "required"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


# -- Codex (Responses API) --------------------------------------------------------------------
def test_codex_request_replays_and_previous_response_id_restores(url):
    recorded = fixture("codex", "0001-v1_responses.json")
    assert recorded["body"]["store"] is False  # Codex keeps nothing on the server: it resends the whole input
    r = post(url, recorded, temperature=0, max_output_tokens=48, store=True)
    assert r.status_code == 200, r.text
    events = sse(r)
    kinds = [d["type"] for _, d in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [d["sequence_number"] for _, d in events] == list(range(1, len(events) + 1))
    done = events[-1][1]["response"]
    added = [d["item"]["id"] for _, d in events if d["type"] == "response.output_item.added"]
    assert added == [item["id"] for item in done["output"]]
    usage = done["usage"]
    assert usage["input_tokens"] > 0 and usage["input_tokens_details"]["cached_tokens"] >= 0
    calls = [o for o in done["output"] if o["type"] == "function_call"]
    follow = ([{"type": "function_call_output", "call_id": c["call_id"], "output": "exit 0"} for c in calls]
              or [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]}])
    body = {k: v for k, v in recorded["body"].items() if k != "input"}
    url.engine.settle()  # the bank prepares the follow-up's rendering while the agent runs its tool
    second = httpx.post(url + "/v1/responses", json={**body, "stream": False, "temperature": 0, "max_output_tokens": 16,
                                                     "previous_response_id": done["id"], "input": follow},
                        headers=recorded["headers"], timeout=120).json()
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= usage["input_tokens"]
    unknown = httpx.post(url + "/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "previous_response_id"


def test_codex_namespace_tools_are_described_and_web_search_is_not(url):
    """Codex's default request: function tools, its sub-agent tools in a `namespace`, and
    `web_search` (which OpenAI runs). The namespace's functions reach the prompt (their calls go
    back with the namespace: test_call_grammar); web search does not."""
    recorded = fixture("codex", "0001-v1_responses.json")
    kinds = {t["type"] for t in recorded["body"]["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds  # what Codex sends with default settings
    functions = [t for t in recorded["body"]["tools"] if t["type"] == "function"]
    described = [t for t in recorded["body"]["tools"] if t["type"] in ("function", "namespace")]
    usages = []
    for tools in (recorded["body"]["tools"], described, functions):
        r = post(url, recorded, tools=tools, stream=False, temperature=0, max_output_tokens=2)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"]["input_tokens"])
    assert usages[0] == usages[1] > usages[2]


def test_structured_output_is_asked_for_and_held_to(url):
    """Claude Code's title request asks for a JSON schema (output_config.format): it is asked for
    in the system prompt and held to on the logits, so the title parses. A format that is no JSON
    schema is a 400; Responses' text.format is held to the same way."""
    title = fixture("claude", "0001-v1_messages.json")
    assert title["body"]["output_config"]["format"]["type"] == "json_schema"
    body = {k: v for k, v in title["body"].items() if k != "stream"}
    plain = {**body, "output_config": {"effort": "high"}}

    def count(b):
        return httpx.post(url + "/v1/messages/count_tokens", json=b, headers=title["headers"]).json()["input_tokens"]

    assert count(body) > count(plain)  # the schema is in the prompt
    answer = post(url, title, temperature=0, max_tokens=60, stream=False)
    assert answer.status_code == 200
    text = "".join(b["text"] for b in answer.json()["content"] if b["type"] == "text")
    # The tiny model's title is a string without end (the schema sets no maxLength), cut by max_tokens.
    assert text.startswith('{"title": "') and answer.json()["stop_reason"] == "max_tokens"
    bad = httpx.post(url + "/v1/messages", json={**plain, "max_tokens": 4, "output_config": {"format": {"type": "regex"}}})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24}}, "required": ["title"],
              "additionalProperties": False}
    held = httpx.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 200, "temperature": 0,
                                                   "text": {"format": {"type": "json_schema", "name": "t", "schema": schema}}},
                      timeout=120)
    assert held.status_code == 200, held.text
    assert len(json.loads(held.json()["output"][-1]["content"][0]["text"])["title"]) <= 24
    plain_text = {"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "text"}, "verbosity": "low"}}
    assert httpx.post(url + "/v1/responses", json=plain_text, timeout=60).status_code == 200


def test_previous_response_id_survives_a_server_restart(url):
    """The conversations behind previous_response_id are a file under MTPLX_HOME: a server started
    afresh on the same home still renders a follow-up naming the previous server's response."""
    from fastapi.testclient import TestClient

    ask = {"input": ASK, "tools": [{"type": "function", **TOOLS[0]["function"]}], "max_output_tokens": 8, "temperature": 0}
    with TestClient(create_app(url.engine, "tiny-dense")) as before:
        first = before.post("/v1/responses", json=ask).json()
    with TestClient(create_app(url.engine, "tiny-dense")) as after:  # a new server process would open the same file
        follow = after.post("/v1/responses", json={**ask, "input": "Go on.", "previous_response_id": first["id"]})
        assert follow.status_code == 200, follow.text
        assert follow.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]  # the history came back
        assert after.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"}).status_code == 400


def test_a_kept_response_is_retrieved_and_deleted_and_store_false_keeps_nothing(url):
    """What the OpenAI SDK's responses.retrieve / delete call; `store: false` (Codex's default)
    keeps nothing, so it cannot be retrieved or continued, as OpenAI answers; `background` is a
    400, never run in the foreground as if it were honoured."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, _strict_response_validation=True)
    made = client.responses.create(model="m", input="hi", max_output_tokens=6, temperature=0)
    got = client.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text and got.usage.output_tokens == 6 and got.store
    with client.responses.stream(model="m", input="hi", max_output_tokens=6, temperature=0) as stream:
        streamed = stream.get_final_response()
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    client.responses.delete(made.id)
    for call in (lambda: client.responses.retrieve(made.id), lambda: client.responses.delete(made.id)):
        with pytest.raises(openai.NotFoundError, match="response_not_found|not kept"):
            call()
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="m", input="more", previous_response_id=made.id, max_output_tokens=2)
    private = client.responses.create(model="m", input="hi", max_output_tokens=2, store=False)
    assert private.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(private.id)
    with pytest.raises(openai.BadRequestError, match="store: false"):
        client.responses.create(model="m", input="more", previous_response_id=private.id, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model="m", input="hi", background=True, max_output_tokens=2)


def test_a_kept_responses_input_items_are_listed_and_paged(url):
    """What the OpenAI SDK's responses.input_items.list calls: the request's input, item by item,
    newest first by default, with ids (the client's own where it gave one), paged by `after`."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, _strict_response_validation=True)
    history = [{"type": "message", "role": "user", "content": "Read the file."},
               {"type": "function_call", "id": "fc_given", "call_id": "c1", "name": "read_file",
                "arguments": '{"path": "a.py"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "print(1)"},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now explain it."}]}]
    made = client.responses.create(model="m", input=history, max_output_tokens=4, temperature=0,
                                   tools=[{"type": "function", **TOOLS[0]["function"]}])
    listed = client.responses.input_items.list(made.id)
    assert [item.type for item in listed.data] == ["message", "function_call_output", "function_call", "message"]
    assert listed.data[2].id == "fc_given" and listed.data[1].output == "print(1)"
    assert listed.data[3].content[0].text == "Read the file." and not listed.has_more
    ids = [item.id for item in listed.data]
    assert len(set(ids)) == 4 and client.responses.input_items.list(made.id).data[0].id == ids[0]  # ids are kept
    first = client.responses.input_items.list(made.id, order="asc", limit=3)
    assert [i.id for i in first.data] == ids[::-1][:3] and first.has_more
    rest = client.responses.input_items.list(made.id, order="asc", limit=3, after=first.data[-1].id)
    assert [i.id for i in rest.data] == [ids[0]] and not rest.has_more
    assert [i.id for i in client.responses.input_items.list(made.id, order="asc")] == ids[::-1]  # the SDK's pager
    plain = client.responses.create(model="m", input="hi", max_output_tokens=2)
    assert client.responses.input_items.list(plain.id).data[0].content[0].text == "hi"
    for bad in ({"limit": 0}, {"order": "up"}, {"after": "msg_nope"}):
        with pytest.raises(openai.BadRequestError):
            client.responses.input_items.list(made.id, **bad)
    private = client.responses.create(model="m", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match="not kept"):
        client.responses.input_items.list(private.id)


def test_an_item_reference_renders_as_the_item_it_names(url):
    """An input item `{"type": "item_reference", "id": ...}` stands for an input or output item of a
    kept response: the request renders as if the client had sent that item itself."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, _strict_response_validation=True)
    first = client.responses.create(model="m", input="Read the file.", max_output_tokens=6, temperature=0)
    asked = client.responses.input_items.list(first.id).data[0].id
    answered = [item.model_dump(exclude_none=True) for item in first.output]
    follow = {"role": "user", "content": "Go on."}
    by_reference = client.responses.create(
        model="m", input=[{"type": "item_reference", "id": asked}, *({"type": "item_reference", "id": item["id"]}
                                                                      for item in answered), follow],
        max_output_tokens=6, temperature=0)
    whole = client.responses.create(model="m", input=[{"role": "user", "content": "Read the file."}, *answered, follow],
                                    max_output_tokens=6, temperature=0)
    assert by_reference.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert by_reference.output_text == whole.output_text
    with pytest.raises(openai.BadRequestError, match="names no item"):
        client.responses.create(model="m", input=[{"type": "item_reference", "id": "msg_nope"}], max_output_tokens=2)


def test_response_store_is_bounded_and_survives_a_damaged_file(tmp_path):
    from mtplx.server.api_error import ApiError
    from mtplx.server.response_store import ResponseStore

    store = ResponseStore(tmp_path / "responses.db", capacity=2)
    for rid in ("a", "b"):
        store.put(rid, [{"role": "user", "content": rid}])
    assert store.get("a") == [{"role": "user", "content": "a"}]  # a is now the most recently used
    store.put("c", [])
    with pytest.raises(ApiError):
        store.get("b")  # the least recently used went
    assert len(ResponseStore(tmp_path / "responses.db", capacity=2)) == 2  # and the rest is on disk
    (tmp_path / "bad.db").write_bytes(b"not a database" * 100)
    damaged = ResponseStore(tmp_path / "bad.db")
    damaged.put("x", [])
    assert damaged.get("x") == []
    assert ResponseStore(tmp_path / "bad.db").get("x") == []  # a fresh file replaced it: kept across a restart
    assert [p.read_bytes() for p in tmp_path.glob("bad.db.damaged-*")] == [b"not a database" * 100]  # set aside
    with pytest.raises(ValueError):
        ResponseStore(capacity=0)


def test_a_response_store_from_before_retrieval_is_opened_and_kept(tmp_path):
    """A file written before responses were kept whole: its conversations still continue, and
    new responses are kept whole beside them."""
    import sqlite3

    from mtplx.server.response_store import ResponseStore

    old = sqlite3.connect(tmp_path / "responses.db")
    old.execute("create table responses (id text primary key, used real not null, messages text not null)")
    old.execute("insert into responses values ('r0', 1.0, '[]')")
    old.commit()
    old.close()
    store = ResponseStore(tmp_path / "responses.db")
    assert store.get("r0") == [] and store.response("r0") is None
    store.put("r1", [], {"id": "r1"})
    assert ResponseStore(tmp_path / "responses.db").response("r1") == {"id": "r1"}


def test_response_store_on_a_full_disk_keeps_answering_and_writes_later(tmp_path):
    from mtplx.server.response_store import ResponseStore

    store = ResponseStore(tmp_path / "responses.db", capacity=8)
    store.put("old", [{"role": "user", "content": "old"}])
    pages = store.db.execute("pragma page_count").fetchone()[0]
    store.db.execute(f"pragma max_page_count = {pages}")  # sqlite answers as on a full disk
    big = [{"role": "user", "content": "x" * 20000}]
    store.put("new", big)  # no exception: the response waits in memory
    assert store.held and store.get("new") == big and store.get("old") == [{"role": "user", "content": "old"}]
    assert len(store) == 2
    store.db.execute("pragma max_page_count = 1000000")  # space freed
    store.put("next", [])
    assert not store.held
    assert ResponseStore(tmp_path / "responses.db").get("new") == big  # on disk: kept across a restart


def test_codex_second_turn_restores_the_whole_first_turn(url):
    """Codex keeps no server state (store: false): its next request resends the first one's input,
    the output items it read from our stream (a reasoning item keeps only our sealed blob) and the
    new input (recorded: 0001 then 0002). Folded back into chat messages that history renders to
    what the bank prepared while the agent was busy, so the whole first turn, reply included, is
    restored. (The reply itself renders as the ids the model sampled, so only what the template
    changes, e.g. a tool call it re-serialises, waits for the render-ahead: see docs/server.md.)"""
    from mtplx.events import Restored

    first, later = fixture("codex", "0001-v1_responses.json"), fixture("codex", "0002-v1_responses.json")
    n = len(first["body"]["input"])
    assert later["body"]["input"][:n] == first["body"]["input"]  # the whole history, every turn
    assert [item.get("role") for item in later["body"]["input"][n:]] == ["assistant", "user"]
    seen = []
    listen = lambda e: seen.append(e) if isinstance(e, Restored) else None
    url.engine.listeners.append(listen)
    try:
        r = post(url, first, temperature=0, max_output_tokens=64)
        assert r.status_code == 200, r.text
        items = [d["item"] for _, d in sse(r) if d["type"] == "response.output_item.done"]
        assert items and all(i["type"] != "reasoning" or i["encrypted_content"].startswith("mtplx1.") for i in items)
        items = [{k: v for k, v in i.items() if k != "content"} if i["type"] == "reasoning" else i for i in items]
        calls = [i for i in items if i["type"] == "function_call"]
        follow = ([{"type": "function_call_output", "call_id": c["call_id"], "output": "exit 0"} for c in calls]
                  or later["body"]["input"][n + 1:])
        url.engine.settle()  # Codex runs the command (or its user reads the answer) meanwhile
        r = post(url, later, input=first["body"]["input"] + items + follow, temperature=0, max_output_tokens=8)
        assert r.status_code == 200, r.text
    finally:
        url.engine.listeners.remove(listen)
    before, after = seen[-2], seen[-1]
    assert after.ceiling > before.prompt_tokens  # the reply counts: it came back as generated...
    assert after.cached_tokens >= 0.99 * after.ceiling, after.shortfall  # ...and is restored


# -- replies sent back, on every route (pure) ---------------------------------------------------
CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
REPLIES = {  # generated text, and whether the prompt ended inside <think>
    "plain": ("The file prints hello.", False),
    "reasoning then answer": ("<think>\nI look.\n</think>\n\nIt prints hello.", False),
    "prompt opened the reasoning": ("I look.\n</think>\n\nIt prints hello.", True),
    "text then a call": ("I'll read it.\n" + CALL, False),
    "reasoning, text, two calls": ("<think>\nTwo files.\n</think>\n\nReading both.\n" + CALL + "\n" + CALL, False),
    "a call alone": (CALL, False),
    "reasoning then a call": ("Read it first.\n</think>\n\n" + CALL, True),
    # what a small model also writes: text after a call, a call that does not parse, stray tags,
    # a reply cut inside the reasoning the prompt opened
    "text, a call, more text": ("A\n" + CALL + "\nB", False),
    "a call that does not parse": ("A\n<tool_call>\nnot json\n</tool_call>\nB", False),
    "a stray closing tag": ("foo bar</think> baz qux", False),
    "reasoning opened mid-text": ("A <think>x</think> B", False),
    "cut inside the reasoning": ("still thinking", True),
    "an unclosed think": ("<think>\nI have not\n</tool_response>", False),
}


def _finished(text: str, in_reasoning: bool):
    """The Finished event the engine sends for `text`: the reply split once, as the engine does
    (engine/generation.py: the model's tool-call format, the request's tool schemas)."""
    from mtplx.events import Finished
    from mtplx.reply_stream import ReplyStream

    return Finished("r", "stop", 10, 5, 0, text, (), {}, tuple(ReplyStream(in_reasoning, None, TOOLS).feed(text, final=True)))


def _sent_back(text: str, in_reasoning: bool, signer) -> dict:
    """The assistant message each route folds back from what it answered, resent as the client
    got it: OpenAI's message, Anthropic's content blocks, the Responses output items as streamed
    (Codex keeps a reasoning item's sealed blob, not its text)."""
    from mtplx.events import Tokens
    from mtplx.server import anthropic_map, openai_response, responses
    from mtplx.server.openai_request import parse_messages

    fin = _finished(text, in_reasoning)
    user, then = {"role": "user", "content": ASK}, {"role": "user", "content": "Thanks."}
    message = openai_response.completion("m", fin)["choices"][0]["message"]
    blocks = anthropic_map.message("m", fin, signer)["content"]
    built = responses.ResponseStream("m", {}, signer)
    streamed = built.start() + built.tokens(Tokens("r", (), text, "content", fin.pieces)) + built.finish(fin)
    items = [{k: v for k, v in d["item"].items() if k != "content"} if d["item"]["type"] == "reasoning" else d["item"]
             for name, d in streamed if name == "response.output_item.done"]
    return {"openai": parse_messages([user, message, then])[1],
            "anthropic": anthropic_map.to_messages({"messages": [user, {"role": "assistant", "content": blocks}, then]}, signer)[1],
            "responses": responses.to_messages({"input": [{"role": "user", "content": ASK}, *items,
                                                          {"role": "user", "content": "Thanks."}]}, [], signer)[1]}


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_a_reply_sent_back_renders_as_the_bank_prepared_it_on_every_route(case, tokenizer):
    """What the bank renders ahead for the next turn (Finished.reply, the engine's split) and
    what each route folds back from the client's copy render to the same tokens, before a new
    user message and before a tool result: the reply, reasoning and calls included, is reusable."""
    from mtplx.bank.spans import same_reply
    from mtplx.chat import render
    from mtplx.server.signature import Signer

    text, in_reasoning = REPLIES[case]
    generated = _finished(text, in_reasoning).reply
    for route, message in _sent_back(text, in_reasoning, Signer(key=b"k" * 32)).items():
        assert same_reply(message, generated), route
        for follow in ({"role": "user", "content": "Thanks."}, {"role": "tool", "tool_call_id": "call_0", "content": "x = 1"}):
            convo = lambda reply: [{"role": "user", "content": ASK}, reply, follow]
            assert render(tokenizer, convo(message), TOOLS, add_generation_prompt=False) == \
                render(tokenizer, convo(generated), TOOLS, add_generation_prompt=False), (route, follow["role"])


# -- session identity and tool arguments (pure) -----------------------------------------------
def test_session_ids_from_what_clients_send():
    from mtplx.server.openai_request import ChatCall
    from mtplx.engine.sampling import SamplingParams

    claude, codex = fixture("claude", "0002-v1_messages.json"), fixture("codex", "0001-v1_responses.json")
    assert session_from(claude["headers"]) == claude["headers"]["x-claude-code-session-id"]
    assert session_from({}, claude["body"]) == json.loads(claude["body"]["metadata"]["user_id"])["session_id"]
    assert session_from(codex["headers"]) == codex["headers"]["session-id"]
    assert session_from({}, codex["body"]) == codex["body"]["prompt_cache_key"]
    assert session_from({}, {"metadata": {"user_id": "user_abc_account__session_1234"}}) == "1234"
    # one client session id with two system prompts names two conversations
    calls = [ChatCall([{"role": "system", "content": s}, {"role": "user", "content": "hi"}], None, SamplingParams())
             for s in ("title generator", "coding agent")]
    a, b = (session_from({"session-id": "s1"}, None, c) for c in calls)
    assert a != b and a.startswith("s1/") and b.startswith("s1/")


def test_reserialised_tool_arguments_render_identically(url):
    spaced = '{"path": "src/caf\u00e9.py", "limit": 5}'
    assert canonical('{"path":"src/caf\\u00e9.py","limit":5}') == canonical(spaced) == spaced
    assert canonical({"path": "src/caf\u00e9.py", "limit": 5}) == spaced
    assert canonical("not json") == "not json"

    def tokens(arguments):
        messages = [{"role": "user", "content": ASK},
                    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                         "function": {"name": "read_file", "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "x = 1"}]
        r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 1})
        return r.json()["usage"]["prompt_tokens"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    compact, again = tokens('{"path":"src/caf\\u00e9.py","limit":5}'), tokens(spaced)
    assert compact[0] == again[0] and again[1] >= again[0] - 8  # the second render restores the first's cache


def test_models_report_the_context_window(url):
    model = httpx.get(url + "/v1/models").json()["data"][0]
    assert model["context_window"] == model["max_model_len"] == 8192
    assert model["max_position_embeddings"] == 8192 and model["trained_window"] == 2048


def test_signing_key_is_whole_or_absent_even_on_a_full_disk(tmp_path, monkeypatch):
    import mtplx.server.signature as signature
    from mtplx.server.signature import Signer

    path = tmp_path / "signing.key"
    path.write_bytes(b"")  # what a write cut short by a full disk left before
    signer = Signer(lambda: path)
    assert len(signer.key) == 32 and path.read_bytes() == signer.key  # replaced, not used
    assert Signer(lambda: path).verify("t", signer.sign("t"))  # a restart signs alike

    def full(fd):
        raise OSError(28, "No space left on device")

    def no_links(src, dst):  # exFAT and some network file systems
        raise OSError(1, "Operation not permitted")

    with monkeypatch.context() as patch:
        patch.setattr(signature.os, "link", no_links)
        linkless = tmp_path / "exfat" / "signing.key"
        assert Signer(lambda: linkless).key == linkless.read_bytes()  # renamed into place instead
        assert sorted(p.name for p in linkless.parent.iterdir()) == ["signing.key"]

    monkeypatch.setattr(signature.os, "fsync", full)
    elsewhere = tmp_path / "full" / "signing.key"
    signer = Signer(lambda: elsewhere)
    assert signer.unseal(signer.seal("reasoning")) == "reasoning"  # the request is served
    assert list(elsewhere.parent.iterdir()) == []  # no empty or partial key left to be read later


def test_reasoning_sealed_for_codex_comes_back_as_reasoning():
    from mtplx.server.responses import to_messages
    from mtplx.server.signature import Signer

    signer = Signer(key=b"k" * 32)
    blob = signer.seal("I should read the file first.")
    assert blob.startswith("mtplx1.") and signer.unseal(blob) == "I should read the file first."
    assert Signer(key=b"j" * 32).unseal(blob) is None and signer.unseal(blob[:-4] + "AAAA") is None
    # Codex sends back a reasoning item with only the opaque blob, then the call it preceded
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
             {"type": "reasoning", "summary": [], "encrypted_content": blob},
             {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": '{"path":"a.py"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "x = 1"}]
    messages = to_messages({"instructions": "You are Codex.", "input": items}, [], signer)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["reasoning_content"] == "I should read the file first."
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"path": "a.py"}'


# -- OpenCode, Pi, Qwen Code (chat completions) -----------------------------------------------
def test_opencode_title_request_never_gets_a_tool_call_and_its_max_tokens_is_capped(url):
    title = fixture("opencode", "0001-v1_chat_completions.json")
    assert "tools" not in title["body"] and title["body"]["max_tokens"] == 32000
    r = post(url, title, temperature=0)
    assert r.status_code == 200, r.text
    assert r.headers["x-mtplx-max-tokens-capped-from"] == "32000"
    chunks = [d for _, d in sse(r)]
    assert not any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    assert "<tool_call>" not in "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0  # include_usage honoured


@pytest.mark.parametrize("client,first,later", [("opencode", "0002", "0003"), ("pi", "0001", "0002"), ("qwen", "0001", "0003")])
def test_chat_clients_replay_and_later_turns_restore(url, client, first, later):
    a = fixture(client, f"{first}-v1_chat_completions.json")
    b = fixture(client, f"{later}-v1_chat_completions.json")
    usages = []
    for recorded in (a, b):
        r = post(url, recorded, temperature=0, max_tokens=16, **({"max_completion_tokens": 16} if "max_completion_tokens" in recorded["body"] else {}))
        assert r.status_code == 200, r.text
        usages.append([d for _, d in sse(r)][-1]["usage"])
    # the later request shares the earlier one's system prompt and tools: at least that much is restored
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0.5 * usages[0]["prompt_tokens"]


def test_a_later_system_message_is_folded_only_for_templates_that_refuse_it():
    from types import SimpleNamespace

    from mtplx.engine.sampling import SamplingParams
    from mtplx.server.anthropic_map import to_messages
    from mtplx.server.encode_cache import EncodeCache
    from mtplx.server.openai_request import ChatCall
    from mtplx.server.turns import encode

    class SystemFirstOnly:  # what Qwen3's template does: "System message must be at the beginning."
        chat_template = "qwen3-like"

        def apply_chat_template(self, messages, **kw):
            if any(m["role"] == "system" for m in messages[1:]):
                raise ValueError("System message must be at the beginning.")
            return [len(m["content"]) for m in messages]

    body = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3.abc;"},
                       {"type": "text", "text": "You are an agent."}],
            "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "Agents: Explore, Plan."}]}
    messages = to_messages(body)
    assert messages[0] == {"role": "system", "content": "You are an agent."}  # billing header left out
    assert messages[2] == {"role": "system", "content": "Agents: Explore, Plan."}  # in place where allowed
    engine = SimpleNamespace(checkpoint=SimpleNamespace(tokenizer=SystemFirstOnly()))
    cache = EncodeCache("id", "qwen3-like")
    for _ in range(2):  # a miss, then a hit: both leave the folded messages on the call
        call = ChatCall(to_messages(body), None, SamplingParams())
        assert encode(engine, cache, call, "messages", json.dumps(body).encode())
        assert [m["role"] for m in call.messages] == ["system", "user", "user"]
        assert "Agents: Explore, Plan." in call.messages[2]["content"]


def test_one_session_id_with_two_system_prompts_gets_no_borrowed_ceiling(url):
    from mtplx.events import Restored

    seen = []
    url.engine.listeners.append(lambda e: seen.append(e) if isinstance(e, Restored) else None)
    try:
        for system in ("You write titles for coding sessions.", "You are a coding agent in a repository."):
            body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": ASK}], "max_tokens": 4}
            r = httpx.post(url + "/v1/chat/completions", json=body, headers={"session-id": "shared-id"}, timeout=60)
            assert r.status_code == 200
    finally:
        url.engine.listeners.pop()
    # The second conversation shares only the template's first tokens with the first: a ceiling
    # borrowed from the session's previous turn would claim its whole system + user messages.
    assert seen[1].ceiling is not None and seen[1].ceiling <= seen[1].cached_tokens + 8 < 40


def test_a_client_that_gives_up_during_prefill_finds_its_prompt_banked_on_retry(url):
    """Claude Code abandons a request whose first token takes over 300 s and resends it: the
    abandoned prefill stops at its next chunk (the engine is free at once) and the bank keeps the
    prefix it computed, so the retry restores that part instead of starting over."""
    from mtplx.events import Finished, PrefillProgress

    seen = []
    url.engine.listeners.append(seen.append)
    body = {"messages": [{"role": "system", "content": "You are a patient agent. " * 300}, {"role": "user", "content": ASK}],
            "max_tokens": 8, "temperature": 0, "stream": True}
    try:
        with httpx.Client(timeout=120) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            while not any(isinstance(e, PrefillProgress) for e in seen):
                time.sleep(0.01)
        deadline = time.time() + 120
        while not any(isinstance(e, Finished) for e in seen) and time.time() < deadline:
            time.sleep(0.05)
        first = next(e for e in seen if isinstance(e, Finished))
        assert first.finish_reason == "cancelled" and first.completion_tokens == 0
        progress = [e for e in seen if isinstance(e, PrefillProgress) and e.request_id == first.request_id]
        assert 0 < progress[-1].done < progress[-1].total  # stopped between chunks, not at the end
        url.engine.settle()
        retry = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=120).json()["usage"]
        assert retry["prompt_tokens_details"]["cached_tokens"] >= progress[-1].done  # the computed prefix restored
    finally:
        url.engine.listeners.remove(seen.append)
