"""The context window a served model offers, and what a request's reply may use of it.

A client's max_tokens is a ceiling it would accept, often a fixed default (Claude Code 32000,
Pi 16384) larger than any small model's window: it is capped at what the window leaves after
the prompt, and the cap is reported. Only a prompt that itself does not fit is refused, and so
is a max_tokens that is no positive integer or above 2**31-1 (a client bug, not a default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mtplx.server.api_error import bad_request

if TYPE_CHECKING:  # `mtplx models` reads trained_window without importing MLX
    from mtplx.engine.sampling import SamplingParams

MAX_TOKENS_CEILING = 2**31 - 1


@dataclass(frozen=True)
class Window:
    tokens: int  # what this server allows (prompt + reply)
    positions: int | None  # the model's max_position_embeddings
    trained: int | None  # the longest sequences the weights were trained on, when known

    def describe(self) -> dict:
        return {"context_window": self.tokens, "max_position_embeddings": self.positions, "trained_window": self.trained}


def window_of(engine) -> Window:
    positions = engine.model_config.get("max_position_embeddings")
    return Window(engine.context_window, int(positions) if positions else None, trained_window(engine.model_path))


def trained_window(model_path: Path) -> int | None:
    """`train_window` from the model's training.json (written by train/train_model.py)."""
    try:
        value = json.loads((Path(model_path) / "training.json").read_text()).get("train_window")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def window_notice(engine) -> str | None:
    """A plain warning when the window goes beyond what the model was built or trained for."""
    w = window_of(engine)
    if w.positions and w.tokens > w.positions:
        return (f"context window {w.tokens} exceeds the model's max_position_embeddings ({w.positions}); "
                f"positions beyond it were never trained" + (f" (it was trained on {w.trained}-token windows)" if w.trained else "")
                + ": expect degraded replies on long prompts")
    if w.trained and w.tokens > w.trained:
        return (f"the model was trained on {w.trained}-token windows; prompts longer than that (context window "
                f"{w.tokens}) run, but with degraded quality")
    return None


def check_max_tokens(value, name: str = "max_tokens") -> int | None:
    """A requested reply budget: None when absent; a 400 when no positive integer or absurd."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value > MAX_TOKENS_CEILING:
        raise bad_request(f"{name} must be an integer in 1..{MAX_TOKENS_CEILING}, got {value!r}", name)
    return value


@dataclass(frozen=True)
class Budget:
    sampling: SamplingParams
    requested: int
    capped: bool


def fit(sampling: SamplingParams, prompt_tokens: int, window: int) -> Budget:
    """The sampling params with max_tokens capped to what the window leaves after the prompt."""
    left = window - prompt_tokens
    if left < 1:
        raise bad_request(f"prompt has {prompt_tokens} tokens; the context window is {window}", "messages",
                          "context_length_exceeded")
    if sampling.max_tokens <= left:
        return Budget(sampling, sampling.max_tokens, False)
    return Budget(replace(sampling, max_tokens=left), sampling.max_tokens, True)
