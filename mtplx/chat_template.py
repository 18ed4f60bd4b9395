"""A tokenizer's chat template as mtplx reads it: Jinja text (tokenizer_config.json or
chat_template.jinja), or a Python renderer that mlx-lm picks by the tokenizer config's
`chat_template_type` (DeepSeek-V3.2, whose release ships an encoder instead of a template).

A Python renderer has no text to inspect and takes only the variables its function names:
`variables` keeps those (a Jinja template ignores unknown variables; a Python function raises on
them), and `identity` names it for caches keyed by the template.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys

# apply_chat_template's own switches that mlx-lm's wrapper handles before a Python renderer runs
_WRAPPER = frozenset({"tokenize", "enable_thinking"})


def renderer(tokenizer):
    """mlx-lm's Python chat-template function for this tokenizer, or None (a Jinja template or none)."""
    fn = getattr(tokenizer, "_chat_template", None)
    return fn if callable(fn) else None


def text(tokenizer) -> str | None:
    """The Jinja template that renders this tokenizer's chats, or None (none, or a Python renderer)."""
    if renderer(tokenizer) is not None:
        return None
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) and template else None


def present(tokenizer) -> bool:
    return renderer(tokenizer) is not None or text(tokenizer) is not None


def renderer_name(tokenizer) -> str | None:
    """The Python renderer's module name ("deepseek_v32"), or None."""
    fn = renderer(tokenizer)
    return fn.__module__.rsplit(".", 1)[-1] if fn is not None else None


def identity(tokenizer) -> str:
    """What renders this tokenizer's chats, as a string: the Jinja text, or the Python renderer's
    module and a digest of its source (a new mlx-lm may render differently)."""
    fn = renderer(tokenizer)
    if fn is None:
        return text(tokenizer) or ""
    module = sys.modules.get(fn.__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        source = ""
    return f"python:{fn.__module__}:{hashlib.sha256(source.encode()).hexdigest()[:16]}"


def variables(tokenizer, kwargs: dict) -> dict:
    """`kwargs` for apply_chat_template, less what a Python renderer does not take."""
    fn = renderer(tokenizer)
    if fn is None:
        return kwargs
    accepted = _accepted(fn)
    return kwargs if accepted is None else {k: v for k, v in kwargs.items() if k in accepted or k in _WRAPPER}


@functools.lru_cache(maxsize=8)  # asked on every render
def _accepted(fn) -> frozenset | None:
    """The keyword arguments `fn` takes; through `**kwargs` to its module's `encode_messages` (how
    mlx-lm's renderers forward them); None when it takes any."""
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        forward = getattr(sys.modules.get(fn.__module__), "encode_messages", None)
        if forward is None or forward is fn:
            return None
        further = _accepted(forward)
        if further is None:
            return None
        names |= further
    return frozenset(names)
