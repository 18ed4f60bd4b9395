"""The two tiny architectures (torch side) and their MTP module, laid out like Qwen3-Next/3.5.

The trunk is transformers' own Qwen3 / Qwen3.5 text model, so the exported weights load into
mlx-lm's `qwen3` / `qwen3_5` classes unchanged. The MTP module is:
    fc(concat(norm_e(embed(x[t+1])), norm_h(h[t]))) -> one decoder layer -> norm -> shared lm_head
and predicts x[t+2]. Its rope position is t (the hidden state's own position), which is the
offset the MTP layer's KV cache has at inference.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM, Qwen3_5RMSNorm

COMMON = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=640, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
    max_position_embeddings=8192, tie_word_embeddings=True,
    bos_token_id=None, eos_token_id=2, pad_token_id=0,
)


def dense_config() -> Qwen3Config:
    return Qwen3Config(**COMMON, rope_theta=10000.0)


def hybrid_config() -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        **COMMON,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )


class MTPModule(nn.Module):
    def __init__(self, config, layer_cls, norm_cls, layer_idx: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = norm_cls(h, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([layer_cls(config, layer_idx)])
        self.norm = norm_cls(h, eps=eps)

    def forward(self, hidden, next_embeds, position_embeddings, position_ids):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None, position_ids=position_ids)
        return self.norm(x)


class TinyMTPModel(nn.Module):
    """Trunk + MTP, with the joint loss used in training."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "dense":
            self.config = dense_config()
            self.trunk = Qwen3ForCausalLM(self.config)
            self.mtp = MTPModule(self.config, Qwen3DecoderLayer, Qwen3RMSNorm, 0)
        else:
            self.config = hybrid_config()
            self.trunk = Qwen3_5ForCausalLM(self.config)
            full = self.config.layer_types.index("full_attention")
            self.mtp = MTPModule(self.config, Qwen3_5DecoderLayer, Qwen3_5RMSNorm, full)

    def _rope(self, x, positions):
        pos = positions[None, :].expand(x.shape[0], -1)
        if self.kind == "hybrid":
            pos = pos[None].expand(3, -1, -1)
        return self.trunk.model.rotary_emb(x, pos), pos

    def losses(self, ids: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Next-token loss, MTP depth-1 loss (x[t+2]) and chained depth-2 loss (x[t+3]).

        `weights` (same shape as ids) weighs each *target* token; None weighs all alike.
        """
        hidden = self.trunk.model(input_ids=ids).last_hidden_state
        head = self.trunk.lm_head
        vocab = self.config.vocab_size
        if weights is None:
            weights = torch.ones(ids.shape)

        def ce(states: torch.Tensor, shift: int) -> torch.Tensor:
            """Weighted cross-entropy of `states` predicting ids[:, shift:]."""
            n = ids.shape[1] - shift
            losses = nn.functional.cross_entropy(head(states[:, :n]).reshape(-1, vocab), ids[:, shift:].reshape(-1),
                                                 reduction="none")
            w = weights[:, shift:].reshape(-1)
            return (losses * w).sum() / w.sum()

        main = ce(hidden, 1)
        embeds = self.trunk.model.embed_tokens(ids)
        n = ids.shape[1]
        rope, pos = self._rope(hidden, torch.arange(n - 1))
        m1 = self.mtp(hidden[:, :-1], embeds[:, 1:], rope, pos)
        loss1 = ce(m1, 2)
        rope2, pos2 = self._rope(hidden, torch.arange(1, n - 1))
        m2 = self.mtp(m1[:, :-1], embeds[:, 2:], rope2, pos2)
        loss2 = ce(m2, 3)
        return main, loss1, loss2
