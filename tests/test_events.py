"""The events carry the reply split once and typed statistics: the engine's Tokens pieces add up
to its Finished pieces, Finished.reply is the message they make, and both survive the event
stream's JSON (attach mode)."""

from __future__ import annotations

import json

import pytest

from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.engine.stats import GenerationStats
from mtplx.events import Finished, RequestStats, Tokens, event_dict, event_from_dict
from mtplx.reply_stream import Piece, ReplyStream, message

TEXT = '<think>\nRead it.\n</think>\n\nSure.<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'


def test_finished_stats_are_typed():
    stats = GenerationStats(mode="mtp", depth=2, prompt_tokens=10)
    stats.record_verify(["content", "content"], 1)
    frozen = stats.freeze()
    stats.record_verify(["content", "content"], 2)  # the running counts go on; the record does not
    assert frozen.verify_calls == 1 and frozen.accepted_by_depth == (1, 0) and frozen.tau == 2.0
    assert Finished("r", "stop", 1, 0, 0, "", (), {}).stats == RequestStats()
    with pytest.raises(ValueError, match="unknown request statistics"):
        Finished("r", "stop", 1, 0, 0, "", (), {"tokens_per_second": 3.0})
    with pytest.raises(ValueError, match="must be RequestStats"):
        Finished("r", "stop", 1, 0, 0, "", (), stats)


def test_events_survive_the_event_stream_json():
    pieces = tuple(ReplyStream().feed(TEXT, final=True))
    stats = GenerationStats(mode="mtp", depth=1)
    stats.record_verify(["reasoning"], 1)
    for event in (Tokens("r", (1, 2), TEXT, "reasoning", pieces),
                  Finished("r", "stop", 5, 2, 0, TEXT, (1, 2), stats.freeze(), pieces)):
        back = event_from_dict(json.loads(json.dumps(event_dict(event))))
        assert back == event


def test_finished_reply_is_the_message_its_pieces_make():
    pieces = tuple(ReplyStream().feed(TEXT, final=True))
    reply = Finished("r", "stop", 5, 2, 0, TEXT, (), {}, pieces).reply
    assert reply == message(pieces)
    assert reply["reasoning_content"] == "Read it." and reply["content"] == "Sure."
    assert reply["tool_calls"][0]["function"]["name"] == "read_file"
    assert json.loads(reply["tool_calls"][0]["function"]["arguments"]) == {"path": "a.py"}
    assert message([Piece("content", "hi")]) == {"role": "assistant", "content": "hi"}


def test_the_engine_splits_each_reply_once(dense_engine):
    """The pieces the Tokens events carry, then the rest Finished adds, are Finished.pieces: what
    a streaming client shows and what a whole response (and the bank) reads are one split."""
    request = GenerationRequest(tuple(dense_engine.checkpoint.tokenizer.encode("Write a short story.")),
                                SamplingParams(max_tokens=40))
    events = list(dense_engine.submit(request))
    streamed = [p for e in events if isinstance(e, Tokens) for p in e.pieces]
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.pieces
    assert tuple(streamed) == finished.pieces[: len(streamed)]
    assert finished.reply == message(finished.pieces)
    assert "".join(e.text for e in events if isinstance(e, Tokens)) == finished.text
