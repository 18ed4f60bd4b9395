"""Anthropic's server-side compaction (`compaction: {"type": "summarize", "instructions"?}`, the
SDK tool runner's `compact_before_next_turn()`): the whole conversation is summarised, and the
reply is one signed `compaction` block with stop reason "compaction". A later request sends the
block back first in `messages`, in place of what it summarises.

The summary is asked for as one more user turn after the conversation, so the prompt begins with
the conversation exactly as its last turn rendered it and the session bank restores all of that;
only the request itself is computed. Thinking is off and no tool may be called: a summary is text.
A block sent back reaches the model as a user turn that says what it is (a summary leads the
conversation, and chat templates want a user turn first); a block whose content is null (a
failed compaction) is nothing, as the API treats it.
"""

from __future__ import annotations

from mtplx.server.api_error import bad_request

DEFAULT_INSTRUCTIONS = (
    "Write a summary of the conversation so far, to replace it: the task and its goal, what has been "
    "done and found (files, commands, results, decisions), what is still open, and anything the next "
    "step needs to know. Write only the summary.")


def asked(body: dict) -> str | None:
    """The summarising instructions when the request asks for a compaction, else None."""
    config = body.get("compaction")
    if config is None:
        return None
    if not isinstance(config, dict) or config.get("type") != "summarize":
        raise bad_request("compaction must be {'type': 'summarize', 'instructions'?: ...}", "compaction")
    instructions = config.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("compaction.instructions must be a string", "compaction.instructions")
    return instructions if instructions and instructions.strip() else DEFAULT_INSTRUCTIONS


def summary_turn(instructions: str) -> dict:
    return {"role": "user", "content": instructions}


def sent_back(block: dict) -> str | None:
    """A compaction block in a request, as the text of the user turn that stands for it."""
    content = block.get("content")
    if content is None:
        return None
    if not isinstance(content, str) or not content:
        raise bad_request("a compaction block's content must be a non-empty string or null", "messages")
    return f"<summary of the earlier conversation>\n{content}\n</summary>"


def block(summary: str, signer) -> dict:
    """The reply's one block (content null when the model wrote nothing, as a failed compaction)."""
    if not summary.strip():
        return {"type": "compaction", "content": None, "signature": None}
    return {"type": "compaction", "content": summary, "signature": signer.sign(summary)}
