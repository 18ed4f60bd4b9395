"""A reply that continues the client's text (Anthropic's prefilled assistant turn, chat's
`continue_final_message`), and the stop string that ended a reply reported as Anthropic does."""

from __future__ import annotations

import httpx
import pytest

from mtplx.chat import render
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.text_stream import TextStream

ASK = [{"role": "user", "content": "Which file defines main?"}]
START = "The file is"


@pytest.fixture(scope="module")
def url(tiny_dense_bank_url):
    return tiny_dense_bank_url


def _messages(url, body):
    return httpx.post(url + "/v1/messages", json={"model": "m", "max_tokens": 16, "temperature": 0, **body}, timeout=60)


def test_a_prefilled_turn_continues_the_given_text_exactly(url, dense_engine, tokenizer):
    # What the model must see: the conversation's usual prompt (reasoning off), then the prefill.
    prompt = render(tokenizer, ASK, None, enable_thinking=False) + tokenizer.encode(START, add_special_tokens=False)
    alone = dense_engine.submit(GenerationRequest(tuple(prompt), SamplingParams(max_tokens=16, temperature=0))).result()
    r = _messages(url, {"messages": ASK + [{"role": "assistant", "content": START}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [b["type"] for b in body["content"]] == ["text"]  # no reasoning before a prefill
    assert body["content"][0]["text"] == alone.reply["content"] and not alone.reply["content"].startswith(START)
    assert body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"] == len(prompt)
    # The same with the text given as blocks, streamed, and through chat's continue_final_message.
    blocks = [{"role": "assistant", "content": [{"type": "text", "text": START}]}]
    with httpx.stream("POST", url + "/v1/messages", json={"model": "m", "max_tokens": 16, "temperature": 0,
                                                          "messages": ASK + blocks, "stream": True}, timeout=60) as s:
        deltas = [line for line in s.iter_lines() if '"text_delta"' in line]
    assert "".join(httpx.Response(200, content=d[6:]).json()["delta"]["text"] for d in deltas) == body["content"][0]["text"]
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": ASK + [{"role": "assistant", "content": START}],
                                                         "continue_final_message": True, "max_tokens": 16,
                                                         "temperature": 0}, timeout=60).json()
    assert chat["choices"][0]["message"]["content"] == body["content"][0]["text"]
    count = httpx.post(url + "/v1/messages/count_tokens",
                       json={"model": "m", "messages": ASK + [{"role": "assistant", "content": START}]}, timeout=60)
    assert count.json()["input_tokens"] == len(prompt)


def test_a_prefilled_turn_restores_the_conversation_before_it(url):
    convo = {"system": "You are a coding agent in a Python repository. Answer with paths; read before you edit.",
             "messages": [{"role": "user", "content": "Where is the parser for the billing module?"}]}
    first = _messages(url, {**convo, "thinking": {"type": "disabled"}}).json()
    again = _messages(url, {**convo, "messages": convo["messages"] + [{"role": "assistant", "content": "It is in"}]}).json()
    # The conversation before the prefill renders to the first turn's prompt, token for token, so
    # the bank restores it (to its last token, the anchor an identical prompt restores at).
    assert first["usage"]["input_tokens"] >= 32 and first["usage"]["cache_read_input_tokens"] == 0
    assert again["usage"]["cache_read_input_tokens"] >= first["usage"]["input_tokens"] - 1


@pytest.mark.parametrize("body, says", [
    ({"messages": ASK + [{"role": "assistant", "content": START}], "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking cannot be enabled"),
    ({"messages": [{"role": "assistant", "content": START}]}, "needs a conversation before it"),
    ({"messages": ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "must be text only"),
])
def test_a_prefill_that_cannot_be_continued_is_a_400(url, body, says):
    r = _messages(url, body)
    assert r.status_code == 400 and says in r.json()["error"]["message"]


@pytest.mark.parametrize("extra, says", [({"continue_final_message": True}, "assistant turn"),
                                         ({"continue_final_message": "yes"}, "must be a boolean")])
def test_continue_final_message_is_checked(url, extra, says):
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400 and says in r.json()["error"]["message"]


def test_the_earliest_stop_string_is_the_one_reported(tokenizer):
    stream = TextStream(tokenizer, ("module", "the"))
    for token in tokenizer.encode("Read the module first", add_special_tokens=False):
        stream.add(token)
        if stream.stopped:  # as the decode loop does
            break
    assert stream.stopped and stream.matched == "the" and stream.text == "Read "


def test_anthropic_reports_the_stop_sequence_that_ended_the_reply(url):
    free = _messages(url, {"messages": ASK, "thinking": {"type": "disabled"}, "max_tokens": 24}).json()
    text = free["content"][0]["text"]
    stop = text.split()[2]  # a word the reply writes, so the reply must end before it
    asked = {"messages": ASK, "thinking": {"type": "disabled"}, "max_tokens": 24, "stop_sequences": ["§never§", stop]}
    whole = _messages(url, asked).json()
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", stop)
    assert text.startswith(whole["content"][0]["text"]) and stop not in whole["content"][0]["text"]
    with httpx.stream("POST", url + "/v1/messages", json={"model": "m", "temperature": 0, **asked, "stream": True},
                      timeout=60) as s:
        last = [line for line in s.iter_lines() if '"message_delta"' in line][-1]
    delta = httpx.Response(200, content=last[6:]).json()["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    assert free["stop_reason"] == "max_tokens" and free["stop_sequence"] is None


def test_the_next_turn_restores_through_a_prefilled_reply(url, tokenizer):
    """The client sends the reply back as the prefill plus what followed it: the bank expects
    that message (and render-ahead prepares it), so the next turn restores through the reply."""
    head = {"system": "You are a coding agent in a Python repository. Answer with paths; read before you edit.",
            "thinking": {"type": "disabled"}}
    ask = [{"role": "user", "content": "Where is the parser for the billing module?"}]
    session = {"x-session-id": "prefilled"}
    first = httpx.post(url + "/v1/messages", headers=session, timeout=60, json={
        "model": "m", "max_tokens": 300, "temperature": 0, **head, "messages": ask + [{"role": "assistant", "content": "It is in"}]}).json()
    assert first["stop_reason"] == "end_turn"  # sent back as it is
    _settle(url)
    history = ask + [{"role": "assistant", "content": "It is in" + first["content"][0]["text"]},
                     {"role": "user", "content": "Open it."}]
    second = httpx.post(url + "/v1/messages", headers=session, timeout=60,
                        json={"model": "m", "max_tokens": 4, "temperature": 0, **head, "messages": history}).json()
    prompt = render(tokenizer, [{"role": "system", "content": head["system"]}] + history, None, enable_thinking=False)
    opens = [i for i, t in enumerate(prompt) if t == tokenizer.convert_tokens_to_ids("<|im_start|>")]
    # All but the new user turn and the generation prompt was restored (before the fix: to the
    # first user turn's end, and the reply was prefilled again).
    assert second["usage"]["input_tokens"] == len(prompt) - opens[-2]


def _settle(url, limit: float = 60.0):
    """Wait until the server's idle work (render-ahead, writes) is done."""
    import time

    deadline = time.monotonic() + limit
    while httpx.get(url + "/health", timeout=10).json().get("idle_work") and time.monotonic() < deadline:
        time.sleep(0.1)
