"""Triton gated delta rule over packed sequences with states in a pool: rows in place, gates fused, kept prefixes."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .bounds import sequence_end, sequence_start

BLOCK_V = 8  # value columns per program: a [dk, 8] fp32 state tile stays in one warp's registers


@triton.jit
def _in_dtype_of(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to DTYPE and back, as torch rounds (beta is ``b.sigmoid()`` in the model's dtype). bf16 by
    its bits, round to nearest even: the same on the GPU and in the interpreter, whose bf16 casts truncate."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float32:
        return x
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dt_ptr, pool_ptr, idx_ptr, qsl_ptr, keep_ptr,
                      o_ptr, num_tokens, spare_row, scale, stride_q, stride_k, stride_v, stride_a, stride_ah, stride_b,
                      stride_bh,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, HAS_KEEP: tl.constexpr, WRITE_STATE: tl.constexpr, STORE_O: tl.constexpr,
                      L2NORM: tl.constexpr):
    i_v, i_hv, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    batch = tl.num_programs(2) - 1
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    if b == batch:  # rows no sequence covers, before the first and past the last: zeros
        if STORE_O:
            first = sequence_start(qsl_ptr, 0, num_tokens)
            last = sequence_start(qsl_ptr, batch, num_tokens)
            zero = tl.zeros([BV], dtype=o_ptr.dtype.element_ty)
            for t in range(0, first):
                tl.store(o_ptr + (t * HV + i_hv) * V + o_v, zero, mask=mask_v)
            for t in range(last, num_tokens):
                tl.store(o_ptr + (t * HV + i_hv) * V + o_v, zero, mask=mask_v)
    else:
        start = sequence_start(qsl_ptr, b, num_tokens)
        end = sequence_end(qsl_ptr, b, start, num_tokens)
        stop = end
        if HAS_KEEP:  # tokens past the kept prefix leave the state as it is: not run at all
            stop = start + tl.minimum(tl.maximum(tl.load(keep_ptr + b).to(tl.int64), 0), end - start)
        row = tl.load(idx_ptr + b).to(tl.int64)
        row = tl.where(row < 0, spare_row, row)
        p_h = pool_ptr + ((row * HV + i_hv) * K + o_k[:, None]) * V + o_v[None, :]
        mask_h = mask_k[:, None] & mask_v[None, :]
        h = tl.load(p_h, mask=mask_h, other=0.0)
        a_log = tl.load(alog_ptr + i_hv).to(tl.float32)
        dt_bias = tl.load(dt_ptr + i_hv).to(tl.float32)
        for t in range(start, stop):
            b_q = tl.load(q_ptr + t * stride_q + i_h * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
            b_k = tl.load(k_ptr + t * stride_k + i_h * K + o_k, mask=mask_k, other=0.0).to(tl.float32)
            b_v = tl.load(v_ptr + t * stride_v + i_hv * V + o_v, mask=mask_v, other=0.0).to(tl.float32)
            if L2NORM:
                b_q = b_q * (1.0 / tl.sqrt(tl.sum(b_q * b_q) + 1e-6))
                b_k = b_k * (1.0 / tl.sqrt(tl.sum(b_k * b_k) + 1e-6))
            b_q = b_q * scale
            beta = _in_dtype_of(tl.sigmoid(tl.load(b_ptr + t * stride_b + i_hv * stride_bh).to(tl.float32)),
                                b_ptr.dtype.element_ty)
            x = tl.load(a_ptr + t * stride_a + i_hv * stride_ah).to(tl.float32) + dt_bias
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
            h = h * tl.exp(-tl.exp(a_log) * softplus)
            delta = beta * (b_v - tl.sum(h * b_k[:, None], 0))
            h = h + b_k[:, None] * delta[None, :]
            if STORE_O:
                b_o = tl.sum(h * b_q[:, None], 0)
                tl.store(o_ptr + (t * HV + i_hv) * V + o_v, b_o.to(o_ptr.dtype.element_ty), mask=mask_v)
        if STORE_O:  # the tokens past the kept prefix still get outputs: zeros
            for t in range(stop, end):
                tl.store(o_ptr + (t * HV + i_hv) * V + o_v, tl.zeros([BV], dtype=o_ptr.dtype.element_ty),
                         mask=mask_v)
        if WRITE_STATE:
            tl.store(p_h, h, mask=mask_h)


def recurrent_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   A_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor, state_indices: torch.Tensor,
                   query_start_loc: torch.Tensor, *, keep: Optional[torch.Tensor] = None, write_state: bool = True,
                   output: bool = True, scale: Optional[float] = None,
                   use_qk_l2norm: bool = True) -> Optional[torch.Tensor]:
    """The gated delta rule of a layer's step in one launch, states in place: q, k ``[n, Hk, dk]``, v ``[n, Hv, dv]``
    (rows may be strided), the raw gates a, b ``[n, Hv]`` with ``A_log``, ``dt_bias`` ``[Hv]`` (g = -exp(A_log) *
    softplus(a + dt_bias), beta = sigmoid(b)), pool ``[R, Hv, dk, dv]`` fp32 contiguous. Sequence b runs from pool
    row ``state_indices[b]`` (negative: the spare last row) over its first ``keep[b]`` tokens (all without keep)
    and, with ``write_state``, leaves its state there. Returns o ``[n, Hv, dv]`` in v's dtype (0 where no kept token
    of a sequence is) or None without ``output``. No host sync."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1:]
    batch = state_indices.shape[0]
    o = v.new_empty(n, hv, dv) if output else None
    if n == 0 and batch == 0:
        return o
    if any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (q, k, v)):
        raise ValueError("recurrent_rows: the heads of a q, k or v row must be contiguous")
    grid = (triton.cdiv(dv, BLOCK_V), hv, batch + 1)
    _recurrent_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, pool, state_indices, query_start_loc,
        keep if keep is not None else state_indices, o if o is not None else v, n, pool.shape[0] - 1,
        dk ** -0.5 if scale is None else scale, q.stride(0), k.stride(0), v.stride(0), a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), H=hk, HV=hv, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=BLOCK_V, HAS_KEEP=keep is not None,
        WRITE_STATE=write_state, STORE_O=output, L2NORM=use_qk_l2norm, num_warps=1)
    return o
