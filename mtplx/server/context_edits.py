"""Anthropic's context-management edits (`context_management.edits`), applied to the request's
messages before the prompt is rendered, and reported as the API reports them.

- `clear_thinking_20251015`: thinking blocks are dropped from all but the last `keep` assistant
  turns that have them (default the last one; `"all"` keeps every one: Claude Code's default).
- `clear_tool_uses_20250919`: once the prompt passes the `trigger` (default 100,000 input tokens,
  or a number of tool uses), the results of all but the most recent `keep` tool uses (default 3)
  are replaced by a short placeholder, and with `clear_tool_inputs` their inputs too; uses of
  `exclude_tools` are left; with `clear_at_least`, only when that many tokens go.
On a local model with a window of 32k or 64k tokens, this is what keeps a long agent session
inside it. The bank then restores the cleared conversation by its own tokens, as any other.

Token counts are the server's own: the prompt rendered before and after (`count`). An edit that
changed nothing is not reported. `compact_20260112` (automatic compaction) is accepted and not
applied: a prompt over the window is still refused, and the client may ask for a compaction.
"""

from __future__ import annotations

import copy
from typing import Callable

from mtplx.server.api_error import bad_request

CLEARED = "[tool result cleared to save context]"
KINDS = ("clear_thinking_20251015", "clear_tool_uses_20250919", "compact_20260112")


def edits_of(body: dict) -> list[dict] | None:
    """The request's edits (None when it has no context_management), each checked."""
    config = body.get("context_management")
    if config is None:
        return None
    edits = config.get("edits", []) if isinstance(config, dict) else None
    if not isinstance(edits, list):
        raise bad_request("context_management must be {'edits': [...]}", "context_management")
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind not in KINDS:
            raise bad_request(f"context_management.edits[{i}].type must be one of {list(KINDS)}",
                              f"context_management.edits[{i}].type")
    return edits


def _count_of(spec, kinds: tuple[str, ...], default: int | None, param: str) -> tuple[str | None, int | None]:
    if spec is None:
        return (kinds[0], default) if default is not None else (None, None)
    if not isinstance(spec, dict) or spec.get("type") not in kinds or \
            (spec["type"] != "all" and (not isinstance(spec.get("value"), int) or isinstance(spec.get("value"), bool)
                                        or spec["value"] < 0)):
        raise bad_request(f"{param} must be {{'type': {' or '.join(repr(k) for k in kinds)}, 'value': n}}", param)
    return spec["type"], spec.get("value")


def _blocks(message) -> list:
    """A message's content blocks; nothing for a malformed message (the parser answers it a 400)."""
    content = message.get("content") if isinstance(message, dict) else None
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def clear_thinking(messages: list[dict], edit: dict, param: str) -> int:
    """Drop thinking from all but the last `keep` assistant turns with some; the turns cleared."""
    keep = edit.get("keep")
    if keep == "all":
        return 0
    kind, value = _count_of(keep, ("thinking_turns", "all"), 1, f"{param}.keep")
    if kind == "all":
        return 0
    thinking = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"
                and any(b.get("type") in ("thinking", "redacted_thinking") for b in _blocks(m))]
    cleared = thinking[: max(0, len(thinking) - value)]
    for m in cleared:
        m["content"] = [b for b in m["content"] if not (isinstance(b, dict) and b.get("type") in ("thinking", "redacted_thinking"))]
    return len(cleared)


def _uses(messages: list[dict]) -> list[tuple[dict, list[dict]]]:
    """Each tool_use block with the tool_result blocks that answer it, oldest first."""
    results: dict[str, list[dict]] = {}
    for m in messages:
        for b in _blocks(m):
            if b.get("type") == "tool_result" and isinstance(b.get("tool_use_id"), str):
                results.setdefault(b["tool_use_id"], []).append(b)
    return [(b, results.get(b["id"], []) if isinstance(b.get("id"), str) else []) for m in messages
            if isinstance(m, dict) and m.get("role") == "assistant" for b in _blocks(m) if b.get("type") == "tool_use"]


def clear_tool_uses(messages: list[dict], edit: dict, param: str, tokens: int) -> int:
    """Clear the older tool uses once the trigger is passed; the uses cleared."""
    kind, value = _count_of(edit.get("trigger"), ("input_tokens", "tool_uses"), 100_000, f"{param}.trigger")
    _, keep = _count_of(edit.get("keep"), ("tool_uses",), 3, f"{param}.keep")
    exclude = edit.get("exclude_tools") or []
    inputs = edit.get("clear_tool_inputs") or False
    if not isinstance(exclude, list) or not all(isinstance(n, str) for n in exclude):
        raise bad_request(f"{param}.exclude_tools must be a list of tool names", f"{param}.exclude_tools")
    if not isinstance(inputs, bool) and not (isinstance(inputs, list) and all(isinstance(n, str) for n in inputs)):
        raise bad_request(f"{param}.clear_tool_inputs must be a boolean or a list of tool names", f"{param}.clear_tool_inputs")
    uses = _uses(messages)
    if (tokens if kind == "input_tokens" else len(uses)) <= value:
        return 0
    older = uses[: max(0, len(uses) - keep)]
    cleared = 0
    for use, results in older:
        if use.get("name") in exclude:
            continue
        for result in results:
            result["content"] = CLEARED
        if inputs is True or (isinstance(inputs, list) and use.get("name") in inputs):
            use["input"] = {}
        cleared += 1
    return cleared


def apply(body: dict, count: Callable[[dict], int]) -> tuple[dict, list[dict] | None]:
    """The request with its edits applied in order, and the applied edits as the reply reports
    them (None when the request has no context_management). `count`: a body's prompt tokens."""
    edits = edits_of(body)
    if edits is None:
        return body, None
    current, tokens, applied = body, None, []
    for i, edit in enumerate(edits):
        param = f"context_management.edits[{i}]"
        if edit["type"] == "compact_20260112":
            continue  # see the module's note
        if edit["type"] == "clear_thinking_20251015" and edit.get("keep") in ("all", {"type": "all"}):
            continue  # Claude Code's default: nothing to clear, and no copy of a long conversation
        trial = {**current, "messages": copy.deepcopy(current.get("messages"))}
        messages = trial["messages"] if isinstance(trial["messages"], list) else []
        floor = 0
        if edit["type"] == "clear_thinking_20251015":
            changed = clear_thinking(messages, edit, param)
            report = {"cleared_thinking_turns": changed}
        else:
            if edit.get("clear_at_least") is not None:
                _, floor = _count_of(edit["clear_at_least"], ("input_tokens",), None, f"{param}.clear_at_least")
            tokens = count(current) if tokens is None else tokens
            changed = clear_tool_uses(messages, edit, param, tokens)
            report = {"cleared_tool_uses": changed}
        if not changed:
            continue
        tokens = count(current) if tokens is None else tokens
        after = count(trial)
        if tokens - after < floor:  # not worth clearing: the conversation stays as it was
            continue
        applied.append({"type": edit["type"], **report, "cleared_input_tokens": max(0, tokens - after)})
        current, tokens = trial, after
    return current, applied
