"""Where each message sits in a prompt, and the turn's reuse ceiling.

Pure token work: turns start at the template's opening token (markers.py); how messages map to
turns is what the probe found: a run of tool messages may share one turn (Qwen wraps them
together), the system message may share the first user turn (Gemma), the template may add turns
of its own before the first message (Llama 3.1's default system turn). In a role-token template
(DeepSeek) a message starts at its role token and the system prompt is the text before the first.
"""

from __future__ import annotations

from mtplx.bank.anchors import Markers, as_tokens, turn_starts
from mtplx.bank.plan import MessageSpan
from mtplx.reply_ids import reply_calls


def message_spans(prompt, messages: list[dict], markers: Markers) -> list[MessageSpan]:
    starts = turn_starts(as_tokens(prompt), markers)
    if not starts:
        return []
    starts = sorted(set(starts) | {len(prompt)})
    has_system = bool(messages) and messages[0].get("role") == "system"
    spans, turn = [], -1 if has_system and not markers.system_bare else markers.lead - 1
    for k, m in enumerate(messages):
        if markers.system_bare and m.get("role") == "system":
            # DeepSeek's template gathers every system message into the text before the first turn
            spans.append(MessageSpan(k, "system", min(markers.preamble, starts[0]), starts[0]))
            continue
        shares = (markers.tools_merged and m.get("role") == "tool" and k > 0 and messages[k - 1].get("role") == "tool") \
            or (markers.system_merged and k == 1 and has_system)
        if not shares:
            turn += 1
        if turn + 1 >= len(starts):
            break
        spans.append(MessageSpan(k, m.get("role", "?"), starts[turn], starts[turn + 1]))
    return spans


def reuse_ceiling(spans: list[MessageSpan], known: int | None, head: int | None) -> int:
    """Tokens before the first message the server could not know when the session's previous turn
    ended (`known` messages were: the previous request's, plus its reply when the client sent that
    back as generated). A session's first request can reuse at most a system/tools head."""
    if known is None:
        return head or 0
    for span in spans:
        if span.index >= known:
            return span.start
    return spans[-1].end if spans else 0


def reuse_ratio(achieved: int | None, ceiling: int | None) -> float | None:
    """achieved / ceiling, capped at 1 (a restore may also cover the generation prompt that opens
    the next message); None for a turn with no ceiling (nothing was knowable before it)."""
    return min(achieved or 0, ceiling) / ceiling if ceiling else None


def same_reply(sent: dict, generated: dict) -> bool:
    """Whether the assistant message a client sent back is the reply the model generated."""
    return (sent.get("role") == "assistant" and (sent.get("content") or "").strip() == (generated.get("content") or "").strip()
            and reply_calls(sent) == reply_calls(generated))
