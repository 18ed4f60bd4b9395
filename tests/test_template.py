"""The embedded template behaves like Qwen3's, including the ways it rewrites history."""

from __future__ import annotations

import json

from mtplx.chat import head_end, message_boundaries, render
from mtplx.synth.heads import HEADS, tools_for

TOOLS = tools_for(HEADS[0])
CALL = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}
TOOL_TURN = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Read a.py"},
    {"role": "assistant", "content": "", "reasoning_content": "I should read it.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
]


def text(tokenizer, messages, **kw):
    return tokenizer.decode(render(tokenizer, messages, TOOLS, **kw))


def test_tools_live_in_the_system_turn(tokenizer):
    out = text(tokenizer, TOOL_TURN[:2])
    system = out.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are an agent.") and '"name": "read_file"' in system


def test_tool_call_and_result_markup(tokenizer):
    out = text(tokenizer, TOOL_TURN)
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>' in out
    assert "<|im_start|>user\n<tool_response>\nprint(1)\n</tool_response><|im_end|>" in out


def test_reasoning_kept_after_last_user_then_stripped(tokenizer):
    assert "<think>\nI should read it.\n</think>" in text(tokenizer, TOOL_TURN)
    later = TOOL_TURN + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks"}]
    assert "I should read it." not in text(tokenizer, later)


def test_tool_call_arguments_are_reserialised(tokenizer):
    compact = dict(CALL, function={"name": "read_file", "arguments": json.loads('{"path":"a.py"}')})
    spaced = text(tokenizer, TOOL_TURN[:2] + [{"role": "assistant", "content": "", "tool_calls": [compact]}])
    assert '"arguments": {"path": "a.py"}' in spaced  # a client's compact JSON comes back re-serialised


def test_enable_thinking_false_prefills_empty_think(tokenizer):
    assert text(tokenizer, TOOL_TURN[:2], enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert text(tokenizer, TOOL_TURN[:2]).endswith("<|im_start|>assistant\n")


def test_prefix_property_by_message(tokenizer):
    """messages[:k] is a token prefix of messages[:k+1] except where the template rewrites."""
    convo = TOOL_TURN + [{"role": "assistant", "content": "It prints 1.", "reasoning_content": "Simple."},
                         {"role": "user", "content": "And b.py?"}]
    prompt = render(tokenizer, convo, TOOLS)
    valid = {b.message_index: b.valid for b in message_boundaries(tokenizer, convo, TOOLS, prompt)}
    # system, user: prefixes. The assistant turns of the first exchange were rendered with
    # reasoning when they were last; the new user message strips it, so those ends are not.
    assert valid == {1: True, 2: True, 3: False, 4: False, 5: False, 6: True}


def test_consecutive_tool_results_merge_into_one_turn(tokenizer):
    two_calls = dict(TOOL_TURN[2], tool_calls=[CALL, dict(CALL, id="c2")])
    convo = TOOL_TURN[:2] + [two_calls, {"role": "tool", "content": "x"}, {"role": "tool", "content": "y"}]
    prompt = render(tokenizer, convo, TOOLS, add_generation_prompt=False)
    valid = {b.message_index: b.valid for b in message_boundaries(tokenizer, convo, TOOLS, prompt)}
    assert valid[4] is False and valid[5] is True  # the first result's <|im_end|> moves after the second


def test_head_end_is_the_system_turn(tokenizer):
    prompt = render(tokenizer, TOOL_TURN[:2], TOOLS)
    end = head_end(tokenizer, prompt)
    assert tokenizer.decode(prompt[:end]).endswith("</tool_call><|im_end|>\n")
    assert tokenizer.decode(prompt[end:]).startswith("<|im_start|>user")
    assert head_end(tokenizer, render(tokenizer, TOOL_TURN[1:2], None)) is None


def test_last_assistant_without_reasoning_gets_an_empty_think_block_only_while_last(tokenizer):
    convo = TOOL_TURN[:2] + [{"role": "assistant", "content": "Done."}]
    assert "<think>\n\n</think>\n\nDone." in text(tokenizer, convo, add_generation_prompt=False)
    later = convo + [{"role": "user", "content": "Thanks"}]
    assert "<think>" not in text(tokenizer, later).split("Read a.py")[1].split("Thanks")[0]
