"""Responses' namespace tools: functions grouped under one name, such as Codex's sub-agent tools
(`{"type": "namespace", "name": "multi_agent_v1", "tools": [{"type": "function", ...}]}`).

The model sees each function of a namespace as a tool of its own. A call comes back as a
`function_call` item with the function's own `name` and the group's `namespace`: Codex runs a
call only when both match what it declared ("unsupported call" otherwise). A function keeps its
own name in the prompt unless another tool has that name too; then it is `namespace.name`, so the
model's call always names one tool."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def _functions(tool: dict) -> list[dict]:
    inner = tool.get("tools")
    return [t for t in inner if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)] \
        if isinstance(inner, list) else []


def _is_namespace(tool) -> bool:
    return isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("name"), str)


@dataclass(frozen=True)
class ToolNames:
    """Which prompt name stands for which (namespace, function), both ways."""

    origin: dict[str, tuple[str, str]] = field(default_factory=dict)  # prompt name -> (namespace, function)
    prompt: dict[tuple[str, str], str] = field(default_factory=dict)

    @classmethod
    def of(cls, tools) -> ToolNames:
        """From a request's `tools` as sent; what is malformed is left out (the parser rejects it)."""
        if not isinstance(tools, list):
            return cls()
        plain = [t["name"] for t in tools if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)]
        grouped = [(t["name"], f["name"]) for t in tools if _is_namespace(t) for f in _functions(t)]
        count = Counter(plain + [name for _, name in grouped])
        names = cls()
        for namespace, name in grouped:
            shown = name if count[name] == 1 else f"{namespace}.{name}"
            names.origin[shown] = (namespace, name)
            names.prompt[(namespace, name)] = shown
        return names

    def shown(self, namespace: str | None, name: str) -> str:
        """The prompt's name for a call the client sends back."""
        return self.prompt.get((namespace, name), name) if namespace else name

    def called(self, shown: str) -> tuple[str | None, str]:
        """(namespace or None, function name) of a call the model wrote."""
        return self.origin.get(shown, (None, shown))


def described(tool: dict, names: ToolNames) -> list[dict]:
    """A namespace's functions as chat tools, each description led by the group's."""
    about = tool.get("description") if isinstance(tool.get("description"), str) else ""
    out = []
    for f in _functions(tool):
        own = f.get("description") if isinstance(f.get("description"), str) else ""
        text = " ".join(s for s in (f"[{tool['name']}: {about}]" if about else f"[{tool['name']}]", own) if s)
        out.append({"type": "function", "function": {"name": names.shown(tool["name"], f["name"]), "description": text,
                                                     "parameters": f.get("parameters") or {"type": "object"}}})
    return out


def strict_shown(tools, names: ToolNames) -> tuple[str, ...]:
    """The prompt names of namespace functions marked `strict: true`: their calls are held to
    their schema, as a top-level strict tool's are."""
    return tuple(names.shown(t["name"], f["name"]) for t in (tools if isinstance(tools, list) else ())
                 if _is_namespace(t) for f in _functions(t) if f.get("strict") is True)
