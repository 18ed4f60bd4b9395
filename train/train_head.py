"""Retrain a tiny model's MTP head for deep drafts: chained levels 1..J, the trunk frozen, as inference sees them.

    python -m train.train_head --model mtplx/assets/models/tiny-hybrid --minutes 40

`train_model.py` trains the head jointly with the trunk on two levels, the second attending to
second-level entries of every earlier position. At inference a draft step at depth j attends to
something else: the head's cache holds first-level entries (real trunk hidden states) up to the
round's start t, then the entries this round's chain wrote at depths 2..j-1, then itself. Depths
3 and 4 were never trained, and acceptance fell there (0.70 and 0.56 on the hybrid's prose
answers). Here every level j = 1..J runs over the concatenation of levels 1..j with exactly that
visibility (`chain_visibility.py`), and each is taught the trunk's own next-token distribution at that
position (the draft is accepted when it equals the trunk's pick, not the data's next token).

The trunk's weights are not touched: the exported trunk tensors are byte-identical, so every
output the engine produces stays the same; only how many drafts it accepts changes. CI never
retrains.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from train.architectures import TinyMTPModel
from train.chain_visibility import visible
from train.train_model import export, load_export, token_stream

SEEDS = 3_000_000  # new conversations: disjoint from training, tokenizer, held-out and bench seeds


@functools.lru_cache(maxsize=4)
def chain_mask(levels: int, n: int) -> torch.Tensor:
    """The additive attention mask of `chain_visibility.visible` (0 where seen, -inf elsewhere)."""
    allowed = torch.tensor(visible(levels, n))
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]


def chain_losses(model: TinyMTPModel, ids: torch.Tensor, levels: int, first: int | None = None,
                 agreement: list | None = None) -> list[torch.Tensor]:
    """Soft cross-entropy of each level's draft against the trunk's distribution there.

    `first`: the position of the first generated token (distill_head.py); only chains that start
    at or after the pair feeding it, (hidden at first-1, token first), count, as at inference.
    `agreement`, when given, receives each level's share of positions where the head's pick is the
    trunk's (a greedy draft's acceptance, given the chain before it was kept)."""
    trunk, mtp = model.trunk, model.mtp
    with torch.no_grad():
        hidden = trunk.model(input_ids=ids).last_hidden_state
        # Level j at position p drafts x[p+2]: the trunk's prediction for it is its output at p+1.
        teacher = torch.softmax(trunk.lm_head(hidden[:, 1:]), dim=-1)
        embeds = trunk.model.embed_tokens(ids[:, 1:])  # x[p+1] for p = 0 .. n-2
    n = ids.shape[1] - 1
    hidden = hidden[:, :n]
    mask = chain_mask(levels, n).to(ids.device)
    enter = lambda h, e: mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(e), mtp.pre_fc_norm_hidden(h)], dim=-1))
    inputs, losses, previous = [], [], hidden
    for level in range(1, levels + 1):
        # Level 1 pairs the trunk's hidden at p; deeper levels the previous level's output at p-1.
        if level > 1:
            previous = torch.cat([torch.zeros_like(previous[:, :1]), previous[:, :-1]], dim=1)
        inputs.append(enter(previous, embeds))
        x = torch.cat(inputs, dim=1)
        rope, pos = model._rope(x, torch.arange(n, device=ids.device).repeat(level))
        out = mtp.layers[0](x, position_embeddings=rope, attention_mask=mask[..., : level * n, : level * n], position_ids=pos)
        out = mtp.norm(out[:, -n:])
        # A chain must start at t >= 0 (t = p - level + 1), or at t >= first - 1 on generated text.
        valid = slice(level - 1 if first is None else max(level - 1, first + level - 2), n)
        log_p = nn.functional.log_softmax(trunk.lm_head(out[:, valid]), dim=-1)
        losses.append(-(teacher[:, valid] * log_p).sum(-1).mean())
        if agreement is not None:
            agreement.append((log_p.argmax(-1) == teacher[:, valid].argmax(-1)).float().mean().item())
        previous = out
    return losses


LEVEL_WEIGHTS = [1.0, 0.8, 0.6, 0.5, 0.4, 0.3]


@dataclass
class Schedule:
    """How long and how fast: the step count is planned from the pace of the first `plan_after`
    steps to fill `minutes`; the learning rate warms up over `warmup` steps, then follows a cosine
    from `lr` down to `floor` x `lr`."""
    minutes: float
    lr: float
    warmup: int
    floor: float
    plan_after: int


def train_steps(model: TinyMTPModel, levels: int, schedule: Schedule, batch, report=None) -> tuple[int, int, list]:
    """Train the head (the trunk frozen) on `batch()` -> (ids, first generated position or None)
    with `chain_losses`; `report(step, losses, tokens, seconds, first)` after every step.
    Returns (steps, tokens, the last step's losses)."""
    params = list(model.mtp.parameters())
    opt = torch.optim.AdamW(params, lr=schedule.lr, betas=(0.9, 0.95), weight_decay=0.0)
    weights = LEVEL_WEIGHTS[:levels]
    start, step, tokens, total_steps, losses = time.time(), 0, 0, None, []
    while True:
        if step == schedule.plan_after:
            # at least the steps already taken: a slow start must not plan zero (which never ends)
            total_steps = max(step, int(step * schedule.minutes * 60 / (time.time() - start)))
            print(f"planning {total_steps} steps", flush=True)
        if total_steps is not None and step >= total_steps:
            break
        frac = step / total_steps if total_steps else 0.0
        for group in opt.param_groups:
            cosine = schedule.floor + (1 - schedule.floor) * 0.5 * (1 + math.cos(math.pi * frac))
            group["lr"] = schedule.lr * min(1.0, (step + 1) / schedule.warmup) * cosine
        ids, first = batch()
        losses = chain_losses(model, ids, levels, first)
        sum(w * loss for w, loss in zip(weights, losses)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + ids.numel()
        if report is not None:
            report(step, losses, tokens, time.time() - start, first)
    return step, tokens, losses


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    data, _ = token_stream(args.model, range(SEEDS + args.seed * 100_000, SEEDS + args.seed * 100_000 + args.conversations), 1.0)
    print(f"{args.model.name}: {len(data):,} training tokens", flush=True)
    kind = "hybrid" if json.loads((args.model / "config.json").read_text()).get("model_type") == "qwen3_5" else "dense"
    model = TinyMTPModel(kind)
    load_export(model, args.model)
    model.trunk.requires_grad_(False)
    model.trunk.eval()
    gen = torch.Generator().manual_seed(args.seed)

    def batch():
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        return torch.stack([data[s : s + args.seq] for s in starts]), None

    def report(step, losses, tokens, seconds, _first):
        if step % 10 == 0:
            print(f"step {step} " + " ".join(f"d{i + 1} {loss.item():.3f}" for i, loss in enumerate(losses))
                  + f" tokens {tokens:,} {seconds:.0f}s", flush=True)

    start = time.time()
    step, tokens, losses = train_steps(model, args.levels, Schedule(args.minutes, args.lr, warmup=20, floor=0.1, plan_after=10),
                                       batch, report)
    meta = json.loads((args.model / "training.json").read_text())
    meta["head_retrained"] = {"levels": args.levels, "steps": step, "tokens": tokens, "seed": args.seed,
                              "seeds_from": SEEDS + args.seed * 100_000, "teacher": "trunk",
                              "losses": [round(loss.item(), 4) for loss in losses]}
    # Export beside, then move only the weights and the record in: config.json stays the shipped one.
    staging = args.model.with_name(args.model.name + ".head-staging")
    export(model, staging, args.model, meta)
    for name in ("model.safetensors", "training.json"):
        (staging / name).replace(args.model / name)
    shutil.rmtree(staging)
    print(f"done: {tokens:,} tokens in {time.time() - start:.0f}s -> {args.model}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="An exported model directory (trunk + mtp.*).")
    parser.add_argument("--minutes", type=float, default=40)
    parser.add_argument("--levels", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=384)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    train(parser.parse_args())


if __name__ == "__main__":
    main()
