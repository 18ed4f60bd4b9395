"""Small stand-in checkpoints in the on-disk layouts real ones use, built at test time.

Each is a real config (the keys of the family's published config.json, scaled down), random
weights (or the trained tiny-hybrid's, for the Qwen3.5 stand-in) written under the names and in
the tensor layouts of the Hugging Face files — Qwen3.5's `model.language_model.*` with
zero-centred norms and (C, 1, K) convolutions, Qwen3-Next's per-expert MLPs, Qwen3.5-MoE's fused
`gate_up_proj`, DeepSeek-V3's `kv_b_proj` and its MTP layer at `model.layers.N` — sharded in two
files with a `model.safetensors.index.json`. The MLX model classes only supply parameter shapes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "tokenizers" / "qwen3"
TINY = Path(__file__).resolve().parents[1] / "mtplx" / "assets" / "models" / "tiny-hybrid"
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             rms_norm_eps=1e-6, max_position_embeddings=4096)
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=1,
           linear_num_value_heads=2, full_attention_interval=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
           decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
          ".k_norm.weight")


def vocab_of(tokenizer_dir: Path) -> int:
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data.get("added_tokens", [])]
    return (max(ids) // 64 + 1) * 64


def config_for(kind: str, vocab: int) -> dict:
    dense = dict(SMALL, vocab_size=vocab, num_hidden_layers=2, tie_word_embeddings=False)
    if kind == "qwen3":
        return dict(dense, model_type="qwen3", architectures=["Qwen3ForCausalLM"], rope_theta=1e6,
                    tie_word_embeddings=True, eos_token_id=None, torch_dtype="bfloat16")
    if kind in ("qwen3_5", "qwen3_5_moe"):
        text = dict(dense, **GDN, model_type=kind + "_text", layer_types=["linear_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                    mtp_num_hidden_layers=1, tie_word_embeddings=False, **(MOE if kind == "qwen3_5_moe" else {}))
        arch = "Qwen3_5MoeForConditionalGeneration" if kind == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
        return {"model_type": kind, "architectures": [arch], "tie_word_embeddings": False, "text_config": text,
                "vision_config": {"depth": 1}}
    if kind == "qwen3_next":
        return dict(dense, **GDN, **MOE, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
                    rope_theta=1e7, partial_rotary_factor=0.25, num_nextn_predict_layers=1, torch_dtype="float32")
    if kind == "deepseek_v3":
        return dict(dense, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_attention_heads=2,
                    num_key_value_heads=2, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4,
                    num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=32,
                    q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, first_k_dense_replace=1,
                    moe_layer_freq=1, norm_topk_prob=True, num_nextn_predict_layers=1, rope_theta=10000.0,
                    topk_method="noaux_tc", scoring_func="sigmoid", torch_dtype="float32")
    if kind == "deepseek_v32":  # V3's layout plus the sparse-attention indexer (a small top-k, so it selects)
        return dict(config_for("deepseek_v3", vocab), model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"],
                    index_head_dim=16, index_n_heads=2, index_topk=32)
    if kind == "glm_moe_dsa":  # GLM-5: DeepSeek-V3.2's architecture (MLA + indexer) under GLM's config keys
        return dict(config_for("deepseek_v32", vocab), model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False)
    if kind == "glm4_moe":  # GLM-4.5 / 4.6 / 4.7: GQA with partial RoPE and biases, MoE, MTP layer at model.layers.N
        return dict(dense, model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], moe_intermediate_size=32,
                    norm_topk_prob=True, n_group=1, topk_group=1, n_shared_experts=1, n_routed_experts=4,
                    routed_scaling_factor=2.5, num_experts_per_tok=2, first_k_dense_replace=1, use_qk_norm=False,
                    attention_bias=True, partial_rotary_factor=0.5, rope_scaling=None, rope_theta=1e6,
                    num_nextn_predict_layers=1, torch_dtype="float32")
    if kind == "glm4_moe_lite":  # GLM-4.7-Flash: DeepSeek's MLA and MoE under GLM's name
        return dict(config_for("deepseek_v3", vocab), model_type="glm4_moe_lite", architectures=["Glm4MoeLiteForCausalLM"],
                    partial_rotary_factor=1.0)
    if kind == "lfm2":  # Liquid's hybrid: short-convolution layers (recurrent state) between attention layers
        return dict(model_type="lfm2", architectures=["Lfm2ForCausalLM"], vocab_size=vocab, hidden_size=64,
                    num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                    norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64, block_multiple_of=16,
                    block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, block_ff_dim=128,
                    full_attn_idxs=[1, 3], layer_types=["conv", "full_attention", "conv", "full_attention"],
                    rope_theta=1e6, tie_word_embeddings=True, torch_dtype="bfloat16")
    if kind == "falcon_h1":  # Mamba-2 and attention side by side in every layer: a CacheList(ArraysCache, KVCache)
        return dict(model_type="falcon_h1", architectures=["FalconH1ForCausalLM"], vocab_size=vocab, hidden_size=64,
                    head_dim=32, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                    num_hidden_layers=2, mamba_d_ssm=128, mamba_d_state=16, mamba_n_heads=4, mamba_d_head=32,
                    mamba_chunk_size=32, mamba_d_conv=4, mamba_expand=2, mamba_n_groups=1, max_position_embeddings=4096,
                    rope_theta=1e6, tie_word_embeddings=True, torch_dtype="bfloat16")
    if kind == "nemotron_h":  # NVIDIA's Mamba-2 hybrid: Mamba, attention and MLP blocks by a pattern
        return dict(model_type="nemotron_h", architectures=["NemotronHForCausalLM"], vocab_size=vocab, hidden_size=64,
                    intermediate_size=128, max_position_embeddings=4096, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
                    ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
                    use_bias=False, use_conv_bias=True, hybrid_override_pattern="M*M-", num_hidden_layers=4,
                    rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
    if kind == "llama":
        return dict(dense, model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                    hidden_act="silu", torch_dtype="bfloat16")
    if kind == "gemma2":
        return dict(dense, model_type="gemma2", architectures=["Gemma2ForCausalLM"], final_logit_softcapping=30.0,
                    attn_logit_softcapping=50.0, query_pre_attn_scalar=32, sliding_window=64, torch_dtype="bfloat16")
    if kind == "gpt_oss":  # built in MLX layout (mlx-lm's own names), as mlx-community's conversions are
        return dict(dense, model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=64, sliding_window=64, rope_theta=150000,
                    layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-5, torch_dtype="bfloat16")
    if kind == "gemma3":
        text = dict(dense, model_type="gemma3_text", sliding_window=64, sliding_window_pattern=2,
                    query_pre_attn_scalar=32, rope_local_base_freq=10000.0, rope_theta=1e6)
        return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
                "vocab_size": vocab, "vision_config": {"hidden_size": 16}, "torch_dtype": "bfloat16"}
    raise ValueError(kind)


def _mlx_parameters(config: dict) -> tuple[dict, dict, object]:
    """Random MLX-layout trunk and MTP-head parameters for `config` (shapes from mlx-lm's classes)."""
    from mlx_lm.utils import _get_classes

    from mtplx.catalog import MTP_FAMILIES
    from mtplx.engine.mtp_head import build_mtp_head

    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    trunk = dict(tree_flatten(model.parameters()))
    head = {}
    if config["model_type"] in MTP_FAMILIES and config["model_type"] != "qwen3":  # Qwen3 ships no MTP head
        text_args = getattr(getattr(model, "language_model", None), "args", None) or model.args
        head = dict(tree_flatten(build_mtp_head(config["model_type"], model.args, text_args).parameters()))
    return trunk, head, model


def _unstack(weights: dict) -> dict:
    """Stacked MLX experts (switch_mlp, E first) -> one tensor per expert, as HF files store them."""
    out = {}
    for k, v in weights.items():
        if ".switch_mlp." in k:
            base, rest = k.split(".switch_mlp.", 1)
            for e in range(v.shape[0]):
                out[f"{base}.experts.{e}.{rest}"] = v[e]
        else:
            out[k] = v
    return out


def _hf_conv_and_norms(weights: dict, head: bool) -> dict:
    out = {}
    for k, v in weights.items():
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)  # MLX (C, K, 1) -> HF (C, 1, K)
        if v.ndim == 1 and ((head and "norm" in k and k.endswith("weight")) or any(k.endswith(s) for s in _NORMS)) \
                and "linear_attn.norm" not in k:
            v = v - 1.0  # HF stores zero-centred RMSNorm weights
        out[k] = v
    return out


def _deepseek_kv_b(weights: dict, config: dict) -> dict:
    out = {}
    for k, v in weights.items():
        if k.endswith("self_attn.embed_q.weight"):
            base = k[: -len("embed_q.weight")]
            wk, wv = v, weights[base + "unembed_out.weight"]  # (H, rank, nope), (H, v, rank)
            kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)
            out[base + "kv_b_proj.weight"] = kv_b.reshape(-1, config["kv_lora_rank"])
        elif not k.endswith("self_attn.unembed_out.weight"):
            out[k] = v
    return out


def hf_weights(kind: str, config: dict, trunk: dict, head: dict) -> dict:
    """MLX-layout parameters -> the tensor names and layouts of the family's Hugging Face files."""
    if kind in ("qwen3_5", "qwen3_5_moe"):
        trunk = {k.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head"): v
                 for k, v in trunk.items()}
        trunk = _hf_conv_and_norms(trunk, head=False)
        head = _hf_conv_and_norms(head, head=True)
        if kind == "qwen3_5_moe":
            trunk, head = _fuse_experts(trunk), _fuse_experts(head)
        trunk["model.visual.patch_embed.proj.weight"] = mx.zeros((4, 4))  # the vision tower mlx-lm skips
        return trunk | {f"mtp.{k}": v for k, v in head.items()}
    if kind == "qwen3_next":
        return _unstack(_hf_conv_and_norms(trunk, head=False)) | {f"mtp.{k}": v for k, v in
                                                                  _unstack(_hf_conv_and_norms(head, head=True)).items()}
    if kind in ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa"):
        n = config["num_hidden_layers"]
        out = _deepseek_kv_b(_unstack(trunk), config)
        names = {"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "fc": "eh_proj", "norm": "shared_head.norm"}
        for k, v in _deepseek_kv_b(_unstack(head), config).items():
            first, _, rest = k.partition(".")
            key = rest[len("0."):] if first == "layers" else f"{names[first]}.{rest}"
            out[f"model.layers.{n}.{key}"] = v
        if kind in ("deepseek_v32", "glm_moe_dsa"):  # the real MTP layer carries an indexer too (shapes as a trunk layer's)
            out.update({k.replace("model.layers.0.", f"model.layers.{n}."): v for k, v in trunk.items()
                        if k.startswith("model.layers.0.self_attn.indexer.")})
        out[f"model.layers.{n}.embed_tokens.weight"] = trunk["model.embed_tokens.weight"]
        out[f"model.layers.{n}.shared_head.head.weight"] = trunk["lm_head.weight"]
        return out
    if kind == "gemma3":
        return trunk | {"vision_tower.vision_model.embeddings.patch_embedding.weight": mx.zeros((4, 4))}
    return trunk | {f"mtp.{k}": v for k, v in head.items()}


def _fuse_experts(weights: dict) -> dict:
    out = {}
    for k, v in weights.items():
        if ".switch_mlp.gate_proj.weight" in k:
            base = k.split(".switch_mlp.")[0]
            out[f"{base}.experts.gate_up_proj"] = mx.concatenate([v, weights[f"{base}.switch_mlp.up_proj.weight"]], axis=-2)
            out[f"{base}.experts.down_proj"] = weights[f"{base}.switch_mlp.down_proj.weight"]
        elif ".switch_mlp." not in k:
            out[k] = v
    return out


def write_sharded(dest: Path, weights: dict, dtype) -> None:
    """Two shards and the index, as transformers' save_pretrained writes them."""
    dest.mkdir(parents=True, exist_ok=True)
    names = sorted(weights)
    half = len(names) // 2
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = {k: (weights[k].astype(dtype) if mx.issubdtype(weights[k].dtype, mx.floating) else weights[k]) for k in part}
        mx.save_safetensors(str(dest / file), tensors, metadata={"format": "pt"})
        index["weight_map"].update({k: file for k in part})
        index["metadata"]["total_size"] += sum(t.nbytes for t in tensors.values())
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def copy_tokenizer(src: Path, dest: Path, template: str | None = None) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dest / name)
    (dest / "tokenizer.json").chmod(0o644)
    (dest / "tokenizer_config.json").chmod(0o644)
    if template is not None:
        (dest / "chat_template.jinja").write_text(template)


def build(kind: str, dest: Path, tokenizer_dir: Path, *, seed: int = 0, template: str | None = None,
          generation_config: dict | None = None, dtype=None) -> Path:
    """A stand-in of `kind` in Hugging Face layout at `dest` (MoE kinds in float32 unless `dtype`
    says otherwise: MLX's CPU backend computes them in nothing else)."""
    mx.random.seed(seed)
    vocab = vocab_of(tokenizer_dir)
    config = config_for(kind, vocab)
    trunk, head, _ = _mlx_parameters(config)
    if dtype is None:
        dtype = mx.float32 if config.get("torch_dtype") == "float32" or kind == "qwen3_5_moe" else mx.bfloat16
    write_sharded(dest, hf_weights(kind, config, trunk, head), dtype)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(tokenizer_dir, dest, template)
    if generation_config is not None:
        (dest / "generation_config.json").write_text(json.dumps(generation_config))
    return dest


def qwen3_5_from_tiny(dest: Path) -> Path:
    """The trained tiny-hybrid (a qwen3_5 with an MTP head) in real Qwen3.5 on-disk layout: keys
    under `model.language_model.`, an untied `lm_head`, two shards with an index."""
    weights = mx.load(str(TINY / "model.safetensors"))
    out = {}
    for k, v in weights.items():
        if k.startswith("model.") and not k.startswith("model.language_model."):
            k = "model.language_model." + k[len("model."):]
        out[k] = v
    config = json.loads((TINY / "config.json").read_text())
    write_sharded(dest, out, mx.bfloat16)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(TINY, dest)
    return dest


def hub_cache(root: Path, repo_id: str, model_dir: Path, commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """`model_dir` placed in a Hugging Face cache at `root` the way huggingface_hub lays it out:
    blobs, a snapshot of symlinks, refs/main naming the commit."""
    import hashlib
    import os

    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in model_dir.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap



FIXTURES = Path(__file__).resolve().parent / "fixtures"
# family -> (special tokens added to the tiny tokenizer, bos, eos), for the vendored real templates
FAMILY_TOKENS = {
    "llama3": (("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
               "<|begin_of_text|>", "<|eot_id|>"),
    "gemma3": (("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<end_of_turn>"),
    # tests/fixtures/deepseek_v3_1_style.jinja: DeepSeek-V3.1's role, call and think tokens
    "deepseek_v3_1": (("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                       "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                       "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                       "<｜tool▁output▁end｜>", "<｜tool▁sep｜>", "<think>", "</think>"),
                      "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    # tests/fixtures/llama3_1_style.jinja: Llama 3's tokens and the two 3.1 added for tool calls
    "llama3_1": (("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|python_tag|>", "<|eom_id|>"), "<|begin_of_text|>", "<|eot_id|>"),
    # tests/fixtures/harmony_style.jinja: gpt-oss's harmony markup (all special, as in its vocabulary)
    "gptoss": (("<|startoftext|>", "<|return|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>",
                "<|constrain|>"), "<|startoftext|>", "<|return|>"),
}
# DeepSeek-V3.2: V3's vocabulary; no Jinja template: its tokenizer config names mlx-lm's Python renderer
FAMILY_TOKENS["deepseek_v32"] = FAMILY_TOKENS["deepseek_v3_1"]
RENDERERS = {"deepseek_v32": "deepseek_v32"}
TEMPLATES = {"deepseek_v3_1": "deepseek_v3_1_style.jinja", "gptoss": "harmony_style.jinja",
             "llama3_1": "llama3_1_style.jinja"}
# Special (dropped from decoded text) only where the real tokenizer marks them so: DeepSeek's role,
# call and think tokens are plain added tokens there, so replies show them and calls parse.
SPECIAL = {"deepseek_v3_1": {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"},
           "deepseek_v32": {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"}}


def family_tokenizer(family: str, dest: Path) -> Path:
    """The tiny tokenizer with a family's special tokens added and its real chat template
    (tests/fixtures/<family>; DeepSeek-V3.1: one written in its layout, TEMPLATES): the template's
    markup and end-of-turn token are the real ones."""
    specials, bos, eos = FAMILY_TOKENS[family]
    dest.mkdir(parents=True, exist_ok=True)
    data = json.loads((TINY.parent / "tiny-dense" / "tokenizer.json").read_text())
    next_id = max(list(data["model"]["vocab"].values()) + [t["id"] for t in data["added_tokens"]]) + 1
    known = {t["content"]: t["id"] for t in data["added_tokens"]}
    for i, content in enumerate(c for c in specials if c not in known):
        data["added_tokens"].append({"id": next_id + i, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False,
                                     "special": content in SPECIAL.get(family, specials)})
    (dest / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((TINY.parent / "tiny-dense" / "tokenizer_config.json").read_text())
    config.update(bos_token=bos, eos_token=eos, pad_token=None)
    if family in RENDERERS:
        config["chat_template_type"] = RENDERERS[family]
        config.pop("chat_template", None)
    else:
        config["chat_template"] = (FIXTURES / TEMPLATES.get(family, f"{family}/chat_template.jinja")).read_text()
    config.pop("added_tokens_decoder", None)
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def llama3_tokenizer(dest: Path) -> Path:
    return family_tokenizer("llama3", dest)
