"""Merging the split-KV partials of paged attention into the output (and the sink logits into the softmax)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait


@triton.jit
def _combine_splits_kernel(
    part_ptr, ml_ptr, sinks_ptr, qsl_ptr, out_ptr, stride_ot, stride_oh,
    num_tokens, num_seqs,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Merge the splits of one token x HEADS_PER_PROGRAM heads: [heads, splits, HEAD_DIM] partials -> output."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    sp = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    # Padding tokens past query_start_loc[-1] belong to no sequence: no split wrote them.
    valid = t < tl.load(qsl_ptr + num_seqs)
    h_ok = h < NUM_Q_HEADS
    base = (sp.to(tl.int64)[None, :] * num_tokens + t) * NUM_Q_HEADS + h[:, None]  # [heads, splits]
    # Comparisons, not `&` with a scalar: the interpreter needs bool tensors.
    ok = h_ok[:, None] & (sp[None, :] < tl.where(valid, NUM_SPLITS, 0))
    m = tl.load(ml_ptr + base * 2, mask=ok, other=-1.0e30)
    l = tl.load(ml_ptr + base * 2 + 1, mask=ok, other=0.0)
    acc = tl.load(part_ptr + base[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=ok[:, :, None], other=0.0)
    m_f = tl.max(m, 1)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h, mask=h_ok, other=0.0) * 1.4426950408889634
        m_f = tl.maximum(m_f, sink)
        w = tl.exp2(m - m_f[:, None])
        denom = tl.sum(w * l, 1) + tl.exp2(sink - m_f)
    else:
        w = tl.exp2(m - m_f[:, None])
        denom = tl.sum(w * l, 1)
    o = tl.sum(acc * w[:, :, None], 1)
    # Rows that saw no key have o = 0 and denom = 0, so they come out 0; a NaN denominator (a NaN the row attended
    # to) must stay NaN, which a `denom > 0` select would zero.
    o = tl.where(valid, o / tl.maximum(denom, 1e-30)[:, None], 0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


def _combine_heads_per_program(num_q_heads: int, num_splits: int, head_dim: int) -> int:
    """Up to 4 heads per combine program, at most 8K partial elements each: with one head per program the combiner
    spends most of its time on per-program latency (docs/tuning.md)."""
    heads = 4
    while heads > 1 and heads * num_splits * head_dim > 8192:
        heads //= 2
    return min(heads, triton.next_power_of_2(num_q_heads))


def combine_splits(part: torch.Tensor, ml: torch.Tensor, sinks: Optional[torch.Tensor],
                   query_start_loc: torch.Tensor, out: torch.Tensor, batch: int) -> None:
    """Merge split-KV partials into ``out`` [num_tokens, num_q_heads, head_dim] (written in place).

    ``part`` [splits, num_tokens, num_q_heads, head_dim] holds unnormalized fp32 outputs and ``ml`` [splits, num_tokens,
    num_q_heads, 2] each split's running max (log2 units) and softmax denominator."""
    num_splits, num_tokens, num_q_heads, head_dim = part.shape
    heads = _combine_heads_per_program(num_q_heads, num_splits, head_dim)
    _combine_splits_kernel[(num_tokens, triton.cdiv(num_q_heads, heads))](
        part, ml, sinks if sinks is not None else ml, query_start_loc, out, out.stride(0), out.stride(1),
        num_tokens, batch,
        NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, HAS_SINKS=sinks is not None,
        HEADS_PER_PROGRAM=heads, num_warps=4 if head_dim * heads >= 128 else 2,
        **pdl_launch_args(out.device, num_tokens == 1),  # one row: a decode step's, before a one-row GEMV
    )
