"""System prompts and tool schemas: the "session heads" agents resend every turn.

Several distinct heads exist so that the bank sees different system+tools prefixes, and so
that a new session sharing a long head with an old one is a realistic case.
"""

from __future__ import annotations


def _tool(name: str, description: str, params: dict[str, tuple[str, str]], required: list[str]) -> dict:
    props = {key: {"type": kind, "description": text} for key, (kind, text) in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


TOOLS: dict[str, dict] = {
    "read_file": _tool(
        "read_file",
        "Read a text file from the workspace and return its contents.",
        {"path": ("string", "Path relative to the workspace root.")},
        ["path"],
    ),
    "write_file": _tool(
        "write_file",
        "Create or overwrite a file in the workspace with the given contents.",
        {"path": ("string", "Path relative to the workspace root."), "content": ("string", "The full new file contents.")},
        ["path", "content"],
    ),
    "run_shell": _tool(
        "run_shell",
        "Run a shell command in the workspace and return its output and exit code.",
        {"command": ("string", "The command line to run."), "timeout": ("integer", "Seconds before the command is stopped.")},
        ["command"],
    ),
    "search": _tool(
        "search",
        "Search the workspace for a regular expression and return matching lines.",
        {"pattern": ("string", "A regular expression."), "path": ("string", "Folder to search in.")},
        ["pattern"],
    ),
    "list_dir": _tool(
        "list_dir",
        "List the entries of a folder in the workspace.",
        {"path": ("string", "Folder path relative to the workspace root.")},
        ["path"],
    ),
    "edit_file": _tool(
        "edit_file",
        "Replace one exact occurrence of old text with new text in a file.",
        {"path": ("string", "File to edit."), "old": ("string", "Exact text to replace."), "new": ("string", "Replacement text.")},
        ["path", "old", "new"],
    ),
}


HEADS: list[dict] = [
    {
        "name": "coder",
        "system": (
            "You are a careful coding agent working inside a software repository. Think before you act, "
            "use the tools to inspect files and run commands, and never guess the contents of a file you "
            "have not read. When the task is done, summarise what you changed and why."
        ),
        "tools": ["read_file", "write_file", "run_shell", "search", "list_dir"],
    },
    {
        "name": "reviewer",
        "system": (
            "You are a code reviewer. Read the relevant files, run the test suite when it helps, and report "
            "problems with file names and line references. Prefer small, concrete suggestions."
        ),
        "tools": ["read_file", "run_shell", "search"],
    },
    {
        "name": "maintainer",
        "system": (
            "You are the maintainer's assistant for a Python project. You fix bugs, keep tests green and "
            "explain your reasoning briefly. Use edit_file for small changes and write_file for new files. "
            "Always run the tests after an edit."
        ),
        "tools": ["read_file", "edit_file", "write_file", "run_shell", "search", "list_dir"],
    },
    {
        "name": "ops",
        "system": (
            "You are an operations agent. You inspect logs and configuration, run diagnostic commands and "
            "propose the smallest safe fix. Explain each command before you run it."
        ),
        "tools": ["run_shell", "read_file", "list_dir"],
    },
]


def tools_for(head: dict) -> list[dict]:
    """The OpenAI-style tool list of a head, in its fixed order."""
    return [TOOLS[name] for name in head["tools"]]
