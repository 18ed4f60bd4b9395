from __future__ import annotations

from mtplx.engine.text_stream import TextStream


def _feed(tokenizer, text, stops=()):
    stream = TextStream(tokenizer, stops)
    out = ""
    for token in tokenizer.encode(text, add_special_tokens=False):
        out += stream.add(token)
        if stream.stopped:
            return out, True
    return out + stream.flush(), False


def test_round_trip_including_multibyte(tokenizer):
    text = "naïve café — 東京 ✓ done"
    assert _feed(tokenizer, text) == (text, False)


def test_stop_string_ends_text_before_it(tokenizer):
    out, stopped = _feed(tokenizer, "first line\nSTOP here and more", stops=("STOP",))
    assert stopped and out == "first line\n"


def test_partial_stop_is_released_at_the_end(tokenizer):
    out, stopped = _feed(tokenizer, "ends with ST", stops=("STOP",))
    assert not stopped and out == "ends with ST"


def test_stops_match_only_visible_content(tokenizer):
    # The server strips a segment's leading whitespace and never shows reasoning as content, so a
    # stop there would end the reply before its first visible character.
    out, stopped = _feed(tokenizer, "\n\nfirst line\nsecond", stops=("\n",))
    assert stopped and out == "\n\nfirst line"
    out, stopped = _feed(tokenizer, "<think>\nplan: x\n</think>\n\nanswer\nmore", stops=("\n",))
    assert stopped and out == "<think>\nplan: x\n</think>\n\nanswer"
    out, stopped = _feed(tokenizer, '<tool_call>\n{"name": "f"}\n</tool_call>', stops=("\n", "name"))
    assert not stopped
