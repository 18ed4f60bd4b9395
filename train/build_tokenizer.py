"""Train the tiny models' byte-level BPE tokenizer and write its Hugging Face files.

    python -m train.build_tokenizer --out build/tokenizer --vocab 4096

Synthetic transcripts alone do not fill a few-thousand-token vocabulary, so standard-library
source text is mixed in (it is also what the tool results are made of).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mtplx.synth.corpus import Corpus
from train.data import TEMPLATE_PATH, render_texts

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def build(out: Path, vocab: int, conversations: int) -> None:
    corpus = Corpus()
    texts = render_texts(range(1_000_000, 1_000_000 + conversations), corpus)
    texts.append(corpus.all_text(6_000_000))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=SPECIAL + MARKUP,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    # Markup tokens are added (never split) but not special, so decoded text keeps them.
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens(MARKUP)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": t in SPECIAL}
        for t in SPECIAL + MARKUP
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": TEMPLATE_PATH.read_text(),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    print(f"vocab {tok.get_vocab_size()} written to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("build/tokenizer"))
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--conversations", type=int, default=1500)
    args = parser.parse_args()
    build(args.out, args.vocab, args.conversations)


if __name__ == "__main__":
    main()
