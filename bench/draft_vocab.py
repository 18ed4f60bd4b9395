"""What the draft vocabulary saves: a draft step over the whole vocabulary vs over a learned set,
side by side in one run.

    python bench/draft_vocab.py [--model tiny-dense --model tiny-hybrid] [--rounds 5] [--shape qwen3-0.6b]

Per embedded model (one engine each, the set forced on: by default they keep the whole
vocabulary, see mtplx/engine/draft_vocab.py):
1. it learns a set the way a server does (in a fresh $MTPLX_HOME): greedy replies to a few prompts feed the engine's
   draft vocabulary until it switches on (the replies' prompts are not the measured ones);
2. a draft step (head layer + LM head + argmax, evaluated) timed with the set and without,
   alternating, medians;
3. MTP decode at the model's depth 3 on held-out prompts, with the set and without, alternating:
   tok/s, tokens per verify (tau), and whether the outputs are identical (they must be).
Then, for real LM-head shapes that no embedded model has (`--shape`, random weights, no
download): the head layer and the LM head over all rows vs 32k and 8k rows; a real model's
draft step is mostly its LM head, which is what the set cuts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mtplx  # noqa: E402,F401  (the CPU fast path before MLX)
from scratch import scratch_dir  # noqa: E402
import mlx.core as mx  # noqa: E402

from mtplx.catalog import resolve  # noqa: E402
from mtplx.engine.engine import Engine, EngineConfig  # noqa: E402
from mtplx.engine.request import GenerationRequest  # noqa: E402
from mtplx.engine.sampling import SamplingParams  # noqa: E402

LEARN = ["Read src/parser/events.py and explain what it does.", "Write a Python function that merges two sorted lists.",
         "What does load_config do, and where is it called?", "Summarise the failing test and propose a fix.",
         "Explain the difference between a list and a tuple.", "Rename the helper in utils and update its callers."]
MEASURE = ["Explain in a few paragraphs how a hash map handles collisions, with a short example.",
           "Describe how the cache module decides what to evict.", "Why would a build fail after renaming a module?"]
SHAPES = {  # hidden, intermediate, heads, kv heads, head_dim, vocab (the published configs')
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, 151936),
    "qwen3.5-0.8b": (1024, 3584, 8, 2, 256, 248320),
    "qwen3-4b": (2560, 9728, 32, 8, 128, 151936),
}


def _prompt(engine, text: str) -> tuple[int, ...]:
    return tuple(engine.checkpoint.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                 add_generation_prompt=True))


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def draft_step_ms(engine, ids: list[int] | None, steps: int = 200) -> float:
    runner = engine.runner

    def work():
        runner.use_draft_ids(ids)
        cache = runner.new_mtp_cache()
        width = runner.embedding.weight.shape[1]
        h = mx.random.normal((1, 64, width), key=mx.random.key(1)).astype(runner.embedding.weight.dtype)
        runner.extend_head(h, list(range(10, 74)), cache)
        mx.eval(cache.state)
        m = h[:, -1:, :]
        with runner.small_forwards():
            t = time.perf_counter()
            for _ in range(steps):
                token = runner.draft_token(mx.argmax(runner.draft_logits(m)[0, -1:], axis=-1))
                mx.eval(runner.draft_hidden(m, token, cache), token)
                cache.trim(1)
            return (time.perf_counter() - t) / steps * 1e3

    return engine.call(work)


def model_rows(model: str, rounds: int) -> None:
    engine = Engine(resolve(model), EngineConfig()).start()
    try:
        from mtplx.engine.engine import DRAFT_VOCAB_SHARE

        share = engine.call(engine.runner.lm_head_share)
        print(f"{model}: LM head {share:.2f} of a draft step's multiply-adds; by default (auto, at least "
              f"{DRAFT_VOCAB_SHARE}) it {'would' if share >= DRAFT_VOCAB_SHARE else 'would not'} use a set")
        vocab = engine.draft_vocab
        if vocab is None:
            print(f"{model}: no MTP head (or MTPLX_DRAFT_VOCAB=off): nothing to compare")
            return
        n = 0
        while vocab.ids() is None and n < 60:
            engine.submit(GenerationRequest(_prompt(engine, LEARN[n % len(LEARN)]), SamplingParams(max_tokens=160),
                                            use_mtp=False)).result()
            n += 1
        learned = vocab.ids()
        print(f"{model}: set after {n} replies ({vocab.seen} tokens, new-token rate {vocab.new_rate():.3f}): "
              f"{len(learned) if learned else 'none'} of {vocab.vocab_size}")
        if not learned:
            return
        engine.call(lambda: setattr(engine, "draft_vocab", None))  # frozen while measured
        steps = {"set": [], "all": []}
        for _ in range(rounds):
            for arm in ("set", "all"):
                steps[arm].append(draft_step_ms(engine, learned if arm == "set" else None))
        decode = {"set": [], "all": []}
        taus = {"set": [], "all": []}
        same = True
        for _ in range(rounds):
            for text in MEASURE:
                outs = {}
                for arm in ("set", "all"):
                    engine.call(lambda: engine.runner.use_draft_ids(learned if arm == "set" else None))
                    fin = engine.submit(GenerationRequest(_prompt(engine, text), SamplingParams(max_tokens=160),
                                                          use_mtp=True, depth=3)).result()
                    decode[arm].append(fin.stats.decode_tps or 0.0)
                    taus[arm].append(fin.stats.tau or 0.0)
                    outs[arm] = fin.token_ids
                same = same and outs["set"] == outs["all"]
        s, a = _median(steps["set"]), _median(steps["all"])
        print(f"  draft step: set {s:.3f} ms, all {a:.3f} ms -> {a / s:.2f}x")
        ds, da = _median(decode["set"]), _median(decode["all"])
        print(f"  MTP depth 3 decode: set {ds:.1f} tok/s (tau {_median(taus['set']):.2f}), all {da:.1f} tok/s "
              f"(tau {_median(taus['all']):.2f}) -> {ds / da:.2f}x; outputs identical: {same}")
    finally:
        engine.stop()


def shape_rows(name: str, rounds: int) -> None:
    """A draft step's two parts at a real model's shape (random fp32 weights): the head layer
    (a dense decoder layer at one position) and the LM head over all rows vs a set; and the LM
    head's share of the multiply-adds, which decides whether the engine uses a set by default."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.qwen3 import ModelArgs, TransformerBlock

    hidden, inter, heads, kv, head_dim, vocab = SHAPES[name]
    args = ModelArgs(model_type="qwen3", hidden_size=hidden, num_hidden_layers=1, intermediate_size=inter,
                     num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=1e-6,
                     vocab_size=vocab, rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=True)
    layer = TransformerBlock(args)
    embed = nn.Embedding(vocab, hidden)
    mx.eval(layer.parameters(), embed.parameters())

    x = mx.random.normal((1, 1, hidden))
    sets = {"all": embed.weight, "32k": embed.weight[:32768], "8k": embed.weight[:8192]}
    mx.eval(list(sets.values()))
    times = {k: [] for k in ["layer", *sets]}
    for _ in range(rounds):
        cache = KVCache()
        t = time.perf_counter()
        for _ in range(50):
            mx.eval(layer(x, None, cache))
        times["layer"].append((time.perf_counter() - t) / 50 * 1e3)
        for k, w in sets.items():
            t = time.perf_counter()
            for _ in range(50):
                mx.eval(mx.argmax(x[0] @ w.T, axis=-1))
            times[k].append((time.perf_counter() - t) / 50 * 1e3)
    med = {k: _median(v) for k, v in times.items()}
    layer_macs = sum(v.size for _, v in tree_flatten(layer.parameters()) if v.ndim == 2) \
        + 2 * hidden * hidden  # + the head's fc (2H -> H)
    share = vocab * hidden / (vocab * hidden + layer_macs)
    full = med["layer"] + med["all"]
    print(f"{name} shape (hidden {hidden}, vocab {vocab}, LM head {share:.2f} of the step): head layer {med['layer']:.2f} ms, LM head all "
          f"{med['all']:.2f} / 32k {med['32k']:.2f} / 8k {med['8k']:.2f} ms -> draft step "
          f"{full / (med['layer'] + med['32k']):.2f}x (32k), {full / (med['layer'] + med['8k']):.2f}x (8k) cheaper")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="tiny-dense and tiny-hybrid unless given")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="real LM-head shapes to time "
                        "(qwen3-0.6b and qwen3.5-0.8b unless given)")
    parser.add_argument("--no-shapes", action="store_true", help="skip the real-shape timing")
    args = parser.parse_args()
    import os
    
    # A fresh home: the set is learned here, never read from what an earlier run or server kept.
    os.environ["MTPLX_HOME"] = str(scratch_dir("mtplx-bench-draft-vocab-"))
    # Forced on: by default (auto) the embedded models keep the whole vocabulary, their LM head
    # being about half a draft step; this shows why.
    os.environ["MTPLX_DRAFT_VOCAB"] = "on"
    for model in args.model or ["tiny-dense", "tiny-hybrid"]:
        model_rows(model, args.rounds)
    if not args.no_shapes:
        for shape in args.shape or ["qwen3-0.6b", "qwen3.5-0.8b"]:
            shape_rows(shape, args.rounds)


if __name__ == "__main__":
    main()
