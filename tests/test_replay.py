"""The replay contract, against fake servers that break it, and the receipt file rules."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from mtplx.errors import MtplxError
from mtplx.replay.client import ReplayRejected
from mtplx.replay.run import compare, replay, write_receipt
from mtplx.replay.session import arm_order
from mtplx.replay.transcript import Transcript, Turn, from_export, load
from mtplx.server.background import BackgroundServer

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TRANSCRIPT = Transcript("t", "", (Turn("s1", BODY), Turn("s1", BODY)))


def fake_server(mode: str) -> BackgroundServer:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        def chunk(delta, finish=None, usage=None, choices=True):
            data = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else []}
            if usage:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        async def stream():
            yield chunk({"role": "assistant", "content": ""})
            yield chunk({"content": "hello"})
            if mode == "truncated":
                return
            if mode == "error":
                yield 'data: {"error": {"message": "boom"}}\n\n'
            yield chunk({}, "stop")
            if mode != "no_usage":
                cached = 3 if mode == "warm" else 0
                yield chunk({}, usage={"prompt_tokens": 9, "completion_tokens": 1,
                                       "prompt_tokens_details": {"cached_tokens": cached}}, choices=False)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return BackgroundServer(app).start()


@pytest.mark.parametrize("mode,message", [("no_usage", "no usage"), ("truncated", "incomplete stream"),
                                          ("warm", "first turn came back with 3 cached"), ("error", "error frame")])
def test_broken_servers_are_rejected(mode, message):
    server = fake_server(mode)
    try:
        with pytest.raises(ReplayRejected, match=message):
            replay(TRANSCRIPT, server.url, run_id="r", echo=lambda *_: None)
    finally:
        server.stop()


def test_good_server_yields_a_receipt_with_both_ttfts(tmp_path):
    server = fake_server("ok")
    try:
        receipt = replay(TRANSCRIPT, server.url, run_id="r", echo=lambda *_: None)
    finally:
        server.stop()
    t = receipt["turns"][0]
    assert t["ttft_first_token_s"] is not None and t["ttft_first_visible_s"] is not None and t["prompt_tokens"] == 9
    write_receipt(tmp_path / "a.json", receipt)
    with pytest.raises(MtplxError, match="never overwritten"):
        write_receipt(tmp_path / "a.json", receipt)
    assert json.loads((tmp_path / "a.json").read_text())["run_id"] == "r"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]  # no temp file left behind


def test_compare_flags_parity_failures():
    a = {"turns": [{"turn": 0, "cached_tokens": 0, "ttft_first_token_s": 1.0, "output_sha256": "x"}]}
    b = {"turns": [{"turn": 0, "cached_tokens": 5, "ttft_first_token_s": 0.5, "output_sha256": "y"}]}
    table, parity = compare(a, a)
    assert parity
    table, parity = compare(a, b)
    assert not parity and "DIFFERS" in table


def test_arm_order_is_balanced():
    assert arm_order(["A", "B"], 2) == ["A", "B", "B", "A"]


def test_sample_transcripts_load_and_export_converts(tmp_path):
    from pathlib import Path

    files = sorted(Path(__file__).parents[1].joinpath("sample_transcripts").glob("*.json"))
    assert len(files) >= 6 and all(load(f).turns for f in files)
    export = tmp_path / "chat.json"
    export.write_text(json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                  {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]))
    t = from_export(export)
    assert [len(turn.body["messages"]) for turn in t.turns] == [1, 3]


def test_a_turn_whose_tools_changed_has_the_ceiling_its_head_shares(tokenizer):
    """Tools are rendered into the head: when a session's tools change, the server can know no
    more than the part of the head that stayed, not every message it saw (which would blame the
    bank for a shortfall it could not avoid); a head another session sent is knowable whole, and
    back on its first tools the session's messages under them count again."""
    from mtplx.bank.anchors import Markers
    from mtplx.bank.spans import message_spans
    from mtplx.chat import common_prefix, head_end, render
    from mtplx.replay.run import ceilings

    def tool(name):
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}

    markers = Markers.from_tokenizer(tokenizer)
    system, ask = {"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the build."}
    said = [system, ask, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}]
    more = said + [{"role": "assistant", "content": "Welcome."}, {"role": "user", "content": "And the docs?"}]
    both, fewer = [tool("read_file"), tool("grep")], [tool("grep")]
    turns = (Turn("s", {"messages": [system, ask], "tools": both}), Turn("s", {"messages": said, "tools": fewer}),
             Turn("t", {"messages": [system, ask], "tools": both}), Turn("t", {"messages": said, "tools": fewer}),
             Turn("s", {"messages": more, "tools": both}))
    got = ceilings(Transcript("tools", "", turns), tokenizer)
    first, changed = render(tokenizer, [system, ask], both), render(tokenizer, said, fewer)
    shared = common_prefix(first, changed)
    assert 0 < shared < head_end(tokenizer, changed, markers)
    assert got[1] == (len(changed), shared)
    # session t's tools change to a head session s already sent: that head is knowable whole
    assert got[3] == (len(changed), head_end(tokenizer, changed, markers))
    # s back on its first tools: knowable up to the first message its request under them had not sent
    back = render(tokenizer, more, both)
    assert got[4] == (len(back), next(span.start for span in message_spans(back, more, markers) if span.index == 2))


def test_a_message_the_client_edited_is_new_to_the_server(tokenizer):
    from mtplx.bank.anchors import Markers
    from mtplx.bank.spans import message_spans
    from mtplx.chat import render
    from mtplx.replay.run import ceilings

    ask, reply = {"role": "user", "content": "Fix the build."}, {"role": "assistant", "content": "Done."}
    edited = [ask, reply, {"role": "user", "content": "Now the docs, please."}]
    turns = (Turn("s", {"messages": [ask, reply, {"role": "user", "content": "Now the docs."}]}), Turn("s", {"messages": edited}))
    prompt = render(tokenizer, edited, None)
    spans = message_spans(prompt, edited, Markers.from_tokenizer(tokenizer))
    assert ceilings(Transcript("edit", "", turns), tokenizer)[1] == (len(prompt), next(s.start for s in spans if s.index == 2))


def test_in_process_replay_restores_warm_turns(tmp_path):
    from pathlib import Path

    from mtplx.replay.session import run_replay

    lines = []
    paths = run_replay(Path(__file__).parents[1] / "sample_transcripts" / "plain_appends.json", None, "tiny-dense",
                       [], 1, tmp_path / "r.json", echo=lines.append)
    receipt = json.loads(paths[0].read_text())
    warm = receipt["turns"][1:]
    assert receipt["turns"][0]["cached_tokens"] == 0 and all(t["ratio"] == 1.0 for t in warm)


def _sse_client(deltas: list[dict], finish: str) -> "httpx.Client":
    import httpx

    def handler(request):
        frames = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        frames.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        frames.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
        body = "".join(f"data: {json.dumps(f)}\n\n" for f in frames) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    return httpx.Client(transport=httpx.MockTransport(handler))


def test_output_hash_is_of_meaning_not_wire_form():
    """Two servers that generated the same tokens agree; a different answer does not."""
    from mtplx.replay.client import stream_turn

    def digest(deltas, finish="tool_calls"):
        with _sse_client(deltas, finish) as client:
            return stream_turn(client, "http://x", BODY, {}).output_sha256

    call = lambda id_, args: {"tool_calls": [{"index": 0, "id": id_, "type": "function",
                                              "function": {"name": "read_file", "arguments": args}}]}
    ours = digest([{"reasoning_content": "look first"}, call("call_0", '{"path": "a.py", "n": 1}')])
    theirs = digest([{"reasoning": "\nlook first\n"}, {"content": "\n\n"}, call("9f2c", '{"n":1,"path":"a.py"}')])
    assert ours == theirs
    assert ours != digest([{"reasoning_content": "look first"}, call("call_0", '{"path": "b.py", "n": 1}')])
    # Cut by the token limit inside a tool call: one server shows the partial call, one drops it.
    partial = digest([{"content": "ok <tool_call>\n{\"name\": \"re"}], "length")
    assert partial == digest([{"content": "ok "}], "length")
    assert partial != digest([{"content": "ok <tool_call>\n{\"name\": \"re"}], "stop")
