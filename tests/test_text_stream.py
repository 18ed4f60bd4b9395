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


def _qwen3_or_skip():
    from pathlib import Path

    import pytest
    from transformers import AutoTokenizer

    path = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tokenizers" / "qwen3"
    if not (path / "tokenizer.json").is_file():
        pytest.skip("the real Qwen3 tokenizer is not in ../shared/fixtures/tokenizers/qwen3")
    return AutoTokenizer.from_pretrained(str(path))


def test_the_rust_decode_gives_what_the_tokenizer_gives(tokenizer, monkeypatch):
    """TextStream decodes through the Rust tokenizer directly where that is exact: random id
    sequences (special tokens among them, skipped or kept), and whole streams with reasoning,
    a tool call and multibyte text, come out the same through both, on the embedded tokenizer,
    inside mlx-lm's wrapper, and on the real Qwen3 one."""
    import random

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mtplx.engine import text_stream

    text = "<think>\nplan ✓ 東京\n</think>\n\nnaïve café <tool_call>\n{\"name\": \"f\"}\n</tool_call> done"
    for tok in (tokenizer, TokenizerWrapper(tokenizer), _qwen3_or_skip()):
        assert text_stream._raw_decode(tok) is not None
        rng = random.Random(3)
        size = len(tok.get_vocab())
        for _ in range(400):
            ids = [rng.randrange(size) for _ in range(rng.randrange(1, 10))]
            for skip in (True, False):
                assert text_stream._raw_decode(tok)(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
        streamed = {}
        for raw in (True, False):
            monkeypatch.setattr(text_stream, "RAW_DECODE", raw)
            stream = TextStream(tok)
            streamed[raw] = "".join(stream.add(t) for t in tok.encode(text, add_special_tokens=False)) + stream.flush()
        monkeypatch.setattr(text_stream, "RAW_DECODE", True)
        assert streamed[True] == streamed[False] == text


def test_a_tokenizer_with_a_decode_of_its_own_keeps_it(tokenizer):
    from mtplx.engine import text_stream

    class Custom(type(tokenizer)):
        def decode(self, ids, **kwargs):
            return "custom"

    custom = Custom.__new__(Custom)
    custom.__dict__.update(tokenizer.__dict__)
    assert text_stream._raw_decode(custom) is None
    assert TextStream(custom)._decode([1, 2]) == "custom"
