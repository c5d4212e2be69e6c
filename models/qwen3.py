"""Qwen3 causal LM on tqops.graphs.Attention: packed varlen tokens, paged cache, per-layer cache formats."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..graphs import FULL_ATTENTION_GROUP, SLIDING_WINDOW_GROUP, Attention
from ..linear import add_rms_norm_linear, silu_mul_linear
from ..norm import qk_norm_rope
from ..formats import layer_formats
from ..norm.naive import rms_norm_naive, rope_tables

from .loading import (build_empty, check_layer_types, config_dtype, config_float, config_int, load_weights,
                      read_config, rope_config)
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
        rope = rope_config(d)
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise NotImplementedError(f"rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {d['hidden_act']!r} is not supported (Qwen3 uses silu)")
        n = config_int(d, "num_hidden_layers")
        # As HF's Qwen3Config: the window only with use_sliding_window, 4096 when the key is absent (an explicit null
        # stays None, no sliding layers).
        window = None
        if d.get("use_sliding_window", False) and ("sliding_window" not in d or d["sliding_window"] is not None):
            window = config_int(d, "sliding_window", 4096)
        layer_types = d.get("layer_types") or [
            "sliding_attention" if window is not None and i >= config_int(d, "max_window_layers", 28, low=0)
            else "full_attention" for i in range(n)
        ]
        check_layer_types(d, layer_types, n)
        heads = config_int(d, "num_attention_heads")
        return cls(
            vocab_size=config_int(d, "vocab_size"), hidden_size=config_int(d, "hidden_size"),
            intermediate_size=config_int(d, "intermediate_size"), num_hidden_layers=n, num_attention_heads=heads,
            num_key_value_heads=config_int(d, "num_key_value_heads", heads),
            head_dim=config_int(d, "head_dim", 128),
            rms_norm_eps=config_float(d, "rms_norm_eps", 1e-6),
            rope_theta=config_float(rope, "rope_theta", config_float(d, "rope_theta", 10000.0)),
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            layer_types=tuple(layer_types), sliding_window=window, raw=dict(d),
        )


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """HF's default RoPE frequencies ``[head_dim // 2]``, fp32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponent)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """HF (non-interleaved) RoPE tables for ``positions`` ``[n]``: cos, sin ``[n, head_dim]`` in ``dtype``."""
    return rope_tables(positions, rope_inv_freq(head_dim, theta, positions.device), dtype)


class RotaryFrequencies(nn.Module):
    """RoPE's ``inv_freq`` ``[head_dim // 2]`` as a non-persistent fp32 buffer (HF's ``rotary_emb.inv_freq``): a
    buffer, so a compiled step reads it rather than recomputing it per layer; made again in fp32 on its new device
    after any ``.to()`` or ``to_empty``, since a dtype cast would round the frequencies."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.inv_freq.device)
        return self


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm (the layers run theirs fused with the residual add and the projection after it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_naive(x, self.weight, self.eps)


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
        self.tp = tp
        keep_checkpoint_names(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_parts(x)
        return self.down_proj(F.silu(gate) * up)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up_proj``'s output ``[n, 2 * features]`` -> the MLP's output ``[n, hidden]``: SiLU-and-multiply
        and ``down_proj`` as one op (``tqops.linear.silu_mul_linear``, no autograd)."""
        y = silu_mul_linear(gate_up, self.down_proj.weight)
        return y if self.tp is None else self.tp.all_reduce(y)


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

    def kv(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
        """Normed, rotated keys and values ``[n, num_kv_heads, head_dim]`` of ``x`` ``[n, hidden]`` at
        ``positions``, without projecting queries (one GEMM over the k/v rows of ``qkv_proj``)."""
        kv = self.qkv_proj.forward_rows(x, first=1)
        _, k = qk_norm_rope(kv, self.q_norm.weight, self.k_norm.weight, positions, inv_freq, 0, self.num_kv_heads,
                            self.k_norm.eps)
        return k, kv[:, self.num_kv_heads * self.head_dim:].unflatten(-1, (self.num_kv_heads, self.head_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """``x`` ``[n, hidden]`` at ``positions`` ``[n]`` -> ``[n, hidden]``; ``inv_freq``: ``rope_inv_freq``'s.

        q/k RMSNorm, RoPE and the cache store run as one op (``Attention.forward_qkv``) on the merged
        projection."""
        return self.attend(self.qkv_proj(x), positions, inv_freq)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """``forward`` from ``qkv_proj``'s output ``[n, (heads + 2 * kv_heads) * head_dim]`` on (the decoder layer
        runs the projection fused with the norm before it)."""
        out = self.attn.forward_qkv(qkv, self.q_norm.weight, self.k_norm.weight, positions, inv_freq,
                                    self.q_norm.eps)
        return self.o_proj(out.flatten(1))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, i: int, *, name: str, cache_format: str, causal: bool = True,
                 tp: Optional[TensorParallel] = None):
        super().__init__()
        self.self_attn = Qwen3SelfAttention(cfg, i, name=name, cache_format=cache_format, causal=causal, tp=tp)
        self.mlp = Qwen3MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor,
                inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """vLLM's pre-norm form: ``x`` ``[n, hidden]`` is the previous layer's MLP output and ``residual`` the stream
        it adds to (the first layer: the embedding, and None) -> ``(mlp output, stream after attention, stream
        into this layer)``; the layer's output is the first two's sum, left for the next layer's norm to add, and
        the third is the previous layer's output.

        Each residual add and norm runs inside the projection after it (``tqops.linear.add_rms_norm_linear``),
        SiLU-and-multiply inside ``down_proj``'s."""
        attn, norm = self.self_attn, self.input_layernorm
        if residual is None:
            stream, qkv = x, attn.qkv_proj(norm(x))
        else:
            qkv, stream = add_rms_norm_linear(x, residual, norm.weight, norm.eps, attn.qkv_proj.weight,
                                              attn.qkv_proj.bias)
        norm = self.post_attention_layernorm
        gate_up, residual = add_rms_norm_linear(attn.attend(qkv, positions, inv_freq), stream, norm.weight,
                                                norm.eps, self.mlp.gate_up_proj.weight)
        return self.mlp.down(gate_up), residual, stream


def run_layers(layers: Sequence[Qwen3DecoderLayer], final_norm: RMSNorm, x: torch.Tensor, positions: torch.Tensor,
               inv_freq: torch.Tensor, keep: Sequence[int] = ()):
    """``x`` ``[n, hidden]`` through ``layers`` and ``final_norm`` -> ``(normed hidden, {i: layer i's output})`` for
    ``i`` in ``keep`` (the last layer's after the final norm, as transformers' ``hidden_states[-1]`` is). Each
    residual add runs fused with the norm after it."""
    outputs, residual = {}, None
    for i, layer in enumerate(layers):
        x, residual, stream = layer(x, residual, positions, inv_freq)
        if i - 1 in keep:
            outputs[i - 1] = stream  # layer i - 1's output
    # Plain torch ops, fused by Inductor, rather than tqops.norm.add_rms_norm: Inductor formats the IR of an op's
    # first implicit fallback eagerly (torch 2.11), and for an op first met after every layer that string grows
    # exponentially with depth; a compile of 28 layers never ends (tests/models/test_compile_depth.py).
    hidden = final_norm(x if residual is None else x + residual)
    if len(layers) - 1 in keep:
        outputs[len(layers) - 1] = hidden
    return hidden, outputs


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
        self.rotary_emb = RotaryFrequencies(cfg.head_dim, cfg.rope_theta)


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
        hidden, by_layer = run_layers(self.model.layers, self.model.norm, self.model.embed_tokens(input_ids),
                                      positions, self.model.rotary_emb.inv_freq, layer_ids or ())
        if layer_ids is None:
            return hidden
        return hidden, torch.cat([by_layer[i] for i in layer_ids], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., vocab]`` (the full vocabulary on every rank under tensor parallelism)."""
        return self.lm_head(hidden)

    def checkpoint_rules(self) -> dict:
        """``load_weights``' ``ignore`` and ``optional`` for a Qwen3 checkpoint: HF's saved ``rotary_emb.inv_freq``
        is made here, and a tied ``lm_head.weight`` may be absent (it is the embedding)."""
        tied = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        return dict(ignore=lambda n: n.endswith("rotary_emb.inv_freq") or n in tied, optional=tied)

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
        load_weights(model, path, **model.checkpoint_rules(), shard=shard_hook(model) if model.tp is not None else None)
        return model.eval()
