"""Tool-call arguments in one canonical spelling, so a call a client re-serialises (compact or
spaced JSON, escaped or raw Unicode) renders to the same tokens as the model's own call and the
session bank still restores past it. The spelling is `json.dumps(..., ensure_ascii=False)`, the
one the templates' `tojson` and the model's training calls use; key order is kept."""

from __future__ import annotations

import json


def canonical(arguments) -> str:
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        return json.dumps(arguments, ensure_ascii=False)
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments  # not JSON: the model's text as the client kept it
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else arguments
