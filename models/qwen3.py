"""Qwen3 causal LM on tqops.graphs.Attention: packed varlen tokens, paged cache, per-layer cache formats."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..graphs import FULL_ATTENTION_GROUP, SLIDING_WINDOW_GROUP, Attention

from .loading import build_empty, config_dtype, load_weights, read_config
from .parallel import (MergedColumnLinear, TensorParallel, VocabParallelEmbedding, VocabParallelLMHead,
                       keep_checkpoint_names, row_linear, shard_hook)


@dataclasses.dataclass
class Qwen3Config:
    """The fields of a Hugging Face Qwen3 ``config.json`` this model uses; ``raw`` keeps the whole dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    layer_types: tuple = ()
    sliding_window: Optional[int] = None
    raw: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Qwen3Config":
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise NotImplementedError(f"rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {d['hidden_act']!r} is not supported (Qwen3 uses silu)")
        n = d["num_hidden_layers"]
        window = d.get("sliding_window") if d.get("use_sliding_window", False) else None  # as HF's Qwen3Config
        layer_types = d.get("layer_types") or [
            "sliding_attention" if window is not None and i >= d.get("max_window_layers", 28) else "full_attention"
            for i in range(n)
        ]
        if len(layer_types) != n:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {n} layers")
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=n, num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            head_dim=d.get("head_dim") or 128,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            layer_types=tuple(layer_types), sliding_window=window, raw=dict(d),
        )


def layer_formats(n: int, cache_format: str, overrides: Optional[Mapping[int, str]]) -> list[str]:
    """Per-layer cache formats: ``cache_format`` everywhere but ``overrides`` (layer index, negative from the end)."""
    formats = [cache_format] * n
    for i, fmt in (overrides or {}).items():
        if not -n <= i < n:
            raise IndexError(f"cache format override for layer {i}, but the model has {n} layers")
        formats[i] = fmt
    return formats


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """HF (non-interleaved) RoPE tables for ``positions`` ``[n]``: cos, sin ``[n, head_dim]`` in ``dtype``."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[n, heads, head_dim]`` rotated by ``cos``/``sin`` ``[n, head_dim]`` (rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Qwen3MLP(nn.Module):
    """SwiGLU MLP: gate and up as one GEMM (``gate_up_proj``, checkpoint names ``gate_proj``/``up_proj``); with
    ``tp`` the intermediate features are split (each rank's gate and up slices, row-parallel down with one
    all-reduce)."""

    def __init__(self, cfg: Qwen3Config, tp: Optional[TensorParallel] = None):
        super().__init__()
        h, ffn = cfg.hidden_size, cfg.intermediate_size
        part = tp.features(ffn) if tp is not None else None
        self.gate_up_proj = MergedColumnLinear(h, {"gate_proj": (ffn, part), "up_proj": (ffn, part)}, bias=False)
        self.down_proj = row_linear(ffn, h, part, bias=False, tp=tp)
        keep_checkpoint_names(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_parts(x)
        return self.down_proj(F.silu(gate) * up)


def qkv_linear(cfg: Qwen3Config, q_part: Optional[tuple[int, int]] = None,
               kv_part: Optional[tuple[int, int]] = None) -> MergedColumnLinear:
    """q, k and v as one GEMM, ``[..., hidden]`` -> ``[..., q + k + v features]`` (checkpoint names ``q_proj``,
    ``k_proj``, ``v_proj``); ``q_part``/``kv_part``: this rank's query and KV features under tensor parallelism."""
    full_q, full_kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return MergedColumnLinear(cfg.hidden_size, {"q_proj": (full_q, q_part), "k_proj": (full_kv, kv_part),
                                                "v_proj": (full_kv, kv_part)}, bias=cfg.attention_bias)


class Qwen3SelfAttention(nn.Module):
    """q/k/v projection (one GEMM), per-head q/k RMSNorm, RoPE, and a paged ``Attention`` (``self.attn``).

    With ``tp`` this rank holds ``num_heads / tp.size`` query heads and ``num_kv_heads / tp.size`` KV heads
    (its slices of q, k and v in ``qkv_proj``; its ``Attention`` and paged cache see only those), and o_proj is
    row-parallel.
    """

    def __init__(self, cfg: Qwen3Config, i: int, *, name: str, cache_format: str, causal: bool = True,
                 tp: Optional[TensorParallel] = None):
        super().__init__()
        h, hd, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q_part = kv_part = None
        if tp is not None:
            (q0, q1), (kv0, kv1) = tp.heads(nq, "num_attention_heads"), tp.heads(nkv, "num_key_value_heads")
            q_part, kv_part = (q0 * hd, q1 * hd), (kv0 * hd, kv1 * hd)
            nq, nkv = q1 - q0, kv1 - kv0
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nkv, hd
        self.qkv_proj = qkv_linear(cfg, q_part, kv_part)
        full_q = cfg.num_attention_heads * hd
        self.o_proj = row_linear(full_q, h, q_part, bias=cfg.attention_bias, tp=tp)  # in: this rank's heads
        self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)
        sliding = cfg.layer_types[i] == "sliding_attention"
        self.attn = Attention(nq, nkv, hd, name=name, cache_format=cache_format, causal=causal,
                              sliding_window=cfg.sliding_window if sliding else None,
                              group=SLIDING_WINDOW_GROUP if sliding else FULL_ATTENTION_GROUP)
        keep_checkpoint_names(self)

    def kv_heads(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projected keys and values ``[n, num_kv_heads * head_dim]`` -> rotated, normed keys and values
        ``[n, num_kv_heads, head_dim]``."""
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))
        return apply_rope(k, cos, sin), v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated, normed keys and values ``[n, num_kv_heads, head_dim]`` of ``x`` ``[n, hidden]``, without
        projecting queries (one GEMM over the k/v rows of ``qkv_proj``)."""
        return self.kv_heads(*self.qkv_proj.forward_parts(x, first=1), cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.forward_parts(x)
        q = apply_rope(self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim))), cos, sin)
        return self.o_proj(self.attn(q, *self.kv_heads(k, v, cos, sin)).flatten(1))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, i: int, *, name: str, cache_format: str, causal: bool = True,
                 tp: Optional[TensorParallel] = None):
        super().__init__()
        self.self_attn = Qwen3SelfAttention(cfg, i, name=name, cache_format=cache_format, causal=causal, tp=tp)
        self.mlp = Qwen3MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config, formats: Sequence[str], tp: Optional[TensorParallel] = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp is None else \
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, i, name=f"model.layers.{i}.self_attn", cache_format=fmt, tp=tp)
            for i, fmt in enumerate(formats)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 target. ``forward(input_ids [n], positions [n])`` -> hidden ``[n, hidden]``; see ``forward``.

    Full-attention layers use KV-cache group 0, sliding-window layers group 1; per-step metadata comes from the
    forward context. ``layer_cache_formats`` overrides ``cache_format`` per layer, e.g. ``{0: "bf16", -1: "bf16"}``.

    ``tp_group`` (a torch.distributed process group; every rank runs the same calls): tensor parallelism over its
    ranks. Each rank holds its share of the attention and KV heads (and their paged caches), of the MLP features and
    of the vocabulary; one all-reduce follows attention and one the MLP, the embedding is a masked lookup plus an
    all-reduce, and ``compute_logits`` all-gathers the vocabulary slices, so every rank sees the same full logits.
    """

    def __init__(self, config: Qwen3Config, *, cache_format: str = "bf16",
                 layer_cache_formats: Optional[Mapping[int, str]] = None, tp_group=None):
        super().__init__()
        self.config = config
        self.tp = TensorParallel.of(tp_group)
        formats = layer_formats(config.num_hidden_layers, cache_format, layer_cache_formats)
        self.model = Qwen3Model(config, formats, self.tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if self.tp is None else \
            VocabParallelLMHead(config.hidden_size, config.vocab_size, self.tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def allocate_cache(self, num_blocks: int, block_size: int, device=None) -> None:
        """Give every layer a paged cache of ``num_blocks`` blocks of ``block_size`` tokens, in its own format."""
        for attn in self.attention_layers:
            attn.allocate_cache(num_blocks, block_size, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layer_ids: Optional[tuple] = None):
        """``input_ids``/``positions`` ``[n]`` (packed varlen) -> final-normed hidden ``[n, hidden]``.

        With ``layer_ids`` (a drafter's ``target_layer_ids``) returns ``(hidden, aux)`` where aux
        ``[n, len(layer_ids) * hidden]`` concatenates transformers' ``hidden_states[i + 1]`` of those layers, as
        z-lab's DFlash reads them: each decoder layer's output, the last layer's after the final norm.
        """
        torch._check(positions.shape[0] == input_ids.shape[0])
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        by_layer = {}
        for i, layer in enumerate(self.model.layers[:-1]):
            x = layer(x, cos, sin)
            if layer_ids is not None and i in layer_ids:
                by_layer[i] = x
        hidden = self.model.norm(self.model.layers[-1](x, cos, sin))
        if layer_ids is None:
            return hidden
        by_layer[len(self.model.layers) - 1] = hidden
        return hidden, torch.cat([by_layer[i] for i in layer_ids], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., vocab]`` (the full vocabulary on every rank under tensor parallelism)."""
        return self.lm_head(hidden)

    @classmethod
    def from_pretrained(cls, path, *, cache_format: str = "bf16", layer_cache_formats=None,
                        dtype: Optional[torch.dtype] = None, device=None, tp_group=None) -> "Qwen3ForCausalLM":
        """Load a Hugging Face Qwen3 checkpoint directory (config.json + single or sharded safetensors); with
        ``tp_group`` each rank reads only its own part of every split tensor."""
        raw = read_config(path)
        config = Qwen3Config.from_dict(raw)
        model = build_empty(lambda: cls(config, cache_format=cache_format, layer_cache_formats=layer_cache_formats,
                                        tp_group=tp_group), config_dtype(raw, dtype), device or "cpu")
        model.tie_weights()
        tied = ("lm_head.weight",) if config.tie_word_embeddings else ()
        load_weights(model, path, ignore=lambda n: n.endswith("rotary_emb.inv_freq") or n in tied, optional=tied,
                     shard=shard_hook(model) if model.tp is not None else None)
        return model.eval()
