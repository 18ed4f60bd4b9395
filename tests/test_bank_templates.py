"""The bank on real chat templates (Llama 3's, Gemma 3's, ours): turn markers found by probing the
template, message spans and anchors on those turns, and sliding-window caches banked exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

import standins
from mtplx.bank.anchors import prompt_anchors
from mtplx.bank.markers import Markers
from mtplx.bank.spans import message_spans, reuse_ceiling
from mtplx.chat import render

TINY = Path(__file__).resolve().parents[1] / "mtplx" / "assets" / "models" / "tiny-dense"
# A template of our own that adds a system turn when the conversation has none, as Llama 3.1's does.
INJECTING = ("{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|start_header_id|>system<|end_header_id|>\n\n"
             "Today is a day.<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
             "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
             "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHAT = [{"role": "system", "content": ("You are a careful agent. " * 6).strip()}, {"role": "user", "content": "Read a.py"},
        {"role": "assistant", "content": "It sets x."}, {"role": "user", "content": "And b.py?"}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tok")
    out = {"chatml": AutoTokenizer.from_pretrained(str(TINY))}
    for family in ("llama3", "gemma3"):
        out[family] = AutoTokenizer.from_pretrained(str(standins.family_tokenizer(family, root / family)))
    injecting = AutoTokenizer.from_pretrained(str(standins.family_tokenizer("llama3", root / "inject")))
    injecting.chat_template = INJECTING
    out["injecting"] = injecting
    return out


def test_probe_finds_each_templates_turn_tokens(tokenizers):
    def ids(tok, *names):
        return tuple(tok.convert_tokens_to_ids(n) for n in names)

    chatml, llama, gemma = (Markers.from_tokenizer(tokenizers[k]) for k in ("chatml", "llama3", "gemma3"))
    assert (chatml.turn_start, chatml.turn_end) == ids(tokenizers["chatml"], "<|im_start|>", "<|im_end|>")
    assert chatml.tools_merged and not chatml.system_merged and chatml.newline is not None
    # The stand-in tokenizers still hold ChatML's tokens: only the template says which are used.
    assert (llama.turn_start, llama.turn_end) == ids(tokenizers["llama3"], "<|start_header_id|>", "<|eot_id|>")
    assert llama.newline is None and not llama.system_merged and llama.system
    assert (gemma.turn_start, gemma.turn_end) == ids(tokenizers["gemma3"], "<start_of_turn>", "<end_of_turn>")
    assert gemma.system_merged and gemma.newline is not None
    assert Markers.from_tokenizer(tokenizers["injecting"]).lead == 1


@pytest.mark.parametrize("name", ["chatml", "llama3", "gemma3", "injecting"])
def test_spans_map_each_message_to_its_turn(tokenizers, name):
    """Each message's span starts where rendering the messages before it ends (the template's own
    boundaries), and every complete message end is a message anchor."""
    tok = tokenizers[name]
    markers = Markers.from_tokenizer(tok)
    for messages in (CHAT, CHAT[1:]):
        prompt = render(tok, messages)
        spans = message_spans(prompt, messages, markers)
        assert [s.index for s in spans] == list(range(len(messages)))
        anchors = {a.position for a in prompt_anchors(prompt, markers, min_restore=1, grid=10_000)}
        for k in range(1, len(messages)):
            if name == "gemma3" and k == 1 and messages[0]["role"] == "system":
                continue  # Gemma folds the system message into the first user turn: no boundary there
            if name == "chatml" and messages[k - 1]["role"] == "assistant":
                continue  # Qwen's template gives a last assistant turn an empty think block: not a prefix
            before = render(tok, messages[:k], add_generation_prompt=False)
            assert prompt[: len(before)] == before
            assert spans[k].start == len(before), (name, k)
            assert len(before) in anchors
        # A follow-up turn's ceiling: everything the previous request and its reply held.
        assert reuse_ceiling(spans, len(messages) - 1, None) == spans[-1].start > 0


def test_gemma_system_shares_the_first_user_turn(tokenizers):
    tok = tokenizers["gemma3"]
    prompt = render(tok, CHAT)
    spans = message_spans(prompt, CHAT, Markers.from_tokenizer(tok))
    assert (spans[0].start, spans[0].end) == (spans[1].start, spans[1].end)
    assert tok.decode(prompt[spans[2].start: spans[2].start + 3]).startswith("<start_of_turn>model")


def test_spans_on_integer_lists():
    """Pure: turn 1 opens at token 1; the flags decide which messages share a turn."""
    prompt = [0, 1, 9, 5, 2, 1, 8, 5, 2, 1, 8, 6, 2, 1, 8, 6, 2, 1, 7]
    msgs = [{"role": "system"}, {"role": "user"}, {"role": "tool"}, {"role": "tool"}]
    starts = lambda m: [s.start for s in message_spans(prompt, msgs, m)]
    assert starts(Markers(1, 2, None, (9,), tools_merged=True)) == [1, 5, 9, 9]
    assert starts(Markers(1, 2, None, (9,), tools_merged=False)) == [1, 5, 9, 13]
    assert starts(Markers(1, 2, None, (), system_merged=True, tools_merged=False)) == [1, 1, 5, 9]
    assert [s.start for s in message_spans(prompt, msgs[1:], Markers(1, 2, None, (9,), tools_merged=False, lead=1))] == [5, 9, 13]
