"""Torch references of the fused norm ops: the unfused Qwen3 arithmetic, step by step in the input dtype."""
from __future__ import annotations

import torch


def rms_norm_naive(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 / HF RMSNorm over the last dim: normalize in fp32, round to ``x.dtype``, then scale by ``weight``."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_naive(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``x + residual`` ``[..., hidden]`` (rounded to the dtype) -> ``(rms_norm(sum), sum)``."""
    total = x + residual
    return rms_norm_naive(total, weight, eps), total


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """HF (non-interleaved) RoPE tables at ``positions`` ``[n]``: angles in fp32, cos and sin ``[n, head_dim]``
    rounded to ``dtype``, as a model's rotary embedding makes them."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[n, heads, head_dim]`` rotated by ``cos``/``sin`` ``[n, head_dim]`` (rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def rope_naive(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x`` ``[n, heads, head_dim]`` rotated at ``positions`` ``[n]`` by ``inv_freq`` ``[head_dim // 2]``."""
    return apply_rope(x, *rope_tables(positions, inv_freq, x.dtype))


def qk_norm_rope_naive(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, positions: torch.Tensor,
                       inv_freq: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float):
    """``qkv`` ``[n, (num_heads + 2 * num_kv_heads) * head_dim]`` -> per-head RMSNormed, rotated queries
    ``[n, num_heads, head_dim]`` and keys ``[n, num_kv_heads, head_dim]`` (values are untouched)."""
    head_dim = 2 * inv_freq.shape[0]
    q, k, _ = qkv.unflatten(-1, (-1, head_dim)).split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    return (rope_naive(rms_norm_naive(q, q_weight, eps), positions, inv_freq),
            rope_naive(rms_norm_naive(k, k_weight, eps), positions, inv_freq))
