"""Triton causal depthwise conv over packed sequences, reading each sequence's conv state from a pool row."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_T = 16  # tokens per tile: a decode token or a whole verify block in one pass
BLOCK_C = 128  # channels per program


@triton.jit
def _zero_rows(out0_ptr, out1_ptr, out2_ptr, lo, hi, cols, C, split0, split1, BLOCK_T: tl.constexpr,
               BLOCK_C: tl.constexpr):
    """Zeros in rows [lo, hi) of the three output parts, at this program's channels ``cols``."""
    zero = tl.zeros((BLOCK_T, BLOCK_C), dtype=out0_ptr.dtype.element_ty)
    in0, in1, in2 = cols < split0, (cols >= split0) & (cols < split1), (cols >= split1) & (cols < C)
    for t0 in range(lo, hi, BLOCK_T):
        t = (t0 + tl.arange(0, BLOCK_T))[:, None].to(tl.int64)
        m = t < hi
        tl.store(out0_ptr + t * split0 + cols[None, :], zero, mask=m & in0[None, :])
        tl.store(out1_ptr + t * (split1 - split0) + (cols - split0)[None, :], zero, mask=m & in1[None, :])
        tl.store(out2_ptr + t * (C - split1) + (cols - split1)[None, :], zero, mask=m & in2[None, :])


@triton.jit
def _conv_kernel(x_ptr, w_ptr, state_ptr, idx_ptr, qsl_ptr, keep_ptr, out0_ptr, out1_ptr, out2_ptr, new_state_ptr,
                 num_tokens, C, split0, split1, stride_x, stride_sr, stride_sc, stride_ss, spare_row,
                 W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_IDX: tl.constexpr,
                 HAS_KEEP: tl.constexpr, SILU: tl.constexpr):
    b = tl.program_id(0)
    batch = tl.num_programs(0) - 1
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    in0, in1, in2 = cols < split0, (cols >= split0) & (cols < split1), cols >= split1
    t_offs = tl.arange(0, BLOCK_T)
    if b == batch:  # the rows no sequence covers, before the first and past the last: zeros
        _zero_rows(out0_ptr, out1_ptr, out2_ptr, 0, tl.load(qsl_ptr), cols, C, split0, split1, BLOCK_T, BLOCK_C)
        _zero_rows(out0_ptr, out1_ptr, out2_ptr, tl.load(qsl_ptr + batch), num_tokens, cols, C, split0, split1,
                   BLOCK_T, BLOCK_C)
    else:
        start = tl.load(qsl_ptr + b)
        length = tl.load(qsl_ptr + b + 1) - start
        row = b
        if HAS_IDX:
            row = tl.load(idx_ptr + b)
            row = tl.where(row < 0, spare_row, row)
        s_base = state_ptr + row.to(tl.int64) * stride_sr + cols * stride_sc
        for t0 in range(0, length, BLOCK_T):  # token j of the sequence reads timeline steps j .. j + W - 1
            t = t0 + t_offs
            tmask = (t < length)[:, None] & cmask[None, :]
            acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
            for i in tl.static_range(W):
                step = t + i
                from_state = (step < W - 1)[:, None]
                xs = tl.load(x_ptr + (start + step - (W - 1)).to(tl.int64)[:, None] * stride_x + cols[None, :],
                             mask=tmask & ~from_state, other=0.0).to(tl.float32)
                ss = tl.load(s_base[None, :] + step[:, None] * stride_ss, mask=tmask & from_state,
                             other=0.0).to(tl.float32)
                wi = tl.load(w_ptr + cols * W + i, mask=cmask, other=0.0).to(tl.float32)
                acc += tl.where(from_state, ss, xs) * wi[None, :]
            if SILU:
                acc = acc * tl.sigmoid(acc)
            y = acc.to(out0_ptr.dtype.element_ty)
            r = (start + t).to(tl.int64)[:, None]
            tl.store(out0_ptr + r * split0 + cols[None, :], y, mask=tmask & in0[None, :])
            tl.store(out1_ptr + r * (split1 - split0) + (cols - split0)[None, :], y, mask=tmask & in1[None, :])
            tl.store(out2_ptr + r * (C - split1) + (cols - split1)[None, :], y, mask=tmask & in2[None, :])
        kept = length
        if HAS_KEEP:
            kept = tl.minimum(tl.maximum(tl.load(keep_ptr + b).to(tl.int32), 0), length)
        # the new state: the last W - 1 timeline steps before token `kept`, i.e. steps kept .. kept + W - 2
        out_base = new_state_ptr + b.to(tl.int64) * C * (W - 1) + cols * (W - 1)
        for j in tl.static_range(W - 1):
            step = kept + j + tl.zeros([BLOCK_C], dtype=tl.int32)
            xs = tl.load(x_ptr + (start + step - (W - 1)).to(tl.int64) * stride_x + cols,
                         mask=cmask & (step >= W - 1), other=0.0)
            ss = tl.load(s_base + step * stride_ss, mask=cmask & (step < W - 1), other=0.0)
            tl.store(out_base + j, tl.where(step < W - 1, ss, xs).to(new_state_ptr.dtype.element_ty), mask=cmask)


def conv_varlen(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor, *,
                state_indices: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None,
                splits: Optional[tuple[int, int]] = None, silu: bool = True):
    """``causal_conv1d`` in one launch: x ``[n, C]`` (rows may be strided), weight ``[C, W]``, conv_state ``[R, C,
    W - 1]``, query_start_loc ``[batch + 1]`` already in bounds (non-decreasing, in [0, n]). Sequence b starts
    from pool row ``state_indices[b]`` (negative: the spare last row ``R - 1``), or row b without indices. Returns
    (outputs, new state ``[batch, C, W - 1]``): the outputs are y ``[n, C]`` split by channel at ``splits`` (each
    part contiguous; rows past the last sequence 0), the state that after each sequence's first ``keep[b]`` tokens
    (clamped into [0, len]; all tokens without ``keep``). No host sync."""
    n, c = x.shape
    batch, w1 = query_start_loc.shape[0] - 1, conv_state.shape[2]
    s0, s1 = splits if splits is not None else (c, c)
    outs = [x.new_empty(n, width) for width in (s0, s1 - s0, c - s1)]
    new_state = conv_state.new_empty(batch, c, w1)
    if batch == 0 and n == 0:
        return tuple(outs) if splits is not None else outs[0], new_state
    if x.stride(1) != 1:
        x = x.contiguous()
    dummy = query_start_loc
    grid = (batch + 1, triton.cdiv(c, BLOCK_C))
    _conv_kernel[grid](
        x, weight.contiguous(), conv_state, state_indices if state_indices is not None else dummy, query_start_loc,
        keep if keep is not None else dummy, outs[0], outs[1] if s1 > s0 else outs[0], outs[2] if c > s1 else outs[0],
        new_state, n, c, s0, s1, x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        conv_state.shape[0] - 1, W=w1 + 1, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, HAS_IDX=state_indices is not None,
        HAS_KEEP=keep is not None, SILU=silu)
    return (tuple(outs) if splits is not None else outs[0]), new_state
