"""Self-distil a tiny model's MTP head on the trunk's own greedy replies (trunk frozen).

    python -m train.distill_head --model mtplx/assets/models/tiny-hybrid --device cuda --minutes 4

`train_head.py` teaches the head the trunk's distribution over the *training text*. But the head
drafts only what the trunk itself generates, and a small trunk's greedy replies are not its
training text: it loops, repeats a line, runs past a turn's end into an invented next turn. Every
rejected draft is a place where the head's guess of the trunk's own continuation was wrong, so
that continuation is what it should learn. Here the trunk first writes greedy replies from prompts
cut out of fresh conversations (at an assistant turn's start, where a real reply begins, and at
random points), then the head is trained with `train_head.chain_losses` (levels 1..J, inference's
visibility, the trunk's distribution as teacher) on those sequences, its loss counted only where a
chain drafts a generated token. A share of plain-text batches keeps what train_head taught.

Greedy replies continue past the end-of-turn token, as the benches' fixed-length decodes do.
The trunk's tensors are exported byte-identical (only mtp.* change), so every output the engine
produces stays the same; only how many drafts it accepts changes. Needs a GPU to be quick (one
lent H200: minutes); CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from train.architectures import TinyMTPModel
from train.train_head import Schedule, chain_losses, train_steps
from train.train_model import export, load_export, token_stream

SEEDS = 4_000_000  # conversations disjoint from training, tokenizer, held-out, bench and train_head seeds


def reply_starts(data: torch.Tensor, assistant_start: list[int], room: int) -> torch.Tensor:
    """Offsets of the first token after each `<|im_start|>assistant\\n` with `room` tokens before it."""
    pattern = torch.tensor(assistant_start)
    n = len(pattern)
    ends = (data.unfold(0, n, 1) == pattern).all(dim=1).nonzero().flatten() + n
    return ends[ends >= room]


@torch.no_grad()
def generate(model: TinyMTPModel, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """Prompts (B, P) followed by `new` greedy tokens each; nothing stops a reply early."""
    out = model.trunk.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=0,
                               do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True)
    return out[:, : prompts.shape[1] + new]


def generated_batches(model, data, starts, args, gen: torch.Generator):
    """Yields (ids, first generated position) batches of prompts + the trunk's greedy replies."""
    while True:
        length = int(torch.randint(args.prompt_min, args.prompt_max + 1, (1,), generator=gen))
        pick = torch.rand(args.gen_batch, generator=gen) < 0.75  # most prompts end where a reply begins
        ends = starts[torch.randint(0, len(starts), (args.gen_batch,), generator=gen)]
        ends = torch.where(pick, ends, torch.randint(length, len(data) - 1, (args.gen_batch,), generator=gen))
        prompts = torch.stack([data[e - length : e] for e in ends]).to(args.device)
        yield generate(model, prompts, args.new), length


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    seeds = range(SEEDS + args.seed * 100_000, SEEDS + args.seed * 100_000 + args.conversations)
    data, _ = token_stream(args.model, seeds, 1.0)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    assistant_start = tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    starts = reply_starts(data, assistant_start, args.prompt_max)
    print(f"{args.model.name}: {len(data):,} text tokens, {len(starts):,} reply starts", flush=True)
    kind = "hybrid" if json.loads((args.model / "config.json").read_text()).get("model_type") == "qwen3_5" else "dense"
    model = TinyMTPModel(kind)
    load_export(model, args.model)
    model.to(args.device)
    model.trunk.requires_grad_(False)
    model.trunk.eval()

    # Replies first (the trunk alone), then training on them: one pool, sampled with replacement.
    t0, pool, made = time.time(), [], 0
    batches = generated_batches(model, data, starts, args, gen)
    while time.time() - t0 < args.generate_minutes * 60 or len(pool) < 2:  # one is held out
        ids, first = next(batches)
        pool.append((ids.cpu(), first))
        made += ids.shape[0] * args.new
        print(f"generated {made:,} reply tokens in {time.time() - t0:.0f}s", flush=True)

    held_out = pool.pop(0)  # never trained on: its agreement is the acceptance to expect

    def evaluate(label: str) -> None:
        agreement = []
        with torch.no_grad():
            losses = chain_losses(model, held_out[0][: args.batch].to(args.device), args.levels, held_out[1], agreement)
        print(f"held-out replies {label}: loss " + " ".join(f"{loss.item():.3f}" for loss in losses)
              + "  agreement " + " ".join(f"{a:.3f}" for a in agreement), flush=True)

    evaluate("before")

    def batch():
        if torch.rand(1, generator=gen).item() < args.text_share:  # plain text, every position counts
            offsets = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
            return torch.stack([data[s : s + args.seq] for s in offsets]).to(args.device), None
        pooled, first = pool[int(torch.randint(0, len(pool), (1,), generator=gen))]
        return pooled[torch.randint(0, pooled.shape[0], (args.batch,), generator=gen)].to(args.device), first

    def report(step, losses, tokens, seconds, first):
        if step % 500 == 0:
            evaluate(f"at step {step}")
        if step % 50 == 0:
            print(f"step {step} {'text' if first is None else 'replies'} " + " ".join(
                f"d{i + 1} {loss.item():.3f}" for i, loss in enumerate(losses)) + f" tokens {tokens:,} {seconds:.0f}s", flush=True)

    step, tokens, _ = train_steps(model, args.levels, Schedule(args.minutes, args.lr, warmup=50, floor=0.05, plan_after=20),
                                  batch, report)
    evaluate("after")
    model.to("cpu")
    meta = json.loads((args.model / "training.json").read_text())
    meta["head_distilled"] = {"levels": args.levels, "steps": step, "tokens": tokens, "reply_tokens": made,
                              "seed": args.seed, "seeds_from": seeds.start, "teacher": "trunk, on its own greedy replies",
                              "text_share": args.text_share}
    out = args.out or args.model
    staging = out.with_name(out.name + ".head-staging")
    export(model, staging, args.model, meta)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "training.json"):
        (staging / name).replace(out / name)
    shutil.rmtree(staging)
    print(f"done: {tokens:,} tokens, {made:,} generated, in {time.time() - t0:.0f}s -> {out}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="An exported model directory (trunk + mtp.*).")
    parser.add_argument("--out", type=Path, help="Where to write the weights and record (default: in place).")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--generate-minutes", type=float, default=2)
    parser.add_argument("--minutes", type=float, default=3, help="Training time, after generating.")
    parser.add_argument("--levels", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=1500)
    parser.add_argument("--gen-batch", type=int, default=512)
    parser.add_argument("--new", type=int, default=256, help="Greedy tokens per reply.")
    parser.add_argument("--prompt-min", type=int, default=96)
    parser.add_argument("--prompt-max", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--text-share", type=float, default=0.25)
    parser.add_argument("--lr", type=float, default=5e-4)
    train(parser.parse_args())


if __name__ == "__main__":
    main()
