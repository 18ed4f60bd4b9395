"""A reply that continues text the client wrote: Anthropic's prefilled assistant turn (a final
assistant message is where Claude's reply starts), and vLLM's `continue_final_message` on chat.

The conversation before it is rendered as for any turn, with the generation prompt and reasoning
off (the prefill is the answer itself, so no reasoning block may come before it), and the prefill's
tokens follow (`chat.with_prefill`). So the rendered part is the same prefix a normal turn of that conversation has,
and the session bank restores it. The reply the client gets is only what comes after the prefill,
as Anthropic answers.
"""

from __future__ import annotations

from mtplx.server.api_error import bad_request


def split(messages: list[dict], thinking: bool | None, param: str = "messages") -> tuple[list[dict], str, bool]:
    """(the conversation before the prefill, the prefill's text, enable_thinking) for a
    conversation whose last message is the assistant turn to continue."""
    last = messages[-1] if messages else None
    p = f"{param}[{len(messages) - 1}]"
    if last is None or last.get("role") != "assistant":
        raise bad_request("continuing the final message needs it to be an assistant turn", param)
    if last.get("tool_calls") or last.get("reasoning_content"):
        raise bad_request(f"{p}: a prefilled assistant turn (the last message) must be text only, "
                          "without tool calls or reasoning", p)
    if len(messages) < 2:
        raise bad_request(f"{p}: a prefilled assistant turn needs a conversation before it", p)
    if thinking:
        raise bad_request("thinking cannot be enabled with a prefilled assistant turn (the reply continues the "
                          "given text, so no reasoning can come first)", "thinking")
    content = last.get("content")
    return messages[:-1], content if isinstance(content, str) else "", False

