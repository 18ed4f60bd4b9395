"""Anthropic's client tools (bash, the text editor, memory, computer use): the input schemas the
request leaves out.

A request declares them by type and name alone (`{"type": "bash_20250124", "name": "bash"}`):
Claude was trained on their inputs, so the API sends no schema. A local model was not, and given
a bare `{"type": "object"}` it cannot know that the editor wants `command`, `path` and `old_str`.
So each is described to the model with the inputs Anthropic documents for that version, in our
own words, closed to other keys (the client's runner takes no others); the client runs the calls
as it would Claude's. A declared `input_schema` wins.
"""

from __future__ import annotations

_PATH = {"type": "string", "description": "Absolute path of the file or directory."}


def _editor(commands: list[str]) -> dict:
    return {
        "description": "View, create and edit text files. `view` shows a file with line numbers (or lists a directory); "
                       "`create` writes a new file; `str_replace` replaces `old_str`, which must occur exactly once, "
                       "with `new_str`; `insert` puts `new_str` after line `insert_line` (0: the top)"
                       + ("; `undo_edit` reverts the last edit of `path`." if "undo_edit" in commands else "."),
        "input_schema": {"type": "object", "properties": {
            "command": {"type": "string", "enum": commands},
            "path": _PATH,
            "file_text": {"type": "string", "description": "The new file's content (create)."},
            "old_str": {"type": "string", "description": "The exact text to replace (str_replace)."},
            "new_str": {"type": "string", "description": "The replacement (str_replace) or the text to insert (insert)."},
            "insert_line": {"type": "integer", "description": "The line after which to insert (insert)."},
            "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2,
                           "description": "First and last line to show, 1-based; -1 for the end (view)."},
        }, "required": ["command", "path"], "additionalProperties": False},
    }


_BASH = {
    "description": "Run a command in a persistent bash shell and see its output. `restart: true` starts a fresh shell.",
    "input_schema": {"type": "object", "properties": {
        "command": {"type": "string", "description": "The command line to run."},
        "restart": {"type": "boolean", "description": "Restart the shell instead of running a command."},
    }, "additionalProperties": False},
}

_MEMORY = {
    "description": "Read and write files under /memories that persist between conversations: view, create, "
                   "str_replace, insert, delete, rename.",
    "input_schema": {"type": "object", "properties": {
        "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "delete", "rename"]},
        "path": {"type": "string", "description": "A path under /memories."},
        "file_text": {"type": "string"}, "old_str": {"type": "string"}, "new_str": {"type": "string"},
        "insert_line": {"type": "integer"}, "insert_text": {"type": "string"},
        "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
        "old_path": {"type": "string"}, "new_path": {"type": "string"},
    }, "required": ["command"], "additionalProperties": False},
}

_COMPUTER = {
    "description": "Control the screen, mouse and keyboard: take a screenshot, move and click the mouse at a "
                   "coordinate, type text, press keys, scroll.",
    "input_schema": {"type": "object", "properties": {
        "action": {"type": "string", "enum": ["screenshot", "cursor_position", "mouse_move", "left_click", "right_click",
                                              "middle_click", "double_click", "triple_click", "left_click_drag",
                                              "left_mouse_down", "left_mouse_up", "key", "hold_key", "type", "scroll",
                                              "wait"]},
        "coordinate": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
        "text": {"type": "string", "description": "Text to type, or the key combination (key, hold_key)."},
        "scroll_direction": {"type": "string", "enum": ["up", "down", "left", "right"]},
        "scroll_amount": {"type": "integer"},
        "duration": {"type": "number"},
    }, "required": ["action"], "additionalProperties": False},
}

# By type prefix; the versions differ only in the editor's undo_edit (gone from 2025-04-29 on).
_BY_PREFIX = (
    ("text_editor_20241022", _editor(["view", "create", "str_replace", "insert", "undo_edit"])),
    ("text_editor_20250124", _editor(["view", "create", "str_replace", "insert", "undo_edit"])),
    ("text_editor_", _editor(["view", "create", "str_replace", "insert"])),
    ("bash_", _BASH),
    ("memory_", _MEMORY),
    ("computer_", _COMPUTER),
)


def described(kind) -> dict | None:
    """{"description", "input_schema"} of a client tool type, or None for any other type."""
    if not isinstance(kind, str):
        return None
    return next((spec for prefix, spec in _BY_PREFIX if kind.startswith(prefix)), None)
