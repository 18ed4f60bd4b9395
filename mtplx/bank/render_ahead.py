"""The renderings a *next* request will use, known as soon as a turn ends.

An agent's next request is this conversation + the reply + either a tool result or a new user
message. The template renders those differently (a new user message strips the reasoning of the
turns since the last one), so each variant is rendered with a throwaway follow-up message and cut
at the follow-up's turn-opening token (the template's own or, in a role-token template, the
follow-up's role token, markers.py): what precedes it is exactly
the next prompt's reusable prefix.
"""

from __future__ import annotations

from mtplx.bank.anchors import turn_starts
from mtplx.bank.markers import Markers
from mtplx.bank.plan import common_prefix
from mtplx.chat import render

_PROBE_A, _PROBE_B = "\u2063a", "\u2063b"  # two contents that differ only past the turn header


def variants(tokenizer, chat: dict, reply: dict, markers: Markers | None = None) -> list[list[int]]:
    """`reply`: the assistant message the engine split the reply into (Finished.reply)."""
    base = list(chat["messages"]) + [reply]
    tools, thinking, variables = chat.get("tools"), chat.get("enable_thinking"), chat.get("template_kwargs")
    markers = markers or Markers.from_tokenizer(tokenizer)
    if markers.turn_start is None and not markers.roles:
        return []
    out: list[list[int]] = []
    # Both follow-ups: clients send tool results even after replies no parser recognised as a call.
    for role in ("tool", "user") if reply.get("tool_calls") else ("user", "tool"):
        try:
            a = render(tokenizer, base + [{"role": role, "content": _PROBE_A}], tools, add_generation_prompt=False,
                       enable_thinking=thinking, template_kwargs=variables)
            b = render(tokenizer, base + [{"role": role, "content": _PROBE_B}], tools, add_generation_prompt=False,
                       enable_thinking=thinking, template_kwargs=variables)
        except Exception:  # a template without this follow-up (Gemma has no tool turn): it cannot come
            continue
        cut = common_prefix(a, b)
        starts = [i for i in turn_starts(a[:cut], markers) if 0 < i < cut]
        if starts and a[: starts[-1]] not in out:
            out.append(a[: starts[-1]])
    return out
