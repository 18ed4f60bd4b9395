"""`mtplx replay`: send a frozen transcript's requests, in order, and keep honest receipts.

The contract: the first turn must be uncached (a warm server would make every number a lie),
every response must carry usage, broken streams are rejected, prompt-token counts must agree with
the local tokenizer when one is given (a prompt may legitimately shrink: a new user message strips
earlier reasoning), and a receipt file is written
atomically and never over an existing one.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from mtplx.bank.anchors import Markers
from mtplx.bank.spans import message_spans, reuse_ratio
from mtplx.chat import common_prefix, head_end, render
from mtplx.errors import MtplxError
from mtplx.replay.client import ReplayRejected, stream_turn
from mtplx.replay.transcript import Transcript


def ceilings(transcript: Transcript, tokenizer) -> list[tuple[int, int | None]]:
    """(prompt tokens, reuse ceiling) per turn, as this tokenizer renders them.

    A turn's ceiling is where the first message the server had not seen in the session's
    previous request starts (the transcript's assistant messages are teacher-forced, so they are
    new to the server; a message the client edited since is new too). A session's first turn can
    reuse a head another session already sent. As the server does (server/turns.session_from), a
    session is scoped by its head (system prompt and tools): a turn whose head changed to one the session had not used can reuse only what it
    shares with the session's previous request (all of its head when another request sent it);
    back on a head it used, the session's messages under that head count."""
    markers = Markers.from_tokenizer(tokenizer)
    seen_heads: set[tuple] = set()
    sent: dict[tuple, list] = {}  # (session, head) -> the messages of its previous request
    last: dict[str, list[int]] = {}  # each session's previous prompt
    out = []
    for turn in transcript.turns:
        msgs, tools = turn.body["messages"], turn.body.get("tools")
        prompt = render(tokenizer, msgs, tools)
        head = head_end(tokenizer, prompt, markers)
        head_key = tuple(prompt[:head]) if head else None
        key = (turn.session, head_key)
        if key in sent:
            spans = message_spans(prompt, msgs, markers)
            known = next((i for i, (a, b) in enumerate(zip(msgs, sent[key])) if a != b), min(len(msgs), len(sent[key])))
            ceiling = next((s.start for s in spans if s.index >= known), len(prompt))
        elif head_key in seen_heads:
            ceiling = head
        elif turn.session in last:  # its system prompt or tools changed: the part it shares is knowable
            ceiling = common_prefix(last[turn.session], prompt)
        else:
            ceiling = None
        if head_key:
            seen_heads.add(head_key)
        sent[key], last[turn.session] = list(msgs), list(prompt)
        out.append((len(prompt), ceiling))
    return out


def write_receipt(path: Path, receipt: dict) -> None:
    """Atomic and never over an existing file: write a temp file, then hard-link it into place."""
    path = Path(path)
    if path.exists():
        raise MtplxError(f"{path} exists; receipts are never overwritten (choose another --out)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".receipt-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(receipt, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise MtplxError(f"{path} appeared meanwhile; receipts are never overwritten") from None
    finally:
        os.unlink(tmp)


def replay(transcript: Transcript, base_url: str, *, run_id: str, arm: str | None = None, tokenizer=None,
           model: str = "", store=None, headers: dict | None = None, echo=print, timeout: float = 600,
           pause_s: float = 0.0) -> dict:
    """Send each turn in order. `pause_s` waits between turns, as an agent does while its tools run:
    a server that works in idle time (mtplx's render-ahead commit) gets that time, one that does
    not is unaffected. Zero measures back-to-back requests, where no idle work can help."""
    expected = ceilings(transcript, tokenizer) if tokenizer is not None else [(None, None)] * len(transcript.turns)
    turns = []
    with httpx.Client(timeout=timeout) as client:
        for i, (turn, (local_prompt, ceiling)) in enumerate(zip(transcript.turns, expected)):
            if i and pause_s:
                time.sleep(pause_s)
            started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
            result = stream_turn(client, base_url, turn.body, {"x-session-id": f"{run_id}-{turn.session}", **(headers or {})})
            if i == 0 and result.cached_tokens:
                raise ReplayRejected(f"the first turn came back with {result.cached_tokens} cached tokens: the server "
                                     "is warm, so nothing it reports can be attributed to this run (use a fresh server)")
            if local_prompt is not None and result.prompt_tokens != local_prompt:
                raise ReplayRejected(f"turn {i}: the server counted {result.prompt_tokens} prompt tokens, the local "
                                     f"tokenizer {local_prompt}: it is not serving the same model and template")
            row = {"turn": i, "session": turn.session, "prompt_tokens": result.prompt_tokens, "ceiling": ceiling,
                   "cached_tokens": result.cached_tokens,
                   "ratio": reuse_ratio(result.cached_tokens, ceiling),
                   "ttft_first_token_s": result.ttft_first_token_s, "ttft_first_visible_s": result.ttft_first_visible_s,
                   "total_s": result.total_s, "completion_tokens": result.completion_tokens,
                   "finish_reason": result.finish_reason, "output_sha256": result.output_sha256}
            turns.append(row)
            echo(f"turn {i:>2} {turn.session:<3} prompt {result.prompt_tokens:>5} ceiling {ceiling if ceiling is not None else '-':>5} "
                 f"cached {result.cached_tokens:>5} TTFT {result.ttft_first_token_s or 0:6.3f}s finish {result.finish_reason}")
            if store is not None:  # one row per turn: the server's own, completed, when it shares the store
                own = _store_row(row, run_id, arm, model, turn, transcript)
                if not store.claim(own["session"], started, {k: own[k] for k in CLAIMED}):
                    store.add(own)
    return {"run_id": run_id, "transcript": transcript.name, "base_url": base_url, "model": model, "arm": arm, "pause_s": pause_s,
            "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "turns": turns}


# What a replay knows better than the server's row: who sent it, the run, the transcript's
# ceiling, and the TTFTs an agent experiences (measured at the client).
CLAIMED = ("source", "arm", "replay_run", "turn_index", "ceiling", "ttft_first_token_s", "ttft_first_visible_s")


def _store_row(row: dict, run_id: str, arm, model: str, turn, transcript) -> dict:
    from mtplx.receipts.writer import receipt_id

    return {"id": receipt_id(), "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "session": f"{run_id}-{turn.session}", "source": "replay", "model": model, "arm": arm,
            "prompt_tokens": row["prompt_tokens"], "ceiling": row["ceiling"], "cached_tokens": row["cached_tokens"],
            "ttft_first_token_s": row["ttft_first_token_s"], "ttft_first_visible_s": row["ttft_first_visible_s"],
            "completion_tokens": row["completion_tokens"], "finish_reason": row["finish_reason"],
            "output_sha256": row["output_sha256"], "request_json": json.dumps(turn.body), "replay_run": run_id,
            "turn_index": row["turn"], "restore_source": None}


def compare(a: dict, b: dict) -> tuple[str, bool]:
    """Per-turn deltas of cached tokens and TTFT between two receipt files; parity of outputs."""
    lines = [f"{'turn':>4} {'cached A':>8} {'cached B':>8} {'Δcached':>8} {'TTFT A':>8} {'TTFT B':>8} {'ΔTTFT':>8}  parity"]
    parity = len(a["turns"]) == len(b["turns"])
    for x, y in zip(a["turns"], b["turns"]):
        same = x["output_sha256"] == y["output_sha256"]
        parity &= same
        ta, tb = x["ttft_first_token_s"] or 0, y["ttft_first_token_s"] or 0
        lines.append(f"{x['turn']:>4} {x['cached_tokens']:>8} {y['cached_tokens']:>8} {y['cached_tokens'] - x['cached_tokens']:>8} "
                     f"{ta:8.3f} {tb:8.3f} {tb - ta:8.3f}  {'ok' if same else 'DIFFERS'}")
    return "\n".join(lines), parity
