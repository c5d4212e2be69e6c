"""The add_rms_norm / qk_norm_rope custom ops: registration, fake impls, validation and device dispatch.

Both are inference ops (no autograd): a decoder layer calls them where Inductor would otherwise emit several kernels
per norm, because the paged-cache ops around them end its fusion regions. CUDA runs the Triton kernels, every other
device the torch references in ``naive``.
"""
from __future__ import annotations

import math

import torch

from ..checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_size, check_tensor
from .naive import add_rms_norm_naive, qk_norm_rope_naive


def _check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")


def _check_device(name: str, t: torch.Tensor, device: torch.device, of: str) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, but {of} is on {device}; expected the same device")


def _check_weight(name: str, weight, size: int, like: torch.Tensor, of: str) -> None:
    check_tensor(name, weight, dtypes=(like.dtype,), ndim=1)
    if weight.shape[0] != size:
        raise ValueError(f"{name} has shape {tuple(weight.shape)}; expected [{size}]")
    _check_device(name, weight, like.device, of)


def check_add_rms_norm_args(x, residual, weight, eps) -> None:
    """Shapes, dtypes and devices only (no tensor values), so the op and its fake impl both run it."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("residual", residual, dtypes=(x.dtype,), ndim=2)
    if residual.shape[1] != x.shape[1]:
        raise ValueError(f"residual has shape {tuple(residual.shape)}; expected x's shape {tuple(x.shape)}")
    check_same_size(residual.shape[0] == x.shape[0],
                    f"residual has shape {tuple(residual.shape)}; expected x's shape {tuple(x.shape)}")
    _check_device("residual", residual, x.device, "x")
    _check_weight("weight", weight, x.shape[1], x, "x")
    if x.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError("x and residual must be contiguous in the hidden dim (stride(-1) == 1)")
    _check_eps(eps)


@torch.library.custom_op("tqops::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_add_rms_norm_args(x, residual, weight, eps)
    if x.is_cuda:
        from .triton_norm import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_naive(x, residual, weight, eps)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    check_add_rms_norm_args(x, residual, weight, eps)
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty_like(x, memory_format=torch.contiguous_format)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``x``, ``residual`` ``[num_tokens, hidden]`` -> ``(rms_norm(x + residual) * weight, x + residual)``, both
    ``[num_tokens, hidden]`` in ``x.dtype``: a pre-norm layer's residual add and next norm in one kernel."""
    return torch.ops.tqops.add_rms_norm(x, residual, weight, eps)


def check_qk_norm_rope_args(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps) -> None:
    """Shapes, dtypes and devices only (no tensor values), so the op and its fake impl both run it."""
    check_tensor("qkv", qkv, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("inv_freq", inv_freq, dtypes=(torch.float32,), ndim=1)
    _check_device("inv_freq", inv_freq, qkv.device, "qkv")
    for name, value, low in (("num_heads", num_heads, 0), ("num_kv_heads", num_kv_heads, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    half = inv_freq.shape[0]
    if half < 1:
        raise ValueError("inv_freq is empty; expected [head_dim // 2] RoPE frequencies")
    head_dim = 2 * half
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(f"qkv has shape {tuple(qkv.shape)}; expected [num_tokens, {width}] = (num_heads "
                         f"{num_heads} + 2 * num_kv_heads {num_kv_heads}) * head_dim {head_dim} (2 * inv_freq's "
                         f"{half} frequencies)")
    if qkv.stride(-1) != 1:
        raise ValueError("qkv must be contiguous in its last dim (stride(-1) == 1)")
    _check_weight("q_weight", q_weight, head_dim, qkv, "qkv")
    _check_weight("k_weight", k_weight, head_dim, qkv, "qkv")
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, ndim=1)
    _check_device("positions", positions, qkv.device, "qkv")
    check_same_size(positions.shape[0] == qkv.shape[0],
                    f"positions has {positions.shape[0]} entries; expected one per qkv row ({qkv.shape[0]})")
    _check_eps(eps)


@torch.library.custom_op("tqops::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, positions: torch.Tensor,
                     inv_freq: torch.Tensor, num_heads: int, num_kv_heads: int,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_qk_norm_rope_args(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps)
    if qkv.is_cuda:
        from .triton_norm import qk_norm_rope_triton

        return qk_norm_rope_triton(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps)
    q, k = qk_norm_rope_naive(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps)
    return q.contiguous(), k.contiguous()


@_qk_norm_rope_op.register_fake
def _(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps):
    check_qk_norm_rope_args(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps)
    head_dim = 2 * inv_freq.shape[0]
    return qkv.new_empty(qkv.shape[0], num_heads, head_dim), qkv.new_empty(qkv.shape[0], num_kv_heads, head_dim)


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, positions: torch.Tensor,
                 inv_freq: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float):
    """Qwen3's per-head q/k RMSNorm and RoPE in one kernel.

    ``qkv`` ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]`` (a fused projection's output: queries,
    keys, values; ``num_heads`` may be 0 for key/value rows only), ``positions`` ``[num_tokens]``, ``inv_freq``
    ``[head_dim // 2]`` fp32 RoPE frequencies -> queries ``[num_tokens, num_heads, head_dim]`` and keys
    ``[num_tokens, num_kv_heads, head_dim]``, contiguous, in ``qkv.dtype``. Values are left in ``qkv``.
    """
    return torch.ops.tqops.qk_norm_rope(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads,
                                        float(eps))
