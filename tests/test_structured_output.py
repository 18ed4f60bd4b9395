"""Structured output: a reply held to a JSON schema on the logits, MTP under it equal to AR under
it, and each API's way of asking for it."""

from __future__ import annotations

import json

import httpx
import mlx.core as mx
import pytest

from mtplx.chat import render
from mtplx.engine.output_rule import Grammar, OutputRule, ll_tokenizer
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams

# A schema the tiny models can finish inside a short budget (bounded string and number).
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["file", "lines", "ok"],
          "properties": {"file": {"type": "string", "maxLength": 16}, "lines": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9999},
                         "ok": {"type": "boolean"}}}
EOS = 2


def _grammar(tokenizer, schema=SCHEMA):
    return Grammar.from_schema(schema, ll_tokenizer(tokenizer, [EOS]), [EOS])


def _allowed(tokenizer, rule, history) -> set[str]:
    out = rule.apply(mx.zeros((len(tokenizer),)), history)
    return {tokenizer.decode([i]) for i in range(len(tokenizer)) if out[i].item() > float("-inf")}


def test_the_rule_keeps_only_tokens_that_keep_the_document_valid(tokenizer):
    think = (tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>"))
    rule = OutputRule(_grammar(tokenizer), think=think, call_open=5)
    first = _allowed(tokenizer, rule, [])
    assert "<think>" in first and tokenizer.decode([5]) in first  # may reason first, or call a tool
    assert all(t.lstrip().startswith("{") or not t.strip() or t in ("<think>", tokenizer.decode([5])) for t in first)
    assert len(_allowed(tokenizer, rule, [think[0]] + tokenizer.encode("Let me see", add_special_tokens=False))) > 1000
    body = tokenizer.encode('{"file": "a.py", "lines": 3, "ok": true}', add_special_tokens=False)
    closed = [think[0], think[1]] + tokenizer.encode("\n\n", add_special_tokens=False)
    after = _allowed(tokenizer, rule, closed + body[:1])  # after '{"' only the first key can follow
    assert tokenizer.decode(body[:1]) == '{"' and after and all('file": '.startswith(t) for t in after)
    assert _allowed(tokenizer, rule, closed + body) == {tokenizer.decode([EOS])}
    call = tokenizer.encode("\n", add_special_tokens=False) + [5]
    assert len(_allowed(tokenizer, rule, call + [7])) > 1000  # once a call is open the schema steps aside


def test_speculative_tails_leave_no_trace(tokenizer):
    """A verify asks for a drafted tail, then the engine continues from a shorter history: the
    mask must be the one a fresh matcher gives for that history."""
    body = tokenizer.encode('{"file": "src/app.py", "lines": 12', add_special_tokens=False)
    rule = OutputRule(_grammar(tokenizer))
    for n in (len(body), 3, len(body) - 1, 5, len(body)):
        rule.apply(mx.zeros((len(tokenizer),)), body[:n])
    for n in (4, 2, 0, len(body)):
        got = rule.apply(mx.zeros((len(tokenizer),)), body[:n])
        fresh = OutputRule(_grammar(tokenizer)).apply(mx.zeros((len(tokenizer),)), body[:n])
        assert mx.array_equal(got, fresh)


def test_a_number_past_32_characters_must_end_but_a_string_of_digits_need_not(tokenizer):
    """The tiny models loop on digits under a bare "integer"; no float64 needs 32 characters."""
    from mtplx.engine.output_rule import MAX_NUMBER

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}
    digits = tokenizer.encode("1" * MAX_NUMBER, add_special_tokens=False)
    number = tokenizer.encode('{"n": ', add_special_tokens=False) + digits
    after = _allowed(tokenizer, OutputRule(_grammar(tokenizer, schema)), number)
    assert after and not any(t[:1].isdigit() for t in after) and any(t.startswith(("}", ",")) for t in after)
    shorter = _allowed(tokenizer, OutputRule(_grammar(tokenizer, schema)), number[:-1])
    assert any(t[:1].isdigit() for t in shorter)
    text = tokenizer.encode('{"s": "', add_special_tokens=False) + digits
    assert any(t[:1].isdigit() for t in _allowed(tokenizer, OutputRule(_grammar(tokenizer, schema)), text))


def test_a_schema_that_cannot_be_compiled_names_the_problem(tokenizer):
    with pytest.raises(ValueError, match="objectx"):
        _grammar(tokenizer, {"type": "objectx"})


def _prompt(tokenizer, text="Describe src/app.py as a JSON object."):
    return tuple(render(tokenizer, [{"role": "user", "content": text}], None))


def _rule(engine):
    tok = engine.checkpoint.tokenizer
    grammar = Grammar.from_schema(SCHEMA, ll_tokenizer(tok, engine.eos_ids), engine.eos_ids)
    return OutputRule(grammar, think=(tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")))


def _document(text: str) -> dict:
    return json.loads(text.split("</think>")[-1])


@pytest.mark.parametrize("text", ["Describe src/app.py as a JSON object.", "Explain what a hash map is."])
def test_mtp_greedy_equals_ar_greedy_under_a_schema(engine, tokenizer, text):
    prompt = _prompt(tokenizer, text)
    runs = [engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=120), use_mtp=mtp, depth=3,
                                            output_rule=_rule(engine))).result() for mtp in (False, True)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[1].stats.verify_calls > 0 and runs[0].finish_reason == "stop"
    doc = _document(runs[0].text)
    assert set(doc) == {"file", "lines", "ok"} and isinstance(doc["ok"], bool) and len(doc["file"]) <= 16


def test_sampled_replies_hold_to_the_schema_too(dense_engine, tokenizer):
    for seed in range(3):
        fin = dense_engine.submit(GenerationRequest(_prompt(tokenizer), SamplingParams(max_tokens=120, temperature=1.0,
                                                                                       seed=seed),
                                                    output_rule=_rule(dense_engine))).result()
        if fin.finish_reason == "stop":
            assert set(_document(fin.text)) == {"file", "lines", "ok"}
        else:  # cut by the budget: still a prefix of a document
            assert fin.text.split("</think>")[-1].lstrip().startswith('{"file": "')


def test_a_batch_under_schemas_equals_each_alone(dense_engine, tokenizer):
    prompts = [_prompt(tokenizer), _prompt(tokenizer, "Explain what a hash map is."), _prompt(tokenizer, "List the tests.")]

    def request(i):
        return GenerationRequest(prompts[i], SamplingParams(max_tokens=80), use_mtp=True, depth=3,
                                 output_rule=_rule(dense_engine) if i < 2 else None)

    alone = [dense_engine.submit(request(i)).result().token_ids for i in range(3)]
    subs = [dense_engine.submit(request(i)) for i in range(3)]
    assert [s.result().token_ids for s in subs] == alone


# -- the APIs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(tiny_dense_url):
    return tiny_dense_url


def test_openai_chat_json_schema_and_json_object(url):
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Describe src/app.py as a JSON object."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "file", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(model="tiny-dense", messages=messages, response_format=fmt, max_tokens=150,
                                           temperature=0)
    assert set(json.loads(reply.choices[0].message.content)) == {"file", "lines", "ok"}
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny-dense", messages=messages, response_format=fmt, max_tokens=150, temperature=0, stream=True) if c.choices)
    assert streamed == reply.choices[0].message.content
    anything = client.chat.completions.create(model="tiny-dense", messages=messages, max_tokens=150, temperature=0,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].message.content.startswith("{")


def test_the_openai_sdk_parse_helpers_get_their_models(url):
    """The SDK's structured-output helpers (a pydantic model, strict schema): the bare integer the
    tiny model would otherwise write without end comes back parsed."""
    from openai import OpenAI
    from pydantic import BaseModel

    class Verdict(BaseModel):
        ok: bool
        score: int

    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.parse(model="tiny-dense", messages=[{"role": "user", "content": "Is src/app.py fine?"}],
                                         response_format=Verdict, max_tokens=200, temperature=0)
    assert isinstance(chat.choices[0].message.parsed, Verdict) and chat.choices[0].finish_reason == "stop"
    answer = client.responses.parse(model="tiny-dense", input="Is src/app.py fine?", text_format=Verdict,
                                    max_output_tokens=200, temperature=0)
    assert isinstance(answer.output_parsed, Verdict)


def test_completions_take_a_response_format(url):
    body = {"prompt": "The file as JSON:", "max_tokens": 80, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}}}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["choices"][0]["text"])) == {"file", "lines", "ok"}


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}}),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "objectx"}}}}),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}),
])
def test_an_unusable_schema_is_a_400_before_anything_runs(url, route, body):
    r = httpx.post(url + route, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_schema", r.text
