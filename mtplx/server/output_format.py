"""Structured output as each API asks for it, held to on the logits (engine/output_rule.py).

- OpenAI chat: `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}; {"type": "text"} is free text.
- OpenAI Responses: `text.format` with the same types ({"type": "json_schema", "name", "schema"}).
- Anthropic Messages: `output_config.format` {"type": "json_schema", "schema"} (Claude Code asks
  for its session titles this way).

Each becomes a JSON schema ("json_object": any object). The schema is compiled for the model's
tokenizer when the request is encoded (a worker thread: the first structured request builds the
tokenizer's index, ~1 s on a 150k vocabulary), so an unusable schema is a 400 before anything
runs, and each turn starts its own matcher from it.
"""

from __future__ import annotations

from mtplx.server.api_error import bad_request

ANY_OBJECT = {"type": "object"}


def from_openai(value, param: str = "response_format") -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(f"{param}.json_schema must be an object with a schema", f"{param}.json_schema")
        return _schema(spec.get("schema", ANY_OBJECT), f"{param}.json_schema.schema")
    raise bad_request(f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", f"{param}.type")


def from_responses(text) -> dict | None:
    """`text.format` ({"type": "json_schema", "name", "schema", "strict"}); `text.verbosity` is
    accepted and not used."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        return _schema(fmt.get("schema", ANY_OBJECT), "text.format.schema")
    return from_openai(fmt, "text.format")


def from_anthropic(config) -> dict | None:
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config.format")
    return fmt["schema"]


def _schema(value, param: str) -> dict:
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema object", param)
    return value


def compile_call(engine, call) -> None:
    """The call's schema compiled for the engine's tokenizer (engine/output_rule.Grammar) into
    `call.grammar`, on a worker thread (turns.encode, the completions route); a 400 naming the
    problem when it cannot be."""
    from mtplx.engine.output_rule import Grammar, ll_tokenizer

    if call.schema is None or call.grammar is not None:
        return
    tokenizer = engine.checkpoint.tokenizer
    try:
        call.grammar = Grammar.from_schema(call.schema, ll_tokenizer(tokenizer, engine.eos_ids), engine.eos_ids)
    except ValueError as exc:
        raise bad_request(f"the JSON schema cannot be used: {exc}", "schema", "invalid_schema") from None


def rule_for(call, rules, tokenizer, starts_in_reasoning: bool):
    """The turn's OutputRule (None without a schema). The model may still call a tool where the
    request offers tools and does not forbid them."""
    if call.schema is None:
        return None
    if call.grammar is None:  # a route that skipped compile_call: never drop the schema silently
        raise RuntimeError("a structured-output call reached submit without its compiled schema")
    if rules is not None and rules.whole and call.call_grammar is not None:
        return None  # a forced call is the whole reply there (gpt-oss, Llama): no room for a document, as with "required"
    from mtplx.engine.output_rule import OutputRule

    may_call = bool(call.tools) and call.tool_choice.mode != "none" and rules is not None
    think = rules.think if rules is not None else think_tokens(tokenizer)
    return OutputRule(call.grammar, think=think, starts_in_reasoning=starts_in_reasoning,
                      call_open=rules.open if may_call else None)


def think_tokens(tokenizer) -> tuple[int, int] | None:
    """The reasoning block's open and close token ids, or None when the tokenizer has none."""
    from mtplx.server.tool_choice import token_id

    pair = (token_id(tokenizer, "<think>"), token_id(tokenizer, "</think>"))
    return None if None in pair else pair
