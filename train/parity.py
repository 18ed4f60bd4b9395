"""torch vs MLX parity of an exported tiny model: the same files, both in fp32, one sequence.

    python -m train.parity mtplx/assets/models/tiny-dense --kind dense
    python -m train.parity mtplx/assets/models/tiny-hybrid --kind hybrid

Prints the largest |Δlogit| of the trunk and of the MTP head (depth 1) between the training
architecture (torch, transformers' classes) and the engine's loading path (mlx-lm classes plus
mtplx's MTP head). It proves the export lays the weights out the way the loader reads them.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def torch_logits(path: Path, kind: str, ids: list[int]):
    import torch

    from train.architectures import TinyMTPModel
    from train.train_model import load_export

    model = TinyMTPModel(kind)
    load_export(model, path)
    model.eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        hidden = model.trunk.model(input_ids=x).last_hidden_state
        rope, pos = model._rope(hidden, torch.arange(len(ids) - 1))
        draft = model.mtp(hidden[:, :-1], model.trunk.model.embed_tokens(x)[:, 1:], rope, pos)
        head = model.trunk.lm_head
        return head(hidden)[0].numpy(), head(draft)[0].numpy()


def mlx_logits(path: Path, ids: list[int]):
    import mlx.core as mx
    import numpy as np

    from mtplx.engine.checkpoint import load_checkpoint
    from mtplx.engine.runner import ModelRunner

    checkpoint = load_checkpoint(path)
    checkpoint.model.set_dtype(mx.float32)
    checkpoint.mtp.set_dtype(mx.float32)
    runner = ModelRunner(checkpoint)
    hidden = runner.hidden(ids, runner.new_trunk_cache())
    draft = runner.draft_hidden(hidden[:, :-1], ids[1:], runner.new_mtp_cache())
    return np.array(runner.logits(hidden)[0]), np.array(runner.logits(draft)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--kind", choices=["dense", "hybrid"], required=True)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()

    from mtplx.chat import render
    from mtplx.engine.checkpoint import load_checkpoint
    from mtplx.synth.agent import Sizes, conversation
    from mtplx.synth.corpus import Corpus

    convo = conversation(5_000_000, Corpus(), Sizes(6, 36))  # a held-out conversation
    ids = render(load_checkpoint(args.path).tokenizer, convo["messages"], convo["tools"])[: args.tokens]
    t_trunk, t_mtp = torch_logits(args.path, args.kind, ids)
    m_trunk, m_mtp = mlx_logits(args.path, ids)
    print(f"{args.path}: {len(ids)} tokens, max |logit| {abs(t_trunk).max():.2f}; "
          f"max |Δlogit| trunk {abs(t_trunk - m_trunk).max():.2e}, MTP head {abs(t_mtp - m_mtp).max():.2e}")


if __name__ == "__main__":
    main()
