"""The one-row GEMV kernel: each program reduces BLOCK_N weight rows against the input row over the whole K, the
input made on the fly by a prologue (none, residual add + RMSNorm, or SiLU-and-multiply)."""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ..pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

# The GEMV's input prologues (constexpr, so kernels can read them as globals).
PLAIN: tl.constexpr = tl.constexpr(0)
ADD_RMS_NORM: tl.constexpr = tl.constexpr(1)
SILU_MUL: tl.constexpr = tl.constexpr(2)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _input_chunk(x_ptr, res_ptr, nw_ptr, offs_k, k_ok, K, inv, PROLOGUE: tl.constexpr, MASKED: tl.constexpr):
    """The fp32 input row at ``offs_k``, rounded where the unfused ops round (to the input dtype)."""
    dtype = x_ptr.dtype.element_ty
    if MASKED:
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs_k).to(tl.float32)
    if PROLOGUE == ADD_RMS_NORM:
        if MASKED:
            r = tl.load(res_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        else:
            r = tl.load(res_ptr + offs_k).to(tl.float32)
            nw = tl.load(nw_ptr + offs_k).to(tl.float32)
        normed = ((x + r).to(dtype).to(tl.float32) * inv).to(dtype).to(tl.float32)
        x = (normed * nw).to(dtype).to(tl.float32)
    elif PROLOGUE == SILU_MUL:
        # x is the gate half of the row, the up half follows K elements later; one rounding, as Inductor's fused
        # SiLU-and-multiply
        if MASKED:
            u = tl.load(x_ptr + K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        else:
            u = tl.load(x_ptr + K + offs_k).to(tl.float32)
        x = (x / (1.0 + tl.exp(-x)) * u).to(dtype).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, sum_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_w, eps,
                 PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRE_K: tl.constexpr, EVEN_K: tl.constexpr, ROW: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    # The first PRE_K weight columns (all of K where they fit in registers) are loaded before waiting for the
    # previous kernel: no kernel writes weights, so under PDL these loads overlap the kernels still running.
    offs_p = tl.arange(0, PRE_K)
    p_ok = offs_p < K
    if EVEN_K:
        w = tl.load(rows + offs_p[None, :], mask=n_ok[:, None], other=0.0)
    else:
        w = tl.load(rows + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0.0)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    inv = 1.0
    if PROLOGUE == ADD_RMS_NORM:
        # Every program normalizes the whole row itself (it is small and in L2); program 0 also writes the sum.
        offs = tl.arange(0, ROW)
        ok = offs < K
        total = (tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                 + tl.load(res_ptr + offs, mask=ok, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        if pid == 0:
            tl.store(sum_ptr + offs, total, mask=ok)
        h = total.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / K + eps)
    x = _input_chunk(x_ptr, res_ptr, nw_ptr, offs_p, p_ok, K, inv, PROLOGUE, not EVEN_K)
    # The preloaded columns reduce at once; the loop's products accumulate per lane and reduce once, after it.
    # (Folding the preloaded tile into the loop's [BLOCK_N, BLOCK_K] accumulator with a reshape makes Triton pass it
    # through shared memory, far slower: docs/tuning.md.)
    y = tl.sum(w.to(tl.float32) * x[None, :], 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(PRE_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if EVEN_K:
            w_k = tl.load(rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            w_k = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x_k = _input_chunk(x_ptr, res_ptr, nw_ptr, offs_k, k_ok, K, inv, PROLOGUE, not EVEN_K)
        acc += w_k.to(tl.float32) * x_k[None, :]
    if PRE_K < K:
        y += tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    g = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + width + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul_triton(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``[n, 2 * width]`` (gate, then up; unit stride along the row) -> ``silu(gate) * up`` ``[n, width]``, one
    rounding: the unfused activation of the rows the GEMV does not take. Launched with PDL where ``pdl`` (an
    activation whose next kernel is the skinny GEMM)."""
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, width), dtype=gate_up.dtype, device=gate_up.device)
    if n and width:
        block = min(1024, triton.next_power_of_2(width))
        _silu_mul_kernel[(n, triton.cdiv(width, block))](gate_up, out, width, gate_up.stride(0), out.stride(0),
                                                           BLOCK=block, num_warps=4,
                                                           **pdl_launch_args(gate_up.device, pdl))
    return out


PRELOAD_BYTES = 16384  # weight bytes a program loads before its PDL wait: 32 registers a thread at 4 warps
SMALL_WEIGHT_BYTES = 16 << 20  # up to this size a weight gets half the rows per program (docs/tuning.md)


def gemv_config(out_features: int, in_features: int, element_size: int = 2) -> dict:
    """Tile and launch parameters from the shape: enough programs to fill the GPU several times over (BLOCK_N
    weight rows each, 4 to 16, halved for weights of at most 16 MB), 512-wide K chunks, software pipelining only
    for long rows, and ``pre_k``: the leading weight columns loaded before the PDL wait, a power-of-two number of
    chunks within ``PRELOAD_BYTES`` and K (docs/tuning.md)."""
    block_n = min(16, max(4, triton.next_power_of_2(triton.cdiv(out_features, 1024))))
    if out_features * in_features * element_size <= SMALL_WEIGHT_BYTES:
        block_n = max(2, block_n // 2)  # twice the programs: measured faster in the step for small weights only
    block_k = min(512, triton.next_power_of_2(in_features))
    pre_k = block_k
    if in_features % block_k == 0:
        while 2 * pre_k <= in_features and block_n * 2 * pre_k * element_size <= PRELOAD_BYTES:
            pre_k *= 2
    return dict(block_n=block_n, block_k=block_k, pre_k=pre_k, num_warps=8 if block_n >= 16 else 4,
                num_stages=3 if in_features > 2048 else 1)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                residual: Optional[torch.Tensor] = None, norm_weight: Optional[torch.Tensor] = None,
                eps: float = 0.0, prologue: int = PLAIN, **override):
    """One input row (contiguous) -> ``[1, N]``, ``weight [N, K]`` with unit stride along K. The row is ``x [1, K]``
    (PLAIN); ``rms_norm(x + residual) * norm_weight`` (ADD_RMS_NORM; also returns the sum ``[1, K]``); or
    ``silu(gate) * up`` of ``x [1, 2K]`` (SILU_MUL). Also runs on CPU tensors under ``TRITON_INTERPRET=1``; the
    keyword overrides are for tests and tuning."""
    n, k = weight.shape
    cfg = dict(gemv_config(n, k, weight.element_size()), **override)
    if "block_k" in override and "pre_k" not in override:
        cfg["pre_k"] = cfg["block_k"]
    # PRE_K: a power-of-two number of BLOCK_K chunks; unmasked loads (EVEN_K) only where it and K are whole chunks
    if cfg["pre_k"] % cfg["block_k"] or triton.next_power_of_2(cfg["pre_k"]) != cfg["pre_k"]:
        raise ValueError(f"pre_k={cfg['pre_k']}; expected a power of two and a multiple of block_k={cfg['block_k']}")
    even_k = k % cfg["block_k"] == 0 and cfg["pre_k"] <= k
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    total = torch.empty((1, k), dtype=x.dtype, device=x.device) if prologue == ADD_RMS_NORM else None
    if n == 0 or k == 0:
        if total is not None:
            total.copy_(x + residual)
        out = out.zero_() if bias is None else out.copy_(bias)
    else:
        _gemv_kernel[(triton.cdiv(n, cfg["block_n"]),)](
            x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
            total if total is not None else out, weight, bias if bias is not None else weight, out, n, k,
            weight.stride(0), eps,
            PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
            PRE_K=cfg["pre_k"], EVEN_K=even_k, ROW=triton.next_power_of_2(k),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch_args(x.device))
    return out if total is None else (out, total)
