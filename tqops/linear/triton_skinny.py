"""The skinny GEMM: 2-16 input rows against a large weight, each program streaming BLOCK_N weight rows over the whole K
through a deep pipeline, the input rows padded to one 16-row MMA tile."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from .triton_gemv import _interpreted

# The rows and weights it runs: at 8 and 16 rows cuBLAS picks tiles that leave part of the GPU idle or split K with
# an extra reduction kernel for the Qwen3-8B projections (34-201 MB), and this kernel was faster for each; for the
# 2-13 MB Qwen3-0.6B projections it was even or slower (docs/tuning.md, "Linear: the skinny GEMM").
MAX_ROWS = 16  # from 2: one row runs the GEMV
MIN_WEIGHT_BYTES = 16 << 20


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   UPCAST: tl.constexpr, USE_PDL: tl.constexpr):
    """out^T [BLOCK_N, 16] = W [BLOCK_N, K] @ x^T [K, 16]: the weight rows are the MMA's M side (16-64 of them), the
    input rows its N side, so no weight tile is padded."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_x + offs_k[:, None]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_rows + k0, mask=n_ok[:, None], other=0.0)
            xt = tl.load(x_cols + k0, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k0 + offs_k < K
            w = tl.load(w_rows + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_cols + k0, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:  # the interpreter's 16-bit dot is not exact; fp32 products are what the tensor cores give
            w, xt = w.to(tl.float32), xt.to(tl.float32)
        acc = tl.dot(w, xt, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + offs_m.to(tl.int64)[None, :] * stride_o + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def skinny_config(in_features: int) -> dict:
    """64 weight rows per program and 256-wide K chunks, 4 in flight (128 KB of shared memory): one tile that was the
    fastest, or close to it, for each Qwen3-8B projection at 8 and 16 rows (docs/tuning.md)."""
    return dict(block_n=64, block_k=min(256, max(16, triton.next_power_of_2(in_features))), num_warps=4,
                num_stages=4)


def skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       **override) -> torch.Tensor:
    """``x [M, K]`` (M <= 16, unit stride along K) -> ``x @ weight.T + bias`` ``[M, N]``, ``weight [N, K]`` with unit
    stride along K; fp32 products and sums, one rounding to x's dtype. Also runs on CPU tensors under
    ``TRITON_INTERPRET=1``; the keyword overrides (``block_n`` >= 16, ``block_k`` >= 16, ``num_warps``,
    ``num_stages``) are for tests and tuning."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"x has {m} rows; the skinny GEMM takes at most {MAX_ROWS}")
    cfg = dict(skinny_config(k), **override)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    _skinny_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], EVEN_K=k % cfg["block_k"] == 0,
        UPCAST=_interpreted(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_launch_args(x.device))
    return out
