"""A tool call's body held to the request's tools: the grammar (pure text), the matcher over a real
tokenizer, the engine (both tiny models, MTP == AR under the rule) and the server routes."""

from __future__ import annotations

import json

import pytest

from mtplx.call_grammar import lark

WRITE = {"type": "function", "function": {"name": "write", "description": "Write a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"], "additionalProperties": False}}}
OPEN = {"type": "function", "function": {"name": "open_path", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"], "additionalProperties": False}}}
LINE = {"type": "function", "function": {"name": "goto", "parameters": {
    "type": "object", "properties": {"line": {"type": "integer"}}, "additionalProperties": False}}}
LIST = {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object"}}}


# -- the grammar text ------------------------------------------------------------------------

def test_json_body_names_each_tool_and_embeds_enforced_schemas_only():
    text = lark("json", [WRITE, LIST], "<[6]>", enforced=["write"])
    assert text.startswith('start: "\\n" call "\\n" <[6]>')
    assert "call: call_0 | call_1" in text
    assert '"{\\"name\\": \\"write\\", \\"arguments\\": "' in text
    assert '"required": ["path", "content"]' in text  # write's schema, enforced
    assert 'args_1: %json {"type": "object", "x-guidance"' in text  # list_dir: any object


def test_named_choice_leaves_one_alternative_and_unknown_bodies_get_none():
    assert "call: call_0\n" in lark("json", [WRITE, LIST], "<[6]>", only="list_dir")
    assert "list_dir" in lark("json", [WRITE, LIST], "<[6]>", only="list_dir")
    assert "write" not in lark("json", [WRITE, LIST], "<[6]>", only="list_dir")
    assert lark("glm", [WRITE], "<[6]>") is None
    assert lark("", [WRITE], "<[6]>") is None
    assert lark("json", [WRITE], "<[6]>", only="nope") is None


def test_xml_keys_are_the_schemas_when_enforced_and_free_otherwise():
    text = lark("xml", [WRITE, LIST, LINE], "<[6]>", enforced=["write", "goto"])
    # each parameter at most once, in the schema's order, the required ones always
    assert 'call_0: "<function=write>\\n" param_0_0 param_0_1 "</function>"' in text
    assert 'param_0_0: "<parameter=path>\\n" value "\\n"' in text
    assert 'param_1: "<parameter=" ANY_KEY' in text
    # a value the schema types as other than text is JSON of its own schema, then the closing tag
    assert 'call_2: "<function=goto>\\n" param_2_0? "</function>"' in text
    assert 'param_2_0: "<parameter=line>\\n" json_2_0 "\\n</parameter>"' in text
    assert 'json_2_0: %json {"type": "integer"' in text
    assert "value[lazy]" in text
    assert 'param_0: "<parameter=" ANY_KEY' in lark("xml", [WRITE], "<[6]>")  # not enforced


# -- the matcher over the embedded tokenizer ---------------------------------------------------

@pytest.fixture(scope="module")
def matcher_for(tokenizer):
    from mtplx.engine.output_rule import Grammar, ll_tokenizer

    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    close = tokenizer.convert_tokens_to_ids("</tool_call>")

    def make(body: str, enforced=("write", "goto"), only=None):
        import llguidance

        grammar = Grammar.from_lark(lark(body, [WRITE, LIST, LINE], f"<[{close}]>", enforced, only),
                                    ll_tokenizer(tokenizer, eos), eos)
        return llguidance.LLMatcher(grammar.tokenizer, grammar.text), close

    return make


def _takes(matcher, tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids)


@pytest.mark.parametrize("text, ok", [
    ('\n{"name": "write", "arguments": {"path": "a.py", "content": "x = 1"}}\n', True),
    ('\n{"name": "list_dir", "arguments": {"anything": [1, 2]}}\n', True),
    ('\n{"name": "write_file", "arguments": {"path": "a.py"}}\n', False),  # not a declared tool
    ('\n{"name": "write", "arguments": {"path": "a.py"}}\n', False),  # content is required
    ('\n{"name": "write", "arguments": {"path": 3, "content": ""}}\n', False),  # path is a string
    ('\n{"name": "write", "arguments": {"path": "a", "content": "", "mode": "w"}}\n', False),  # no other keys
])
def test_json_calls_are_matched_to_the_tools(matcher_for, tokenizer, text, ok):
    matcher, close = matcher_for("json")
    assert _takes(matcher, tokenizer, text) == ok
    if ok:  # once whole, the closing token is the only way on
        import numpy as np

        allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        assert list(np.nonzero(allowed)[0]) == [close]
        assert matcher.consume_token(close) and matcher.is_accepting()


@pytest.mark.parametrize("text, ok", [
    ("\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\nif a </b:\n  pass\n</parameter>\n</function>\n", True),
    ("\n<function=list_dir>\n<parameter=whatever>\n.\n</parameter>\n</function>\n", True),
    ("\n<function=writer>\n</function>\n", False),
    ("\n<function=write>\n<parameter=mode>\nw\n</parameter>\n</function>\n", False),  # not a key of write
    ("\n<function=goto>\n<parameter=line>\n12\n</parameter>\n</function>\n", True),
    ("\n<function=goto>\n<parameter=line>\ntwelve\n</parameter>\n</function>\n", False),  # an integer
    ("\n<function=goto>\n<parameter=line>\n1\n</parameter>\n<parameter=line>\n2\n</parameter>\n</function>\n", False),
    ("\n<function=write>\n<parameter=content>\nx\n</parameter>\n<parameter=path>\na\n</parameter>\n</function>\n", False),
])
def test_xml_calls_are_matched_to_the_tools(matcher_for, tokenizer, text, ok):
    matcher, close = matcher_for("xml")
    assert _takes(matcher, tokenizer, text) == ok
    if ok:
        assert matcher.consume_token(close) and matcher.is_accepting()


# -- the engine --------------------------------------------------------------------------------

def _call_of(tokenizer, ids: list[int], rules) -> dict:
    body = ids[ids.index(rules.open) + 1: ids.index(rules.close)]
    return json.loads(tokenizer.decode(body))


def test_a_forced_call_names_a_declared_tool_with_valid_arguments_mtp_equal_to_ar(engine, tokenizer):
    """Made to call a tool it was never trained on, the model invents one (tiny-dense writes
    `write_file`); held to the grammar the call is `open_path` with its one string argument, and MTP keeps
    exactly what AR keeps under the rule."""
    from mtplx.chat import render
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams
    from mtplx.server.openai_request import ChatCall
    from mtplx.server.tool_choice import ToolChoice, ToolRules

    prompt = tuple(render(tokenizer, [{"role": "user", "content": "Write hello.py that prints hello."}], [OPEN],
                          enable_thinking=False))
    rules = ToolRules(tokenizer, engine.eos_ids)
    choice = ToolChoice("required")
    call = ChatCall([], [OPEN], SamplingParams(), tool_choice=choice)
    rules.compile(call)
    assert call.call_grammar is not None

    def run(mtp: bool, held: bool, **sampling):
        return engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=160, **sampling), use_mtp=mtp, depth=3,
                                               tool_rule=rules.rule(choice, False),
                                               call_rule=rules.call_rule(call) if held else None)).result()

    ar, mtp = run(False, True), run(True, True)
    assert ar.token_ids == mtp.token_ids and mtp.stats.verify_calls > 0
    together = [engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=160), use_mtp=True, depth=3,
                                                tool_rule=rules.rule(choice, False), call_rule=rules.call_rule(call)))
                for _ in range(2)]  # submitted together: the scheduler batches rows that decode at once
    assert [s.result().token_ids for s in together] == [ar.token_ids] * 2
    made = _call_of(tokenizer, ar.token_ids, rules)
    assert made["name"] == "open_path"
    assert set(made["arguments"]) == {"path"} and isinstance(made["arguments"]["path"], str)
    if engine.checkpoint.path.name == "tiny-dense":  # free, it names a tool it was not given: the grammar bit
        free = run(False, False).token_ids
        assert not tokenizer.decode(free[free.index(rules.open) + 1:]).startswith('\n{"name": "open_path",')
    sampled = run(True, True, temperature=1.0, seed=7)  # drawn, not argmax: still a valid call
    assert _call_of(tokenizer, sampled.token_ids, rules)["name"] == "open_path"


# -- the server ----------------------------------------------------------------------------------

def test_routes_hold_forced_and_strict_calls_to_the_tools(tiny_dense_url):
    """Chat `required`, a `strict` tool under auto, Anthropic `any` and Responses `required`: each
    call is to the declared tool, with arguments its schema accepts. A schema llguidance cannot
    compile is still served (the call keeps a declared name; its arguments are any object)."""
    import httpx

    url = tiny_dense_url
    ask = [{"role": "user", "content": "Write hello.py that prints hello."}]
    chat = {"messages": ask, "max_tokens": 160, "temperature": 0, "enable_thinking": False}

    def chat_call(**extra) -> dict:
        reply = httpx.post(url + "/v1/chat/completions", json={**chat, **extra}, timeout=120).json()
        return reply["choices"][0]["message"]["tool_calls"][0]["function"]

    made = chat_call(tools=[OPEN], tool_choice="required")
    assert made["name"] == "open_path" and set(json.loads(made["arguments"])) == {"path"}
    strict = {"type": "function", "function": {**OPEN["function"], "strict": True}}
    made = chat_call(tools=[strict])  # auto: the model chose to call; strict holds the call
    assert made["name"] == "open_path" and set(json.loads(made["arguments"])) == {"path"}
    odd = {"type": "function", "function": {"name": "open_path", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "pattern": "(?<=a)b"}}}}}
    assert chat_call(tools=[odd], tool_choice="required")["name"] == "open_path"

    anthropic = httpx.post(url + "/v1/messages", timeout=120, json={
        "model": "m", "max_tokens": 160, "temperature": 0, "messages": ask, "thinking": {"type": "disabled"},
        "tools": [{"name": "open_path", "input_schema": OPEN["function"]["parameters"]}],
        "tool_choice": {"type": "any"}}).json()
    use = [b for b in anthropic["content"] if b["type"] == "tool_use"]
    assert anthropic["stop_reason"] == "tool_use" and use[0]["name"] == "open_path" and set(use[0]["input"]) == {"path"}

    responses = httpx.post(url + "/v1/responses", timeout=120, json={
        "model": "m", "max_output_tokens": 160, "temperature": 0, "input": ask[0]["content"],
        "reasoning": {"effort": "none"}, "tool_choice": "required",
        "tools": [{"type": "function", "name": "open_path", "parameters": OPEN["function"]["parameters"]}]}).json()
    calls = [item for item in responses["output"] if item["type"] == "function_call"]
    assert calls[0]["name"] == "open_path" and set(json.loads(calls[0]["arguments"])) == {"path"}


def test_anthropic_client_tools_declared_by_type_get_their_documented_inputs(tiny_dense_url):
    """`{"type": "text_editor_20250728", "name": ...}` comes without a schema (Claude knows it); the
    model was described `{"type": "object"}` and could not know the editor's inputs. Now a forced
    call follows the documented ones: a `command` of that version's, and a `path`."""
    import httpx

    from mtplx.server.anthropic_tools import described

    def forced(tool: dict) -> dict:
        reply = httpx.post(tiny_dense_url + "/v1/messages", timeout=120, json={
            "model": "m", "max_tokens": 160, "temperature": 0, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "Fix the typo in /src/app.py"}], "tools": [tool],
            "tool_choice": {"type": "tool", "name": tool["name"]}}).json()
        return next(b for b in reply["content"] if b["type"] == "tool_use")

    use = forced({"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"})
    assert use["name"] == "str_replace_based_edit_tool"
    assert use["input"]["command"] in ("view", "create", "str_replace", "insert") and isinstance(use["input"]["path"], str)
    assert set(use["input"]) <= set(described("text_editor_20250728")["input_schema"]["properties"])
    assert "undo_edit" in described("text_editor_20250124")["input_schema"]["properties"]["command"]["enum"]
    use = forced({"type": "bash_20250124", "name": "bash"})
    assert use["name"] == "bash" and set(use["input"]) <= {"command", "restart"}
    own = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
    use = forced({"type": "bash_20250124", "name": "bash", "input_schema": own})  # a declared schema wins
    assert set(use["input"]) == {"cmd"}
    assert described("custom") is None and described(None) is None


def test_allowed_tools_and_the_responses_named_form_pick_the_tools_a_call_may_name(tiny_dense_url):
    """OpenAI's `allowed_tools` (chat nests it, Responses does not) limits calls to some of the
    tools while all stay described; Responses names one tool as {"type": "function", "name"}.
    Both were 400s. A bad form is still a 400 naming tool_choice."""
    import httpx

    from mtplx.server.tool_choice import from_openai

    tools = [WRITE, OPEN]
    assert from_openai({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "open_path"}}]}}, tools).allowed == ("open_path",)
    flat = from_openai({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "write"}]}, tools)
    assert (flat.mode, flat.allowed) == ("required", ("write",))
    assert from_openai({"type": "function", "name": "write"}, tools).name == "write"

    url = tiny_dense_url
    ask = [{"role": "user", "content": "Write hello.py that prints hello."}]
    chat = {"messages": ask, "max_tokens": 160, "temperature": 0, "enable_thinking": False, "tools": tools}
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "open_path"}}]}}
    reply = httpx.post(url + "/v1/chat/completions", json={**chat, "tool_choice": choice}, timeout=120).json()
    made = reply["choices"][0]["message"]["tool_calls"][0]["function"]
    assert made["name"] == "open_path" and set(json.loads(made["arguments"])) == {"path"}
    responses = httpx.post(url + "/v1/responses", timeout=120, json={
        "input": ask[0]["content"], "max_output_tokens": 160, "temperature": 0, "reasoning": {"effort": "none"},
        "tools": [{"type": "function", "name": "open_path", "parameters": OPEN["function"]["parameters"]}],
        "tool_choice": {"type": "function", "name": "open_path"}}).json()
    assert [i["name"] for i in responses["output"] if i["type"] == "function_call"] == ["open_path"]
    for bad in ({"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}},
                {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]},
                {"type": "allowed_tools", "mode": "auto", "tools": []}, {"type": "function", "name": "nope"}):
        r = httpx.post(url + "/v1/chat/completions", json={**chat, "tool_choice": bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("tool_choice"), bad



SPAWN = {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent on a task.",
         "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"],
                        "additionalProperties": False}}
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.",
          "tools": [SPAWN, {"type": "function", "name": "close_agent", "parameters": {"type": "object"}}]}


def test_namespace_tool_names_stay_plain_unless_two_tools_share_one():
    from mtplx.server.tool_namespaces import ToolNames

    names = ToolNames.of([{"type": "function", "name": "exec_command"}, AGENTS, {"type": "web_search"}])
    assert names.called("spawn_agent") == ("multi_agent_v1", "spawn_agent")
    assert names.called("exec_command") == (None, "exec_command")
    assert names.shown("multi_agent_v1", "close_agent") == "close_agent" and names.shown(None, "x") == "x"
    clash = ToolNames.of([{"type": "function", "name": "spawn_agent"}, AGENTS,
                          {"type": "namespace", "name": "other", "tools": [SPAWN]}])
    assert clash.called("spawn_agent") == (None, "spawn_agent")  # the top-level tool keeps its name
    assert clash.called("multi_agent_v1.spawn_agent") == ("multi_agent_v1", "spawn_agent")
    assert clash.shown("other", "spawn_agent") == "other.spawn_agent"
    assert ToolNames.of("junk").origin == {} and ToolNames.of([{"type": "namespace", "name": "n", "tools": 5}]).origin == {}


def test_a_strict_namespace_function_is_held_to_its_schema_like_a_top_level_one():
    from mtplx.engine.sampling import SamplingParams
    from mtplx.server.response_store import ResponseStore
    from mtplx.server.responses import parse_response_call

    strict = {**AGENTS, "tools": [{**SPAWN, "strict": True}, AGENTS["tools"][1]]}
    body = {"input": "x", "tools": [{"type": "function", "name": "spawn_agent", "strict": True}, strict]}
    call = parse_response_call(body, SamplingParams(), 8192, ResponseStore(None), None)
    assert call.strict_tools == ("spawn_agent", "multi_agent_v1.spawn_agent")  # as the model sees each


def test_a_namespace_tools_call_names_its_namespace_as_codex_needs(tiny_dense_bank_url):
    """Codex declares its sub-agent tools in a `namespace` tool, and runs a call only when it
    comes back with that `namespace` ("unsupported call: spawn_agent" otherwise: measured with
    codex-cli 0.171 against a scripted server). They were not described to the model at all."""
    import time

    import httpx

    url = tiny_dense_bank_url + "/v1/responses"
    # a top-level tool of the same name: the namespace's is shown to the model as multi_agent_v1.spawn_agent
    tools = [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {
        "cmd": {"type": "string"}}, "required": ["cmd"]}}, AGENTS, {"type": "web_search"}]
    body = {"model": "m", "max_output_tokens": 160, "temperature": 0, "reasoning": {"effort": "none"},
            "input": "Ask a helper to summarise NOTES.md", "tools": tools,
            "tool_choice": {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}}
    whole = httpx.post(url, timeout=120, json=body).json()
    call = next(item for item in whole["output"] if item["type"] == "function_call")
    assert (call["name"], call["namespace"]) == ("spawn_agent", "multi_agent_v1"), call
    assert set(json.loads(call["arguments"])) == {"message"}  # the namespace's schema held the call
    # Sent back as Codex does, the call renders as the model wrote it, so once render-ahead has
    # prepared the history the bank restores all of it (a call rendered under another name would
    # stop the restore before the call).
    for _ in range(600):
        health = httpx.get(tiny_dense_bank_url + "/health").json()
        if not health["busy"] and not health.get("idle_work"):
            break
        time.sleep(0.1)
    follow = {**body, "tool_choice": "auto", "max_output_tokens": 8,
              "input": [{"type": "message", "role": "user", "content": body["input"]}, call,
                        {"type": "function_call_output", "call_id": call["call_id"], "output": '{"agent_id": "a1"}'}]}
    again = httpx.post(url, timeout=120, json=follow).json()
    first = whole["usage"]["input_tokens"] + whole["usage"]["output_tokens"]
    assert again["usage"]["input_tokens_details"]["cached_tokens"] >= first - 2, (again["usage"], first)
    with httpx.stream("POST", url, timeout=120, json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    added = next(e["item"] for e in events if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call")
    done = next(e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call")
    assert added["namespace"] == done["namespace"] == "multi_agent_v1" and done["arguments"] == call["arguments"]
    bad = httpx.post(url, timeout=120, json={**body, "tools": [{"type": "namespace", "name": "n", "tools": [
        {"type": "function", "name": "f", "parameters": "x"}]}], "tool_choice": "auto"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].tools[0].parameters"
