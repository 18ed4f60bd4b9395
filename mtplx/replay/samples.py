"""Making the frozen transcripts in sample_transcripts/ (seeded; run once, files are committed).

    python -m mtplx.replay.samples [--out sample_transcripts]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from mtplx.replay.transcript import Transcript, freeze, interleave
from mtplx.synth.agent import Sizes, conversation
from mtplx.synth.corpus import Corpus
from mtplx.synth.heads import HEADS

QUESTIONS = ["What does {f} return when the input is empty?", "Is {f} safe to call twice?",
             "Summarise what {f} is for.", "Which module should own {f}?", "Could {f} be simpler?"]


def plain_appends(corpus: Corpus, seed: int) -> dict:
    """Question, answer, question, answer: every turn a plain append of one user message."""
    rng = random.Random(seed)
    src = corpus.excerpt(rng, 40)
    names = src.functions or ["main"]
    messages = [{"role": "system", "content": HEADS[1]["system"]},
                {"role": "user", "content": f"Here is a module I am reviewing:\n\n{src.text}"},
                {"role": "assistant", "content": f"It defines {', '.join(names[:3])}.", "reasoning_content": "Let me list what it defines."}]
    for i in range(5):
        f = rng.choice(names)
        messages += [{"role": "user", "content": QUESTIONS[i].format(f=f)},
                     {"role": "assistant", "content": f"`{f}` is short; see the module above.", "reasoning_content": f"The question is about {f}."}]
    return {"messages": messages, "tools": None}


def near_context(corpus: Corpus, seed: int, budget_chars: int = 24_000) -> dict:
    """One long tool-heavy conversation, grown until it nears the 8k-token context window."""
    convo = conversation(seed, corpus, Sizes(120, 200), max_user_turns=1, head=HEADS[0])
    while sum(len(m.get("content") or "") for m in convo["messages"]) < budget_chars:
        seed += 1
        more = conversation(seed, corpus, Sizes(120, 200), max_user_turns=1, head=HEADS[0])
        convo["messages"] += more["messages"][1:]
    return convo


def tool_heavy(corpus: Corpus, seed: int, sizes: Sizes, min_calls: int) -> dict:
    """The first conversation from `seed` on with at least `min_calls` tool calls."""
    while True:
        convo = conversation(seed, corpus, sizes, max_user_turns=1, head=HEADS[0])
        if sum(1 for m in convo["messages"] if m.get("tool_calls")) >= min_calls:
            return convo
        seed += 1


def fits(transcript: Transcript, tokenizer, limit: int) -> tuple:
    """The turns whose rendered prompt stays under `limit` tokens."""
    from mtplx.chat import render

    return tuple(t for t in transcript.turns if len(render(tokenizer, t.body["messages"], t.body.get("tools"))) < limit)


def build() -> dict[str, Transcript]:
    from transformers import AutoTokenizer

    from mtplx.catalog import resolve

    tokenizer = AutoTokenizer.from_pretrained(str(resolve("tiny-dense")))
    corpus = Corpus()
    coder = HEADS[0]
    a = freeze(conversation(701, corpus, Sizes(20, 50), 2, coder), "s1")
    b = freeze(conversation(702, corpus, Sizes(20, 50), 2, coder), "s2")
    c = freeze(conversation(703, corpus, Sizes(20, 50), 2, HEADS[2]), "s1")
    d = freeze(conversation(704, corpus, Sizes(20, 50), 2, HEADS[3]), "s2")
    return {
        "plain_appends": Transcript("plain_appends", "One session; every turn appends one user message to a Q&A "
                                    "history (no tools). The simplest warm turn.", freeze(plain_appends(corpus, 705)).turns),
        "long_tool_results": Transcript("long_tool_results", "One session of tool calls whose results are long "
                                        "file contents and test logs (thousands of tokens per turn).",
                                        freeze(tool_heavy(corpus, 706, Sizes(150, 300), 3)).turns),
        "reasoning_stripped": Transcript("reasoning_stripped", "Three user requests, each with tool turns: every new "
                                         "user message makes the template drop the reasoning of the turns before it.",
                                         freeze(conversation(707, corpus, Sizes(20, 60), 3, coder)).turns),
        "shared_head": Transcript("shared_head", "Two sessions, one after the other, sharing the same long "
                                  "system+tools head: the second session's first turn can restore the head.",
                                  a.turns + b.turns),
        "interleaved_sessions": Transcript("interleaved_sessions", "Two sessions with different heads whose turns "
                                           "alternate.", tuple(interleave(c, d))),
        "near_context_window": Transcript("near_context_window", "One long tool-heavy conversation whose last turns "
                                          "approach the 8,192-token context window.",
                                          fits(freeze(near_context(corpus, 708)), tokenizer, 7900)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("sample_transcripts"))
    args = parser.parse_args()
    args.out.mkdir(exist_ok=True)
    for name, transcript in build().items():
        (args.out / f"{name}.json").write_text(transcript.to_json())
        print(f"{name}: {len(transcript.turns)} turns")


if __name__ == "__main__":
    main()
