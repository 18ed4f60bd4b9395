"""Training text: rendered agent conversations, one sample per user turn.

A conversation with several user turns is rendered once per turn end, the way an agent client
would have sent it then, so every assistant turn is seen with its reasoning at least once.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2

from mtplx.synth.agent import Sizes, conversation
from mtplx.synth.corpus import Corpus

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def load_template() -> jinja2.Template:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env.from_string(TEMPLATE_PATH.read_text())


def turn_samples(conv: dict, template: jinja2.Template) -> list[str]:
    """The conversation rendered at the end of each user turn (before the next user message)."""
    messages = conv["messages"]
    ends = [i for i, m in enumerate(messages) if m["role"] == "user" and i > 1] + [len(messages)]
    return [template.render(messages=messages[:end], tools=conv["tools"]) + "<|endoftext|>" for end in ends]


def render_texts(seeds: range, corpus: Corpus, sizes: Sizes = Sizes()) -> list[str]:
    template = load_template()
    texts: list[str] = []
    for seed in seeds:
        texts += turn_samples(conversation(seed, corpus, sizes), template)
    return texts
