"""Anthropic's context-management edits, applied to a request's messages (pure: no model)."""

from __future__ import annotations

import copy
import json

import pytest

from mtplx.server.api_error import ApiError
from mtplx.server.context_edits import CLEARED, apply


def size(body: dict) -> int:  # a stand-in for the rendered prompt's tokens
    return len(json.dumps(body["messages"])) // 4


def turn(i: int, name: str = "read_file", thinking: bool = True) -> list[dict]:
    said = [{"type": "thinking", "thinking": f"plan {i} " * 20, "signature": "s"}] if thinking else []
    return [{"role": "assistant", "content": said + [{"type": "tool_use", "id": f"t{i}", "name": name, "input": {"path": f"f{i}.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": f"contents of f{i} " * 50}]}]


def convo(*names: str) -> dict:
    messages = [{"role": "user", "content": "Fix the bug."}]
    for i, name in enumerate(names):
        messages += turn(i, name)
    return {"model": "m", "max_tokens": 8, "messages": messages}


def edited(body: dict, *edits: dict):
    sent = {**body, "context_management": {"edits": list(edits)}}
    kept = copy.deepcopy(sent)
    out, applied = apply(sent, size)
    assert sent == kept  # the request as sent is never changed in place
    return out, applied


def thinking_turns(body: dict) -> int:
    return sum(any(b["type"] == "thinking" for b in m["content"]) for m in body["messages"] if m["role"] == "assistant")


def test_without_context_management_nothing_is_applied_or_reported():
    body = convo("a", "b")
    assert apply(body, size) == (body, None)
    assert edited(body)[1] == []


def test_clear_thinking_keeps_the_last_turns_asked_and_reports_what_went():
    body = convo("a", "b", "c")
    out, applied = edited(body, {"type": "clear_thinking_20251015"})  # default: the last turn keeps it
    assert thinking_turns(out) == 1 and applied[0]["cleared_thinking_turns"] == 2
    assert applied[0]["cleared_input_tokens"] == size(body) - size(out) > 0
    out, applied = edited(body, {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}})
    assert thinking_turns(out) == 2 and applied[0]["cleared_thinking_turns"] == 1
    for keep in ("all", {"type": "all"}):  # Claude Code's: nothing goes
        out, applied = edited(body, {"type": "clear_thinking_20251015", "keep": keep})
        assert out["messages"] == body["messages"] and applied == []


def test_clear_tool_uses_past_the_trigger_clears_the_older_results_but_the_excluded_ones():
    body = convo("read_file", "bash", "read_file", "read_file")
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
            "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["bash"], "clear_tool_inputs": True}
    out, applied = edited(body, edit)
    results = [b for m in out["messages"] for b in m["content"] if isinstance(m["content"], list) and b["type"] == "tool_result"]
    uses = [b for m in out["messages"] for b in m["content"] if isinstance(m["content"], list) and b["type"] == "tool_use"]
    assert [r["content"] == CLEARED for r in results] == [True, False, True, False]  # bash's and the last kept
    assert [u["input"] == {} for u in uses] == [True, False, True, False]
    assert applied == [{"type": "clear_tool_uses_20250919", "cleared_tool_uses": 2,
                        "cleared_input_tokens": size(body) - size(out)}]
    # under the trigger (default: 100,000 input tokens) nothing is cleared
    assert edited(body, {"type": "clear_tool_uses_20250919"})[1] == []
    # clear_at_least more than it would clear: left as it was
    out, applied = edited(body, {**edit, "clear_at_least": {"type": "input_tokens", "value": 10**6}})
    assert out["messages"] == body["messages"] and applied == []


def test_edits_apply_in_order_each_measured_from_the_one_before():
    body = convo("a", "b", "c", "d")  # four uses: the default keeps the last three
    out, applied = edited(body, {"type": "clear_thinking_20251015"},
                          {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 10}})
    assert [a["type"] for a in applied] == ["clear_thinking_20251015", "clear_tool_uses_20250919"]
    assert sum(a["cleared_input_tokens"] for a in applied) == size(body) - size(out)


@pytest.mark.parametrize("config", [
    [], {"edits": {}}, {"edits": [{"type": "clear_everything"}]}, {"edits": ["clear_thinking_20251015"]},
    {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": -1}}]},
    {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens"}}]},
    {"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": True}}]},
    {"edits": [{"type": "clear_tool_uses_20250919", "exclude_tools": "bash"}]},
    {"edits": [{"type": "clear_tool_uses_20250919", "clear_tool_inputs": "yes"}]},
])
def test_a_bad_edit_is_a_400_naming_it(config):
    with pytest.raises(ApiError) as err:
        apply({**convo("a", "b", "c", "d"), "context_management": config}, size)
    assert err.value.status == 400 and err.value.param.startswith("context_management")


def test_malformed_messages_are_left_for_the_parser_to_refuse():
    body = convo("a", "b", "c", "d")
    body["messages"] += ["junk", {"role": "assistant", "content": [7, {"type": "tool_use", "id": ["x"], "name": "f"}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": {"a": 1}}]}]
    out, applied = edited(body, {"type": "clear_thinking_20251015"},
                          {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 0}})
    assert out["messages"][-3:] == body["messages"][-3:] and [a["type"] for a in applied] == [
        "clear_thinking_20251015", "clear_tool_uses_20250919"]
