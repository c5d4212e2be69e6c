"""Tiny random Qwen3 target and DFlash / DFlash2 drafter checkpoints in the published layouts (config.json +
safetensors)."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 2, 1, 64, 128, 100


def qwen3_config(num_layers=3, vocab=VOCAB, tie=False, layer_types=None, sliding_window=None, **extra) -> dict:
    """A Hugging Face style Qwen3 config.json dict (transformers v5 spelling: ``rope_parameters``)."""
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab, "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_hidden_layers": num_layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "attention_bias": False,
        "tie_word_embeddings": tie, "use_sliding_window": sliding_window is not None, "sliding_window": sliding_window,
        "layer_types": layer_types or ["full_attention"] * num_layers, "dtype": "float32",
    }
    cfg.update(extra)
    return cfg


def _linear(gen, out_f, in_f):
    return torch.randn(out_f, in_f, generator=gen) / in_f**0.5


def _norm(gen, dim):
    return 1.0 + 0.1 * torch.randn(dim, generator=gen)


def layer_tensors(gen, prefix: str, cfg: dict) -> dict:
    h, hd, nq, nkv, ffn = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], \
        cfg["intermediate_size"]
    biases = {f"{prefix}.self_attn.{p}_proj.bias": 0.1 * torch.randn(n, generator=gen)
              for p, n in (("q", nq * hd), ("k", nkv * hd), ("v", nkv * hd), ("o", h))} if cfg["attention_bias"] else {}
    return biases | {
        f"{prefix}.self_attn.q_proj.weight": _linear(gen, nq * hd, h),
        f"{prefix}.self_attn.k_proj.weight": _linear(gen, nkv * hd, h),
        f"{prefix}.self_attn.v_proj.weight": _linear(gen, nkv * hd, h),
        f"{prefix}.self_attn.o_proj.weight": _linear(gen, h, nq * hd),
        f"{prefix}.self_attn.q_norm.weight": _norm(gen, hd),
        f"{prefix}.self_attn.k_norm.weight": _norm(gen, hd),
        f"{prefix}.mlp.gate_proj.weight": _linear(gen, ffn, h),
        f"{prefix}.mlp.up_proj.weight": _linear(gen, ffn, h),
        f"{prefix}.mlp.down_proj.weight": _linear(gen, h, ffn),
        f"{prefix}.input_layernorm.weight": _norm(gen, h),
        f"{prefix}.post_attention_layernorm.weight": _norm(gen, h),
    }


def write_checkpoint(path, config: dict, tensors: dict, shards: int = 1) -> str:
    """config.json plus ``model.safetensors``, or ``shards`` files with a ``model.safetensors.index.json``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return str(path)
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, os.path.join(path, file))
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return str(path)


def write_target(path, *, seed=0, shards=1, **config_kw) -> str:
    """A random Qwen3 checkpoint with HF names (``model.`` prefix; no ``lm_head.weight`` when tied)."""
    cfg = qwen3_config(**config_kw)
    gen = torch.Generator().manual_seed(seed)
    tensors = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], HIDDEN, generator=gen)}
    for i in range(cfg["num_hidden_layers"]):
        tensors.update(layer_tensors(gen, f"model.layers.{i}", cfg))
    tensors["model.norm.weight"] = _norm(gen, HIDDEN)
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = _linear(gen, cfg["vocab_size"], HIDDEN)
    return write_checkpoint(path, cfg, tensors, shards)


DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


def dflash2_tensors(gen, num_layers: int, hidden: int, vocab: int, settings: dict) -> dict:
    """The tensors DFlash2 adds, with the published names: per layer ``attention_conv`` / ``mlp_conv`` (``base_kernel``
    ``[2, kernel, hidden]``, tap 0 near identity; ``kernel_projection``), and the selector (codebooks without a
    ``.weight`` suffix)."""
    k, groups, rank = settings["conv_kernel_size"], hidden // settings["conv_group_size"], settings["selector_rank"]
    out = {}
    for i in range(num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = 0.3 * torch.randn(2, k, hidden, generator=gen)
            base[:, 0] += 1.0
            out[f"layers.{i}.{conv}.base_kernel"] = base
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = 0.3 * _linear(gen, 2 * k * groups, hidden)
    out["candidate_selector.predecessor_codebook"] = torch.randn(vocab, rank, generator=gen)
    out["candidate_selector.successor_codebook"] = torch.randn(vocab, rank, generator=gen)
    out["candidate_selector.hidden_projection.weight"] = _linear(gen, rank, hidden)
    return out


def write_drafter(path, *, seed=1, shards=1, num_layers=2, block_size=4, target_layer_ids=(0, 2), vocab=VOCAB,
                  mask_token_id=None, layer_types=None, sliding_window=None, dflash_extra=None, dflash2=None,
                  **config_kw) -> str:
    """A random z-lab DFlash checkpoint: fc, hidden_norm, layers.N.*, norm (no embeddings / lm_head, no prefix).

    ``dflash2``: a DFlash2 checkpoint instead (``architectures: ["DFlash2DraftModel"]``), with these settings over
    ``DFLASH2``'s (``True``: those) in ``dflash_config`` and the tensors of ``dflash2_tensors``."""
    settings = None if not dflash2 else {**DFLASH2, **(dflash2 if isinstance(dflash2, dict) else {})}
    arch = "DFlash2DraftModel" if settings else "DFlashDraftModel"
    cfg = qwen3_config(num_layers=num_layers, vocab=vocab, layer_types=layer_types, sliding_window=sliding_window,
                       architectures=[arch], block_size=block_size, num_target_layers=3, **config_kw)
    cfg["dflash_config"] = {"target_layer_ids": list(target_layer_ids),
                            "mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id,
                            **(settings or {}), **(dflash_extra or {})}
    gen = torch.Generator().manual_seed(seed)
    tensors = {"fc.weight": _linear(gen, HIDDEN, len(target_layer_ids) * HIDDEN),
               "hidden_norm.weight": _norm(gen, HIDDEN), "norm.weight": _norm(gen, HIDDEN)}
    for i in range(num_layers):
        tensors.update(layer_tensors(gen, f"layers.{i}", cfg))
    if settings:
        tensors.update(dflash2_tensors(gen, num_layers, HIDDEN, vocab, settings))
    return write_checkpoint(path, cfg, tensors, shards)


def oracle_acceptance_lengths(k: int, block_size: int, n: int) -> list[int]:
    """Tokens per speculative step for an oracle right about k tokens per block, n new tokens in all (the prefill
    made the first)."""
    out, have = [], 1
    while have < n:
        out.append(min(min(k, block_size - 1) + 1, n - have))
        have += out[-1]
    return out


def randomize_dflash2(model, seed: int) -> None:
    """Seeded values for every parameter: norms near 1, linears ~ 1/sqrt(fan-in), conv base kernels near identity at
    tap 0, unit codebooks."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=gen)
            if name.endswith("base_kernel"):
                r = 0.3 * r
                r[:, 0] += 1.0
            elif "norm" in name:
                r = 1.0 + 0.1 * r
            elif "codebook" not in name:
                r = r / p.shape[-1] ** 0.5 * (0.3 if "kernel_projection" in name else 1.0)
            p.copy_(r)


def capped_lengths(lengths: list, new_tokens: int) -> list:
    """Per-step token counts of a longer run cut to ``new_tokens`` new tokens (the prefill makes the first), as
    tqops' ``accept_block`` caps them."""
    out, have = [], 1
    for n in lengths:
        if have >= new_tokens:
            break
        out.append(min(n, new_tokens - have))
        have += out[-1]
    return out
