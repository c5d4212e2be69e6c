"""The one-row GEMV kernel: each program reduces BLOCK_N weight rows against the input row over the whole K."""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_w,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    # Products accumulate per lane and are reduced across lanes once, after the loop.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + offs_k)
        else:
            k_ok = offs_k < K
            w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv_config(out_features: int, in_features: int) -> dict:
    """Tile and launch parameters from the shape: enough programs to fill the GPU several times over (BLOCK_N
    weight rows each, 4 to 16), 512-wide K chunks, and software pipelining only for long rows (docs/tuning.md)."""
    block_n = min(16, max(4, triton.next_power_of_2(triton.cdiv(out_features, 1024))))
    block_k = min(512, triton.next_power_of_2(in_features))
    return dict(block_n=block_n, block_k=block_k, num_warps=8 if block_n >= 16 else 4,
                num_stages=3 if in_features > 2048 else 1)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, **override) -> torch.Tensor:
    """``x [1, K]`` (contiguous) -> ``x @ weight.T + bias`` ``[1, N]``; ``weight [N, K]`` with unit stride along K.
    Also runs on CPU tensors under ``TRITON_INTERPRET=1``; the keyword overrides are for tests and tuning."""
    n, k = weight.shape
    cfg = dict(gemv_config(n, k), **override)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias)
    _gemv_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], EVEN_K=k % cfg["block_k"] == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
