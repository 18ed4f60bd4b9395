"""The multi-token-prediction head, laid out like Qwen3-Next / Qwen3.5 `mtp.*` weights.

Given the trunk's (post-norm) hidden state at position t and the embedding of token t+1, it
predicts token t+2 through one decoder layer of the model's own architecture. Its output hidden
state can be fed back in with the next drafted token, which is how drafts deeper than one are
chained. Embeddings and the output projection are shared with the trunk.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask



class MTPHead(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = [block]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, hidden: mx.array, next_embeds: mx.array, cache=None) -> mx.array:
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], axis=-1))
        x = self.layers[0](x, create_attention_mask(x, cache), cache)
        return self.norm(x)


def build_mtp_head(model_type: str, args, text_args) -> MTPHead:
    """One MTP decoder layer of the trunk's own kind (full attention for hybrids)."""
    if model_type == "qwen3":
        from mlx_lm.models.qwen3 import TransformerBlock

        block = TransformerBlock(args)
    elif model_type in ("qwen3_5", "qwen3_next"):
        module = __import__(f"mlx_lm.models.{model_type}", fromlist=["DecoderLayer"])
        block = module.DecoderLayer(text_args, layer_idx=text_args.full_attention_interval - 1)
    else:
        raise ValueError(f"MTP weights for model_type {model_type!r} are not supported (qwen3, qwen3_5, qwen3_next are)")
    return MTPHead(block, text_args.hidden_size, text_args.rms_norm_eps)


def sanitize_mtp_weights(weights: dict[str, mx.array], zero_centred: bool) -> dict[str, mx.array]:
    """Strip the `mtp.` prefix; shift zero-centred norms the way mlx-lm shifts the trunk's."""
    out = {}
    for key, value in weights.items():
        key = key.split("mtp.", 1)[1]
        # Every 1-D weight of the MTP head is an RMSNorm; Qwen3.5/Qwen3-Next HF files store them w - 1.
        if zero_centred and value.ndim == 1 and "norm" in key:
            value = value + 1.0
        out[key] = value
    return out
