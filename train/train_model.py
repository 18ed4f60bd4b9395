"""Train one tiny model (trunk + MTP head jointly) with torch on CPU and export it in HF layout.

    python -m train.train_model --kind dense  --minutes 45 --out mtplx/assets/models/tiny-dense
    python -m train.train_model --kind hybrid --minutes 45 --out mtplx/assets/models/tiny-hybrid

Seeded: data order, initialisation and the transcript generator all derive from --seed. The run
is bounded by wall time (the learning-rate schedule is stretched over the steps that fit, measured
after a short warm-up), and the model is exported every --export-every minutes, so a partly
trained checkpoint is always usable. Measured on the 2-core dev machine: ~700 tok/s per process
with one thread each. CI never retrains.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtplx.synth.agent import Sizes
from mtplx.synth.corpus import Corpus
from train.architectures import TinyMTPModel
from train.data import render_texts

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]


def token_stream(tokenizer_dir: Path, seeds: range, assistant_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the shuffled training texts, and a loss weight per token.

    Tokens inside assistant turns weigh `assistant_weight`, everything else 1. Most tokens are
    tool results (file contents, logs) the model only has to read; the assistant's own output
    (reasoning, the `<tool_call>` JSON, the answer) is what it is judged on, so weighting it up
    spends the gradient where well-formed tool calls are learnt.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = render_texts(seeds, Corpus(), Sizes(min_lines=6, max_lines=36))
    random.Random(seeds.start).shuffle(texts)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assistant = tok.encode("assistant", add_special_tokens=False).ids
    weights = [1.0] * len(ids)
    inside = False
    for i, token in enumerate(ids):
        if token == start and ids[i + 1 : i + 1 + len(assistant)] == assistant:
            inside = True
        elif inside:
            weights[i] = assistant_weight  # includes the closing <|im_end|>: stopping is output too
            inside = token != end
    return torch.tensor(ids, dtype=torch.long), torch.tensor(weights)


def export(model: TinyMTPModel, out: Path, tokenizer_dir: Path, meta: dict) -> None:
    """Write config.json + model.safetensors (bf16) + tokenizer files, atomically per file."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.trunk.state_dict().items() if k != "lm_head.weight"}
    state.update({f"mtp.{k}": v.detach().to(torch.bfloat16).contiguous() for k, v in model.mtp.state_dict().items()})
    config = model.config.to_dict()
    if model.kind == "hybrid":
        # Real Qwen3.5 checkpoints nest the text model: model.language_model.* and a text_config.
        state = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v for k, v in state.items()}
        config["full_attention_interval"] = config["layer_types"].index("full_attention") + 1  # what mlx-lm reads
        config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                  "tie_word_embeddings": True, "text_config": config}
    else:
        config["architectures"] = ["Qwen3ForCausalLM"]
    config["mtp_num_hidden_layers"] = 1
    if model.kind == "hybrid":
        config["text_config"]["mtp_num_hidden_layers"] = 1
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    (out / "training.json").write_text(json.dumps(meta, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)


def load_export(model: TinyMTPModel, path: Path) -> None:
    """Continue from an exported checkpoint (weights only; the optimiser starts afresh)."""
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    trunk = {k.replace("model.language_model.", "model.", 1): v.float() for k, v in state.items() if not k.startswith("mtp.")}
    trunk["lm_head.weight"] = trunk["model.embed_tokens.weight"]
    model.trunk.load_state_dict(trunk, strict=False)
    model.mtp.load_state_dict({k[4:]: v.float() for k, v in state.items() if k.startswith("mtp.")})


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    data, weights = token_stream(args.tokenizer, range(args.seed * 100_000, args.seed * 100_000 + args.conversations),
                                 args.assistant_weight)
    print(f"{args.kind}: {len(data):,} training tokens")
    model = TinyMTPModel(args.kind)
    if args.init is not None:
        load_export(model, args.init)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    gen = torch.Generator().manual_seed(args.seed)
    start = last_export = time.time()
    total_steps, step, tokens = None, 0, 0
    while True:
        elapsed = time.time() - start
        if step == 20:
            total_steps = int(20 * args.minutes * 60 / elapsed)
            print(f"{args.kind}: {20 * args.batch * args.seq / elapsed:.0f} tok/s, planning {total_steps} steps")
        if total_steps and step >= total_steps:
            break
        warm = min(1.0, (step + 1) / 50)
        frac = step / total_steps if total_steps else 0.0
        for group in opt.param_groups:
            group["lr"] = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        ids = torch.stack([data[s : s + args.seq] for s in starts])
        main, mtp1, mtp2 = model.losses(ids, torch.stack([weights[s : s + args.seq] for s in starts]))
        (main + 0.5 * mtp1 + 0.25 * mtp2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + ids.numel()
        if step % 25 == 0:
            print(f"{args.kind} step {step} loss {main.item():.3f} mtp1 {mtp1.item():.3f} mtp2 {mtp2.item():.3f} "
                  f"tokens {tokens:,} {time.time() - start:.0f}s", flush=True)
        if time.time() - last_export > args.export_every * 60:
            export(model, args.out, args.tokenizer, {"step": step, "tokens": tokens, "seed": args.seed, "final": False})
            last_export = time.time()
    export(model, args.out, args.tokenizer, {"step": step, "tokens": tokens + args.prior_tokens, "seed": args.seed, "final": True,
                                             "assistant_weight": args.assistant_weight,
                                             "continued_from_tokens": args.prior_tokens,
                                             "train_window": args.seq,
                                             "loss": main.item(), "mtp1_loss": mtp1.item(), "mtp2_loss": mtp2.item()})
    print(f"{args.kind}: done, {tokens:,} tokens in {time.time() - start:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=["dense", "hybrid"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=Path("build/tokenizer"))
    parser.add_argument("--minutes", type=float, default=45)
    parser.add_argument("--export-every", type=float, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--assistant-weight", type=float, default=1.0,
                        help="Loss weight of tokens inside assistant turns (others weigh 1).")
    parser.add_argument("--init", type=Path, help="Continue from this exported model directory.")
    parser.add_argument("--prior-tokens", type=int, default=0, help="Tokens the --init model was trained on (recorded).")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
