"""Rendering conversations to tokens, finding where complete messages end in them, and turning
chat input into a GenerationRequest (`chat_request`, the one place that does it).

A message boundary is only an anchor if it is an *exact token prefix* of the final prompt:
rendering `messages[:k]` must give tokens that the full render starts with. Qwen3-style templates
break this in known ways (earlier reasoning dropped once a new user message arrives, consecutive
tool results merged into one user turn), so every candidate is checked and a rejected one says why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mtplx import chat_template
from mtplx.tool_formats import template_iterates_arguments, template_reads_thinking, template_reads_thinking_switch

@dataclass(frozen=True)
class Boundary:
    message_index: int  # boundary after messages[:message_index]
    offset: int | None  # token offset in the full prompt, None when rejected
    reason: str | None = None  # why it was rejected

    @property
    def valid(self) -> bool:
        return self.offset is not None


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, *,
           add_generation_prompt: bool = True, enable_thinking: bool | None = None,
           template_kwargs: dict | None = None) -> list[int]:
    """`template_kwargs`: further variables for the template (a request's `chat_template_kwargs`,
    a reasoning effort as `reasoning_effort`: gpt-oss's `Reasoning:` line); a template ignores
    the ones it does not read. `enable_thinking` also reaches a template that reads a plain
    `thinking` switch (DeepSeek V3.1's) unless the request set that one itself."""
    kwargs = dict(template_kwargs or {})
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
        if "thinking" not in kwargs and template_reads_thinking_switch(chat_template.text(tokenizer)):
            kwargs["thinking"] = enable_thinking
    from mtplx.reply_ids import ReplyIds, encode_spliced
    from mtplx.tool_prompt import described

    messages = described(tokenizer, messages, tools)  # a template that drops tools: they go in the system prompt

    template = chat_template.text(tokenizer)
    if template_iterates_arguments(template):
        messages = [_arguments_as_mapping(m) for m in messages]
    if template_reads_thinking(template):
        messages = [_reasoning_as_thinking(m) for m in messages]
    replies = ReplyIds.of(tokenizer)
    if replies.has_any(messages):
        # A reply this model generated comes back as text: its span keeps the generated ids (reply_ids.py)
        text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **chat_template.variables(tokenizer, kwargs))
        splices = replies.splices(messages, text, getattr(tokenizer, "eos_token", None))
        if splices:
            return encode_spliced(tokenizer, text, splices)
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, **chat_template.variables(tokenizer, {"return_dict": False, **kwargs}))
    return list(ids)


def chat_request(tokenizer, messages: list[dict], tools: list[dict] | None = None, *, sampling=None,
                 enable_thinking: bool | None = None, prompt: list[int] | None = None, prefill: str | None = None,
                 template_kwargs: dict | None = None, **fields):
    """The one way chat input becomes a GenerationRequest (server routes, TUI chat and replay, CLI
    generate, agents in tests and benches): the prompt rendered with the template (or `prompt`,
    when the caller rendered it already, e.g. through the server's encode cache) and the chat kept
    on the request, where the bank reads its messages and the engine its tool schemas. `prefill`:
    text the reply continues (server/prefill.py), after the rendered messages.
    `fields`: the request's other fields (session, source, tool_rule, raw, arm, use_mtp, depth)."""
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.sampling import SamplingParams

    if prompt is None:
        prompt = render(tokenizer, messages, tools, enable_thinking=enable_thinking, template_kwargs=template_kwargs)
        prompt = with_prefill(tokenizer, prompt, prefill)
    chat = {"messages": list(messages), "tools": tools, "enable_thinking": enable_thinking}
    if template_kwargs:  # the bank's re-renderings (render-ahead) use the same variables
        chat["template_kwargs"] = dict(template_kwargs)
    if prefill is not None:
        chat["prefill"] = prefill
    return GenerationRequest(tuple(prompt), sampling or SamplingParams(), chat=chat, **fields)


def with_prefill(tokenizer, head: list[int], text: str | None) -> list[int]:
    """A rendered conversation, then the prefill's own tokens (encoded alone, so the head stays
    exactly the prefix every other turn of the conversation renders)."""
    return list(head) + list(tokenizer.encode(text, add_special_tokens=False)) if text else list(head)


def sent_back(tokenizer, chat: dict | None, reply: dict, ids, prompt) -> tuple[dict, list[int]]:
    """A reply and its ids as the client's history will carry them. After a prefill (the reply
    continued text the client wrote, which ends the prompt) that text leads the message the client
    sends back, so it leads here too: the bank compares that message, and reply_ids splices it."""
    text = (chat or {}).get("prefill")
    if not text:
        return reply, list(ids)
    lead = list(prompt)[len(prompt) - len(tokenizer.encode(text, add_special_tokens=False)):]
    return {**reply, "content": text + (reply.get("content") or "")}, lead + list(ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def message_boundaries(tokenizer, messages: list[dict], tools: list[dict] | None, prompt: list[int],
                       enable_thinking: bool | None = None) -> list[Boundary]:
    """Each complete-message end, validated as an exact token prefix of `prompt`."""
    out = []
    for k in range(1, len(messages) + 1):
        try:
            partial = render(tokenizer, messages[:k], tools, add_generation_prompt=False, enable_thinking=enable_thinking)
        except Exception as exc:  # a template may refuse a partial conversation (e.g. no user turn yet)
            out.append(Boundary(k, None, f"template cannot render messages[:{k}]: {type(exc).__name__}"))
            continue
        same = common_prefix(partial, prompt)
        if same == len(partial) and len(partial) <= len(prompt):
            out.append(Boundary(k, len(partial)))
        else:
            out.append(Boundary(k, None, f"rendering messages[:{k}] differs from the prompt at token {same} of {len(partial)}"))
    return out


def head_end(tokenizer, prompt: list[int], markers=None) -> int | None:
    """End of the leading system turn (system prompt + tools) found from the template's turn
    markers, or None. Pass `markers` when calling per prompt: finding them renders probe chats."""
    from mtplx.bank.anchors import Markers, head_end as head_of, turn_ends

    markers = markers or Markers.from_tokenizer(tokenizer)
    return head_of(prompt, markers, turn_ends(prompt, markers))


def _reasoning_as_thinking(message: dict) -> dict:
    """An assistant turn's `reasoning_content` as `thinking`, for gpt-oss's template. A tool-calling
    turn that also has content keeps only its content: that template refuses a call turn with both."""
    if message.get("role") != "assistant" or "thinking" in message or not message.get("reasoning_content"):
        return message
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    if message.get("tool_calls") and message.get("content"):
        return out
    return {**out, "thinking": message["reasoning_content"]}


def _arguments_as_mapping(message: dict) -> dict:
    """A message whose tool-call arguments (JSON strings, as OpenAI clients send them) are parsed
    into mappings, for templates that iterate them; text that is not a JSON object stays as is."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**fn, "arguments": parsed}}
        out.append(call)
    return {**message, "tool_calls": out}
