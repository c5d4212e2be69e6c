"""Qwen3.5 hybrid causal LM: Gated DeltaNet linear-attention layers and gated full attention on tqops' ops."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import layer_formats
from ..graphs import FULL_ATTENTION_GROUP, Attention, GatedDeltaNetState
from ..norm.naive import apply_rope, rope_tables

from .loading import (build_empty, check_layer_types, config_dtype, config_float, config_int, load_weights,
                      read_config, rope_config, sub_config)
from .parallel import Linear, MergedColumnLinear, keep_checkpoint_names
from .qwen3 import Qwen3MLP, RotaryFrequencies

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass
class Qwen3_5Config:
    """The fields of a Hugging Face Qwen3.5 text ``config.json`` (``Qwen3_5TextConfig``, or the ``text_config`` of a
    ``Qwen3_5Config``) this model uses; ``raw`` keeps the whole dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    raw: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Qwen3_5Config":
        if "text_config" in d:  # a Qwen3_5ForConditionalGeneration checkpoint: its language model
            text = sub_config(d, "text_config")
            text.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
            config = cls.from_dict(text)
            config.raw = dict(d)
            return config
        if d.get("num_experts") or d.get("num_experts_per_tok"):
            raise NotImplementedError(
                "Qwen3.5 MoE checkpoints are not supported by tqops.models.Qwen3_5ForCausalLM (it needs a routed "
                "expert MLP with a shared expert: gate, experts.*, shared_expert, shared_expert_gate); run them "
                "through transformers with tqops.hf.PagedKVCache")
        rope = rope_config(d)
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise NotImplementedError(f"rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {d['hidden_act']!r} is not supported (Qwen3.5 uses silu)")
        n = config_int(d, "num_hidden_layers")
        interval = config_int(d, "full_attention_interval", 4)
        layer_types = d.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
        check_layer_types(d, layer_types, n)
        bad = sorted(set(layer_types) - set(LAYER_TYPES))
        if bad:
            raise NotImplementedError(f"layer_types {bad} are not supported; Qwen3.5 layers are {LAYER_TYPES}")
        hidden, heads = config_int(d, "hidden_size"), config_int(d, "num_attention_heads")
        linear = {f: config_int(d, f) for f in ("linear_num_key_heads", "linear_num_value_heads",
                                                "linear_key_head_dim", "linear_value_head_dim")}
        partial = config_float(rope, "partial_rotary_factor", config_float(d, "partial_rotary_factor", 0.25))
        if partial > 1:
            raise ValueError(f"{getattr(d, 'source', 'config')}: partial_rotary_factor is {partial}; expected a "
                             "fraction of the head in (0, 1]")
        return cls(
            vocab_size=config_int(d, "vocab_size"), hidden_size=hidden,
            intermediate_size=config_int(d, "intermediate_size"), num_hidden_layers=n, num_attention_heads=heads,
            num_key_value_heads=config_int(d, "num_key_value_heads", heads),
            head_dim=config_int(d, "head_dim", hidden // heads),
            layer_types=tuple(layer_types), **linear,
            linear_conv_kernel_dim=config_int(d, "linear_conv_kernel_dim", 4),
            rms_norm_eps=config_float(d, "rms_norm_eps", 1e-6),
            rope_theta=config_float(rope, "rope_theta", config_float(d, "rope_theta", 10000.0)),
            partial_rotary_factor=partial,
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), raw=dict(d),
        )


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: normalize in fp32, scale by ``1 + weight`` in fp32, then round."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


class OffsetRMSNorm(nn.Module):
    """``rms_norm_offset`` with its weight (zeros: the identity scale)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_offset(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """The delta rule's output norm, gated by ``silu(z)``: per head ``[..., head_v_dim]``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class Qwen3_5GatedDeltaNet(nn.Module):
    """Linear attention: one GEMM for qkv, z, b and a (checkpoint names ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``), the causal conv and gated delta rule over the layer's states (``self.state``),
    the gated norm and ``out_proj``. ``[n, hidden]`` -> ``[n, hidden]``."""

    def __init__(self, cfg: Qwen3_5Config, *, name: str):
        super().__init__()
        hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        self.state = GatedDeltaNetState(hk, hv, dk, dv, cfg.linear_conv_kernel_dim, name=name)
        conv_dim, value_dim = self.state.conv_dim, hv * dv
        self.in_proj = MergedColumnLinear(cfg.hidden_size, {"in_proj_qkv": (conv_dim, None),
                                                            "in_proj_z": (value_dim, None), "in_proj_b": (hv, None),
                                                            "in_proj_a": (hv, None)}, bias=False)
        self.conv1d = nn.Module()  # transformers' nn.Conv1d: only its depthwise weight [C, 1, W] is used
        self.conv1d.weight = nn.Parameter(torch.zeros(conv_dim, 1, cfg.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps)
        self.out_proj = Linear(value_dim, cfg.hidden_size, bias=False)
        keep_checkpoint_names(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed, z, b, a = self.in_proj.forward_parts(x)
        core = self.state(mixed, a, b, self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias)  # [n, Hv, dv]
        out = self.norm(core, z.unflatten(-1, (self.state.num_v_heads, -1)))
        return self.out_proj(out.flatten(1))


class Qwen3_5Attention(nn.Module):
    """Gated full attention: q (with a per-head output gate), k, v as one GEMM, zero-centred q/k RMSNorm, RoPE on the
    first ``rotary_dim`` channels, tqops paged ``Attention``, ``sigmoid(gate)`` on its output, ``o_proj``."""

    def __init__(self, cfg: Qwen3_5Config, *, name: str, cache_format: str):
        super().__init__()
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim, self.rotary_dim = nq, nkv, hd, cfg.rotary_dim
        self.qkv_proj = MergedColumnLinear(cfg.hidden_size, {"q_proj": (2 * nq * hd, None),
                                                             "k_proj": (nkv * hd, None), "v_proj": (nkv * hd, None)},
                                           bias=cfg.attention_bias)
        self.o_proj = Linear(nq * hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm, self.k_norm = OffsetRMSNorm(hd, cfg.rms_norm_eps), OffsetRMSNorm(hd, cfg.rms_norm_eps)
        self.attn = Attention(nq, nkv, hd, name=name, cache_format=cache_format, group=FULL_ATTENTION_GROUP)
        keep_checkpoint_names(self)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        qg, k, v = self.qkv_proj.forward_parts(x)
        q, gate = qg.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        k, v = k.unflatten(-1, (self.num_kv_heads, self.head_dim)), v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        cos, sin = rope_tables(positions, inv_freq, x.dtype)
        q = self._rope(self.q_norm(q), cos, sin)
        k = self._rope(self.k_norm(k), cos, sin)
        out = self.attn(q.contiguous(), k.contiguous(), v.contiguous())
        return self.o_proj((out * torch.sigmoid(gate)).flatten(1))


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm residual layer: token mixer (``linear_attn`` or ``self_attn``), then the SwiGLU MLP."""

    def __init__(self, cfg: Qwen3_5Config, i: int, *, cache_format: str):
        super().__init__()
        self.layer_type = cfg.layer_types[i]
        if self.layer_type == "linear_attention":
            self.linear_attn = Qwen3_5GatedDeltaNet(cfg, name=f"model.layers.{i}.linear_attn")
        else:
            self.self_attn = Qwen3_5Attention(cfg, name=f"model.layers.{i}.self_attn", cache_format=cache_format)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h) if self.layer_type == "linear_attention" else self.self_attn(h, positions, inv_freq)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5Model(nn.Module):
    def __init__(self, cfg: Qwen3_5Config, formats):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(cfg, i, cache_format=fmt) for i, fmt in enumerate(formats))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryFrequencies(cfg.rotary_dim, cfg.rope_theta)


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5 hybrid target. ``forward(input_ids [n], positions [n], layer_ids=None)`` as ``Qwen3ForCausalLM``'s.

    Full-attention layers keep paged KV caches in their tqops format (``layer_cache_formats`` overrides
    ``cache_format`` by decoder-layer index; an override on a linear-attention layer is an error, those keep
    states, not K/V); linear-attention layers keep per-row conv and recurrent states (``allocate_state``) and read
    their rows from the forward context's ``state_metadata``. The speculative loop's rollback is the state layers'
    stash: a verify block leaves the committed state unchanged and the next step commits its accepted prefix.
    """

    def __init__(self, config: Qwen3_5Config, *, cache_format: str = "bf16",
                 layer_cache_formats: Optional[Mapping[int, str]] = None, tp_group=None):
        super().__init__()
        if tp_group is not None:
            raise NotImplementedError("tensor parallelism is not supported for Qwen3.5 targets yet")
        self.config = config
        self.tp = None
        n = config.num_hidden_layers
        formats = layer_formats(n, cache_format, layer_cache_formats)
        for i in (layer_cache_formats or {}):
            if config.layer_types[i % n] != "full_attention":
                raise ValueError(f"layer_cache_formats[{i}]: layer {i % n} is a linear-attention layer (it keeps "
                                 "conv and recurrent states, no KV cache); expected full-attention layer indices")
        self.model = Qwen3_5Model(config, formats)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if layer.layer_type == "full_attention"]

    @property
    def state_layers(self) -> list[GatedDeltaNetState]:
        return [layer.linear_attn.state for layer in self.model.layers if layer.layer_type == "linear_attention"]

    def allocate_cache(self, num_blocks: int, block_size: int, device=None) -> None:
        """Give every full-attention layer a paged cache of ``num_blocks`` blocks of ``block_size`` tokens."""
        for attn in self.attention_layers:
            attn.allocate_cache(num_blocks, block_size, device)

    def allocate_state(self, rows: int, stash_len: int, device=None) -> None:
        """Give every linear-attention layer zeroed states for ``rows`` sequences and a stash of ``stash_len``
        tokens (the verify block; 1 without speculation)."""
        for state in self.state_layers:
            state.allocate_state(rows, stash_len, device, self.lm_head.weight.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, layer_ids: Optional[tuple] = None):
        torch._check(positions.shape[0] == input_ids.shape[0])
        x = self.model.embed_tokens(input_ids)
        inv_freq, outputs = self.model.rotary_emb.inv_freq, []
        for layer in self.model.layers:
            x = layer(x, positions, inv_freq)
            outputs.append(x)
        hidden = self.model.norm(x)
        if layer_ids is None:
            return hidden
        outputs[-1] = hidden  # transformers' hidden_states[-1] is after the final norm
        # A list, not a dict keyed by layer id: a compiled step that met other layer ids before (another model's) may
        # see these as SymInts, which a list index specializes and a dict lookup cannot match.
        return hidden, torch.cat([outputs[i] for i in layer_ids], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_rules(self) -> dict:
        """``load_weights``' rules for a transformers Qwen3.5 checkpoint: the vision tower and the MTP head of a
        ``Qwen3_5ForConditionalGeneration`` checkpoint are not this model's (ignored), its language model's names
        (``model.language_model.*``) are read as ``model.*``; a tied ``lm_head.weight`` may be absent."""
        tied = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        return dict(ignore=lambda n: n.startswith(("model.visual.", "mtp.")) or n in tied, optional=tied,
                    rename=lambda n: "model." + n[len("model.language_model."):]
                    if n.startswith("model.language_model.") else n)

    @classmethod
    def from_pretrained(cls, path, *, cache_format: str = "bf16", layer_cache_formats=None,
                        dtype: Optional[torch.dtype] = None, device=None) -> "Qwen3_5ForCausalLM":
        """Load a transformers Qwen3.5 checkpoint directory (``Qwen3_5ForCausalLM``, or the language model of a
        ``Qwen3_5ForConditionalGeneration``): every tensor of the text model must be there and used."""
        raw = read_config(path)
        config = Qwen3_5Config.from_dict(raw)
        dtypes = {k: raw[k] for k in ("dtype", "torch_dtype") if raw.get(k)}
        model = build_empty(lambda: cls(config, cache_format=cache_format, layer_cache_formats=layer_cache_formats),
                            config_dtype({**raw.get("text_config", {}), **dtypes}, dtype), device or "cpu")
        model.tie_weights()
        load_weights(model, path, **model.checkpoint_rules())
        return model.eval()
