"""What callers submit to the engine."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from mtplx.engine.sampling import SamplingParams
from mtplx.engine.tool_rule import ToolRule
from mtplx.errors import RequestError


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class GenerationRequest:
    prompt: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=new_request_id)
    use_mtp: bool | None = None  # None: the engine's default
    depth: int | None = None  # None: the engine's default depth
    session: str | None = None
    source: str = "api"  # "tui", "api", "replay", "cli"
    chat: dict | None = None  # {"messages", "tools", "enable_thinking"} when rendered from a chat
    arm: str | None = None  # the A/B arm a replay runs this under
    raw: str | None = None  # the request as the client sent it (kept in the receipt)
    tool_rule: ToolRule | None = None  # may / must the reply call a tool (None: free)
    output_rule: object | None = None  # the reply held to a JSON schema (engine/output_rule.OutputRule)
    reasoning_rule: object | None = None  # the reasoning capped (engine/reasoning_budget.ReasoningBudget)
    call_rule: object | None = None  # an open tool call held to the request's tools (engine/call_rule.CallRule)
    # False: the request's tool_choice is none. Where the format cannot be steered away from a call
    # (gpt-oss, Llama 3.x, DSML, ...: no single opening token), one the model writes anyway reaches
    # the client as text, never as a call it did not allow.
    calls: bool = True
    prediction: tuple[int, ...] = ()  # the predicted output's ids, drafts where the reply follows it
    # Score the prompt: each prompt token's log-probability given the ones before it, with this many
    # alternatives (legacy completions' echo + logprobs). Every position is computed: no restore.
    prompt_logprobs: int | None = None
    # Compute the prompt's state and generate nothing (a cache prewarm, a prompt scored alone): the
    # turn ends with finish "length" after its prefill, and the bank keeps the prompt as it keeps a
    # prefill cut short, so the next request that extends it restores all of it.
    prefill_only: bool = False

    def __post_init__(self):
        if not self.prompt:
            raise RequestError("prompt must not be empty")
        if not all(isinstance(t, int) and t >= 0 for t in self.prompt):
            raise RequestError("prompt must be a sequence of non-negative token ids")
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20):
            raise RequestError(f"prompt_logprobs must be None or an integer in 0..20, got {self.prompt_logprobs!r}")
        if self.depth is not None and not (isinstance(self.depth, int) and 1 <= self.depth <= 4):
            raise RequestError(f"depth must be an integer in 1..4, got {self.depth!r}")
