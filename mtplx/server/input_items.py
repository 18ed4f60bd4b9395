"""A stored response's input items, as `GET /v1/responses/{id}/input_items` lists them.

The request's `input` is kept as the client sent it, item by item, each given an id where it had
none (a plain string input is one user message). The listing pages through them as OpenAI's does:
`limit` 1-100 (20), `order` "desc" (newest first, the default) or "asc", `after` an item id.
"""

from __future__ import annotations

import uuid

from mtplx.server.api_error import bad_request

_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
           "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}


def of_request(body: dict) -> list[dict]:
    """The request's input items, ids filled in (the request was parsed already: items are objects)."""
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    items = []
    for item in raw if isinstance(raw, list) else []:
        item = {"type": "message", **item}
        if isinstance(item.get("content"), str) and item["type"] == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if not isinstance(item.get("id"), str) or not item["id"]:
            item = {"id": f"{_PREFIX.get(item['type'], 'item')}_{uuid.uuid4().hex[:24]}", **item}
        if item["type"] in ("message", "function_call", "function_call_output"):
            item.setdefault("status", "completed")  # as the API lists items it was given
        items.append(item)
    return items


def page(items: list[dict], query) -> dict:
    """One page of `items` for the query parameters (a mapping of strings); 400 on a bad one."""
    limit = query.get("limit", "20")
    if not (isinstance(limit, str) and limit.isdigit() and 1 <= int(limit) <= 100):
        raise bad_request(f"limit must be an integer in 1..100, got {limit!r}", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item.get("id") == after), None)
        if at is None:
            raise bad_request(f"after names no input item of this response: {after!r}", "after")
        ordered = ordered[at + 1:]
    shown = ordered[: int(limit)]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(ordered) > len(shown)}
