"""Triton kernels of the fused norm ops: one program per token row (add + RMSNorm) or per token and head (q/k)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s,
                         hidden, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    # The sum is rounded to the model dtype before it is normalized, as the unfused `x + residual` is.
    total = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * stride_s + offs, total, mask=mask)
    h = total.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    normed = (h * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        pdl: bool = False):
    """``(rms_norm(x + residual), x + residual)`` for 2-D ``x``/``residual`` ``[n, hidden]`` (rows may be strided).
    Launched with PDL for one row, or where ``pdl`` (a norm whose next kernel is the skinny GEMM)."""
    n, hidden = x.shape
    out, total = torch.empty_like(x), torch.empty_like(x)
    if n:
        _add_rms_norm_kernel[(n,)](x, residual, weight, out, total, x.stride(0), residual.stride(0), out.stride(0),
                                   total.stride(0), hidden, eps, BLOCK=triton.next_power_of_2(hidden),
                                   num_warps=4 if hidden <= 4096 else 8,
                                   **pdl_launch_args(x.device, n == 1 or pdl))
    return out, total


@triton.jit
def _normed_rotated(x, partner, w, w_partner, inv, c, s, upper, dtype: tl.constexpr):
    """One RMSNormed, rotated (RoPE, rotate-half) element per channel of ``x``: ``partner`` is the channel half a head
    away (its ``w_partner`` weight), ``inv`` the row's 1 / rms, ``c``/``s`` cos and sin rounded to ``dtype``, ``upper``
    where the channel is in the second half. Rounded as the unfused module rounds: normalized in fp32, rounded,
    scaled by the weight, rounded; the rotation in fp32, one rounding at the end. All arguments broadcast."""
    n = ((x * inv).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
    p = ((partner * inv).to(dtype).to(tl.float32) * w_partner).to(dtype).to(tl.float32)
    return tl.where(upper, n * c + p * s, n * c - p * s).to(dtype)


@triton.jit
def rms_rope_tile(row_ptr, x, cols, m2, w_ptr, pos, inv_freq_ptr, eps, D: tl.constexpr, dtype: tl.constexpr):
    """Per-head RMSNorm + RoPE of a tile ``x`` [rows, BLOCK_D] already loaded from ``row_ptr`` [rows, 1] (element
    pointers of each row's channel 0, unit stride) at channels ``cols`` [BLOCK_D] under mask ``m2``; ``pos``
    [rows] the rows' positions -> [rows, BLOCK_D] in ``dtype``. Each channel's partner half a head away is loaded
    again rather than moved between threads: a few L1 hits instead of a shuffle through shared memory, in any tile
    layout."""
    HALF: tl.constexpr = D // 2
    col_ok = cols < D
    upper = cols >= HALF
    pcols = tl.where(upper, cols - HALF, cols + HALF)
    xp = tl.load(row_ptr + pcols[None, :], mask=m2, other=0.0).to(tl.float32)
    x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + pcols, mask=col_ok, other=0.0).to(tl.float32)
    angle = pos.to(tl.float32)[:, None] * tl.load(inv_freq_ptr + tl.where(upper, pcols, cols), mask=col_ok,
                                                  other=0.0)[None, :]
    c = tl.cos(angle).to(dtype).to(tl.float32)
    s = tl.sin(angle).to(dtype).to(tl.float32)
    return _normed_rotated(x, xp, w[None, :], wp[None, :], inv[:, None], c, s, upper[None, :], dtype)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_ptr, stride_t, num_heads, eps,
                         HALF: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # queries first, then keys: their order in qkv's columns
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    row = qkv_ptr + tok * stride_t + head * (2 * HALF)
    x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
    if head < num_heads:
        w1 = tl.load(qw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(qw_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        out = q_ptr + (tok * num_heads + head) * (2 * HALF)
    else:
        w1 = tl.load(kw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(kw_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        out = k_ptr + (tok * (tl.num_programs(1) - num_heads) + head - num_heads) * (2 * HALF)
    dtype = q_ptr.dtype.element_ty
    # RoPE with fp32 angles and cos/sin rounded to the model dtype, like a model's tables.
    angle = tl.load(pos_ptr + tok).to(tl.float32) * tl.load(inv_freq_ptr + offs, mask=mask, other=0.0)
    c = tl.cos(angle).to(dtype).to(tl.float32)
    s = tl.sin(angle).to(dtype).to(tl.float32)
    tl.store(out + offs, _normed_rotated(x1, x2, w1, w2, inv, c, s, False, dtype), mask=mask)
    tl.store(out + HALF + offs, _normed_rotated(x2, x1, w2, w1, inv, c, s, True, dtype), mask=mask)


def qk_norm_rope_triton(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, positions: torch.Tensor,
                        inv_freq: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float):
    """Same contract as ``qk_norm_rope_naive``; ``qkv`` rows may be strided (``stride(1) == 1``)."""
    n = qkv.shape[0]
    half = inv_freq.shape[0]
    q = qkv.new_empty(n, num_heads, 2 * half)
    k = qkv.new_empty(n, num_kv_heads, 2 * half)
    if n:
        _qk_norm_rope_kernel[(n, num_heads + num_kv_heads)](
            qkv, q_weight, k_weight, positions, inv_freq, q, k, qkv.stride(0), num_heads, eps,
            HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1 if half <= 64 else 2,
            **pdl_launch_args(qkv.device, n == 1))
    return q, k
