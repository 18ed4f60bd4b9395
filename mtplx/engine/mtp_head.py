"""The multi-token-prediction head, laid out like Qwen3-Next / Qwen3.5 `mtp.*` weights.

Given the trunk's (post-norm) hidden state at position t and the embedding of token t+1, it
predicts token t+2 through one decoder layer of the model's own architecture. Its output hidden
state can be fed back in with the next drafted token, which is how drafts deeper than one are
chained. Embeddings and the output projection are shared with the trunk.

DeepSeek-V3 (and GLM-4.5 and later) store the same module as an extra trunk layer,
`model.layers.N.*` (N = num_hidden_layers): enorm / hnorm / eh_proj / shared_head.norm map onto the
names below, and its copies of the embedding and LM head are dropped (they equal the trunk's). DeepSeek-V3.2's layer
adds a sparse-attention indexer; the head here attends densely (a V3 layer, its indexer weights
dropped). Up to the indexer's top-k (2,048 keys in V3.2) that is the same attention; past it the
drafts may differ from the trained head's, never the output: the trunk verifies every draft.

The head's own tensors decide its layout, never the trunk's: a head copied from a Hugging Face file
into a converted MLX trunk keeps zero-centred norms (w - 1) and per-expert MoE weights even though
the trunk around it was converted.
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

# Families whose RMSNorm computes x * (1 + w) in the Hugging Face files; mlx-lm stores 1 + w.
ZERO_CENTRED = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Families whose MTP module is trunk layer N in DeepSeek's layout (enorm / hnorm / eh_proj /
# shared_head): model_type -> (mlx-lm module, its decoder layer class, whether that layer's attention
# takes an array mask, as MLA does). GLM-4.5 / 4.6 / 4.7 and GLM-4.7-Flash ship theirs this way.
LAYER_N = {"deepseek_v3": ("deepseek_v3", "DeepseekV3DecoderLayer", True),
           "deepseek_v32": ("deepseek_v3", "DeepseekV3DecoderLayer", True),  # dense attention (the note above)
           "glm4_moe": ("glm4_moe", "DecoderLayer", False),
           "glm4_moe_lite": ("glm4_moe_lite", "Glm4MoeLiteDecoderLayer", True),
           "glm_moe_dsa": ("deepseek_v3", "DeepseekV3DecoderLayer", True)}  # GLM-5: V3.2's architecture
_DEEPSEEK = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
             "shared_head.norm": "norm"}


class MTPHead(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, eps: float, array_mask: bool = False):
        super().__init__()
        self.array_mask = array_mask  # DeepSeek's MLA attention takes an array mask, never "causal"
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = [block]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, hidden: mx.array, next_embeds: mx.array, cache=None) -> mx.array:
        x = self._input(hidden, next_embeds)
        x = self.layers[0](x, create_attention_mask(x, cache, return_array=self.array_mask), cache)
        return self.norm(x)

    def extend(self, hidden: mx.array, next_embeds: mx.array, cache) -> tuple[mx.array, mx.array]:
        """Append the head layer's keys and values for these pairs to `cache`, and nothing else.
        Of a prompt position only its keys and values are ever read (drafting starts after the
        prompt), and with one decoder layer they depend on that position's input alone: the
        layer's attention over the context and its MLP are never built. The cache ends
        bit-identical to a full call's. (The trunk's last layer over the prompt, which the head's
        input needs, is still computed: that is most of the deferred MTP prefill left.) Returns the
        keys and values appended (lazy): computing them is that work, the cache's write aside."""
        try:
            self.layers[0](self._input(hidden, next_embeds), None, _KeysOnly(cache))
        except _KeysStored as stored:
            return stored.keys, stored.values
        raise RuntimeError(f"the MTP layer {type(self.layers[0]).__name__} never wrote its cache")

    def _input(self, hidden: mx.array, next_embeds: mx.array) -> mx.array:
        return self.fc(mx.concatenate([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], axis=-1))


class _KeysStored(Exception):
    """The head layer's keys and values are in the cache: the rest of its forward is not wanted."""

    def __init__(self, keys: mx.array, values: mx.array):
        super().__init__()
        self.keys, self.values = keys, values


class _KeysOnly:
    """A cache that ends the layer's forward right after it stores keys and values (every mlx-lm
    attention, MLA included, computes them from its input and hands them to `update_and_fetch`
    before attending). Lazy evaluation means the abandoned query projection costs nothing."""

    def __init__(self, cache):
        self._cache = cache

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._cache.update_and_fetch(keys, values)
        raise _KeysStored(keys, values)


def build_mtp_head(model_type: str, args, text_args) -> MTPHead:
    """One MTP decoder layer of the trunk's own kind (full attention for hybrids, MoE where the
    trunk's last layer is MoE)."""
    if model_type == "qwen3":
        from mlx_lm.models.qwen3 import TransformerBlock

        block = TransformerBlock(args)
    elif model_type in ("qwen3_5", "qwen3_5_moe"):
        from mlx_lm.models.qwen3_5 import DecoderLayer

        block = DecoderLayer(text_args, layer_idx=text_args.full_attention_interval - 1)
    elif model_type == "qwen3_next":
        from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

        block = Qwen3NextDecoderLayer(text_args, layer_idx=text_args.full_attention_interval - 1)
    elif model_type in LAYER_N:  # V3.2's layer too, without its indexer (see the module's note)
        import importlib

        module, layer, _ = LAYER_N[model_type]
        block = getattr(importlib.import_module(f"mlx_lm.models.{module}"), layer)(text_args, text_args.num_hidden_layers)
    else:
        raise ValueError(f"MTP weights for model_type {model_type!r} are not supported "
                         f"(qwen3, qwen3_5, qwen3_5_moe, qwen3_next, {', '.join(LAYER_N)} are)")
    return MTPHead(block, text_args.hidden_size, text_args.rms_norm_eps,
                   array_mask=model_type in LAYER_N and LAYER_N[model_type][2])


def split_mtp_weights(weights: dict, model_type: str, num_hidden_layers: int) -> tuple[dict, dict]:
    """(trunk weights, head weights named as MTPHead's parameters) from a checkpoint's tensors."""
    head, trunk = {}, {}
    extra = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.*)$")
    for key, value in weights.items():
        if key.startswith("mtp.") or ".mtp." in key:
            head[key.split("mtp.", 1)[1]] = value
            continue
        found = extra.match(key) if model_type in LAYER_N else None
        if found and int(found.group(1)) >= num_hidden_layers:
            if int(found.group(1)) == num_hidden_layers:  # only the first MTP module drafts
                name = found.group(2)
                for old, new in _DEEPSEEK.items():
                    if name.startswith(old + "."):
                        name = new + name[len(old):]
                        break
                else:
                    if name.startswith(("embed_tokens.", "shared_head.head.")):
                        continue  # copies of the trunk's embedding and LM head
                    if name.startswith("self_attn.indexer."):
                        continue  # V3.2's sparse-attention indexer: the head attends densely
                    name = "layers.0." + name
                head[name] = value
            continue
        trunk[key] = value
    return trunk, head


def zero_centred(head: dict) -> bool:
    """Whether the head's RMSNorm weights are stored w - 1 (Hugging Face Qwen3.5 / Qwen3-Next files):
    centred near 0, where the stored 1 + w of a converted head sits near 1."""
    norms = [v for k, v in head.items() if v.ndim == 1 and "norm" in k and k.endswith("weight")]
    if not norms:
        return False
    mean = mx.mean(mx.concatenate([n.astype(mx.float32) for n in norms])).item()
    return abs(mean) < 0.5


def sanitize_mtp_weights(head: dict, model_type: str, experts: int = 0, shift: bool | None = None) -> dict:
    """Head weights (MTPHead names) in the layout the module expects: per-expert or fused MoE
    weights stacked the way the trunk's sanitize stacks them, and zero-centred norms shifted by +1
    when the head's own tensors say so (`shift` forces the decision)."""
    out = dict(head)
    prefix = "layers.0.mlp."
    if f"{prefix}experts.gate_up_proj" in out:  # Qwen3.5-MoE fuses gate and up: (E, 2I, H)
        gate_up = out.pop(f"{prefix}experts.gate_up_proj")
        mid = gate_up.shape[-2] // 2
        out[f"{prefix}switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{prefix}switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[f"{prefix}switch_mlp.down_proj.weight"] = out.pop(f"{prefix}experts.down_proj")
    n = max([int(m.group(1)) + 1 for k in out if (m := re.match(r"layers\.0\.mlp\.experts\.(\d+)\.", k))] + [0])
    if n:
        if experts and n != experts:
            raise ValueError(f"the MTP layer has {n} experts, the trunk {experts}")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for part in ("weight", "scales", "biases"):
                if f"{prefix}experts.0.{proj}.{part}" in out:
                    out[f"{prefix}switch_mlp.{proj}.{part}"] = mx.stack(
                        [out.pop(f"{prefix}experts.{e}.{proj}.{part}") for e in range(n)])
    if shift is None:
        shift = model_type in ZERO_CENTRED and zero_centred(out)
    if shift:
        for key, value in out.items():
            if value.ndim == 1 and "norm" in key and key.endswith("weight"):
                out[key] = value + 1.0
    return {k: v for k, v in out.items() if "rotary_emb.inv_freq" not in k}


def quantize_like(head: MTPHead, weights: dict) -> None:
    """Quantize exactly the head's layers whose weights arrive quantized (group size and bits read
    from each tensor's shape, as mlx-lm reads the trunk's)."""
    from mlx_lm.utils import infer_quant_config

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(head, class_predicate=predicate)
