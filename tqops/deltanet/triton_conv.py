"""Triton causal depthwise conv over packed sequences, reading each sequence's conv state from a pool row."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .bounds import sequence_end, sequence_start

BLOCK_T = 16  # tokens per tile: a decode token or a whole verify block in one pass
BLOCK_C = 128  # channels per program
# where the kernel leaves each sequence's new conv state
NO_STATE = tl.constexpr(0)
NEW_TENSOR = tl.constexpr(1)
IN_PLACE = tl.constexpr(2)


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
                 W: tl.constexpr, W1P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                 HAS_IDX: tl.constexpr, HAS_KEEP: tl.constexpr, SILU: tl.constexpr, STATE_OUT: tl.constexpr):
    b = tl.program_id(0)
    batch = tl.num_programs(0) - 1
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    in0, in1, in2 = cols < split0, (cols >= split0) & (cols < split1), cols >= split1
    t_offs = tl.arange(0, BLOCK_T)
    if b == batch:  # the rows no sequence covers, before the first and past the last: zeros
        _zero_rows(out0_ptr, out1_ptr, out2_ptr, 0, sequence_start(qsl_ptr, 0, num_tokens), cols, C, split0, split1,
                   BLOCK_T, BLOCK_C)
        _zero_rows(out0_ptr, out1_ptr, out2_ptr, sequence_start(qsl_ptr, batch, num_tokens), num_tokens, cols, C,
                   split0, split1, BLOCK_T, BLOCK_C)
    else:
        start = sequence_start(qsl_ptr, b, num_tokens)
        length = (sequence_end(qsl_ptr, b, start, num_tokens) - start).to(tl.int32)
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
        if STATE_OUT != NO_STATE:
            kept = length
            if HAS_KEEP:
                kept = tl.minimum(tl.maximum(tl.load(keep_ptr + b).to(tl.int32), 0), length)
            # the new state: the last W - 1 timeline steps before token `kept`, i.e. steps kept .. kept + W - 2,
            # loaded whole before any store, so writing it over the row it was read from is safe
            j = tl.arange(0, W1P)[None, :]
            step = kept + j
            m = cmask[:, None] & (j < W - 1)
            xs = tl.load(x_ptr + (start + step - (W - 1)).to(tl.int64) * stride_x + cols[:, None],
                         mask=m & (step >= W - 1), other=0.0)
            ss = tl.load(s_base[:, None] + step * stride_ss, mask=m & (step < W - 1), other=0.0)
            new = tl.where(step < W - 1, ss, xs).to(new_state_ptr.dtype.element_ty)
            if STATE_OUT == IN_PLACE:
                tl.store(s_base[:, None] + j * stride_ss, new, mask=m)
            else:
                tl.store(new_state_ptr + b.to(tl.int64) * C * (W - 1) + cols[:, None] * (W - 1) + j, new, mask=m)


def conv_varlen(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor, *,
                state_indices: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None,
                splits: Optional[tuple[int, int]] = None, silu: bool = True, state_out: str = "new"):
    """``causal_conv1d`` in one launch: x ``[n, C]`` (rows may be strided), weight ``[C, W]``, conv_state
    ``[R, C, W - 1]``, query_start_loc ``[batch + 1]`` (the kernel clamps it into [0, n] and makes it
    non-decreasing, as ``ops._bounds`` does). Sequence b starts from pool row ``state_indices[b]`` (negative: the
    spare last row ``R - 1``), or row b without indices. Returns (outputs, new state): the outputs are y ``[n, C]``
    split by channel at ``splits`` (each part contiguous; rows no sequence covers 0); the state after each
    sequence's first ``keep[b]`` tokens (clamped into [0, len]; all tokens without ``keep``) comes back as a new
    ``[batch, C, W - 1]`` tensor (``state_out="new"``), is written over the sequences' pool rows (``"in_place"``,
    returning None), or is not made (``"none"``). No host sync."""
    n, c = x.shape
    batch, w1 = query_start_loc.shape[0] - 1, conv_state.shape[2]
    s0, s1 = splits if splits is not None else (c, c)
    outs = [x.new_empty(n, width) for width in (s0, s1 - s0, c - s1)]
    mode = {"none": NO_STATE, "new": NEW_TENSOR, "in_place": IN_PLACE}[state_out]
    new_state = conv_state.new_empty(batch, c, w1) if mode == NEW_TENSOR else None
    if mode == IN_PLACE and state_indices is None:
        raise ValueError("conv_varlen: state_out='in_place' needs state_indices")
    if batch == 0 and n == 0:
        return tuple(outs) if splits is not None else outs[0], new_state
    if x.stride(1) != 1:
        x = x.contiguous()
    dummy = query_start_loc
    grid = (batch + 1, triton.cdiv(c, BLOCK_C))
    _conv_kernel[grid](
        x, weight.contiguous(), conv_state, state_indices if state_indices is not None else dummy, query_start_loc,
        keep if keep is not None else dummy, outs[0], outs[1] if s1 > s0 else outs[0], outs[2] if c > s1 else outs[0],
        new_state if new_state is not None else conv_state, n, c, s0, s1, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), conv_state.stride(2), conv_state.shape[0] - 1, W=w1 + 1,
        W1P=triton.next_power_of_2(w1), BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, HAS_IDX=state_indices is not None,
        HAS_KEEP=keep is not None, SILU=silu, STATE_OUT=mode)
    return (tuple(outs) if splits is not None else outs[0]), new_state
