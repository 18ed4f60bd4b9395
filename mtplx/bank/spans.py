"""Where each message sits in a ChatML prompt, and the turn's reuse ceiling.

Pure token work: turns start at `<|im_start|>`; a run of tool messages shares one user turn (the
template wraps them together); the system message and tools share the first turn.
"""

from __future__ import annotations

from mtplx.bank.anchors import Markers
from mtplx.bank.plan import MessageSpan


def message_spans(prompt, messages: list[dict], markers: Markers) -> list[MessageSpan]:
    if markers.im_start is None:
        return []
    starts = [i for i, t in enumerate(prompt) if t == markers.im_start] + [len(prompt)]
    spans, turn = [], -1
    for k, m in enumerate(messages):
        if not (m.get("role") == "tool" and k > 0 and messages[k - 1].get("role") == "tool"):
            turn += 1
        if turn + 1 >= len(starts):
            break
        spans.append(MessageSpan(k, m.get("role", "?"), starts[turn], starts[turn + 1]))
    return spans


def reuse_ceiling(spans: list[MessageSpan], messages: list[dict], head: int | None) -> int:
    """Tokens before the first new message: everything after the last assistant message is new;
    a conversation with no assistant message yet can reuse at most its system/tools head."""
    last_assistant = max((k for k, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last_assistant is None:
        return head or 0
    for span in spans:
        if span.index > last_assistant:
            return span.start
    return spans[-1].end if spans else 0
