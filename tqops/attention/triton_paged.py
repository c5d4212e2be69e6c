"""Triton split-KV paged attention over every cache format, with query tokens x GQA group as the M tile."""
from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ..formats import CacheFormat
from ..quant import lloyd_max, rotation_matrix

_KEY_MODES = {"dense": 0, "fp8": 1, "mse": 2}
_VALUE_MODES = {"dense": 0, "fp8": 1, "uniform": 2}
_LOG2E = 1.4426950408889634


# ---- in-register decoders: cache rows -> [BLOCK_N, HEAD_DIM] tiles -------------------------------------


@triton.jit
def _unpack_codes(cache_u8, row, mask, BITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Packed b-bit codes starting at byte offsets ``row`` [BLOCK_N] -> int32 codes [BLOCK_N, HEAD_DIM]."""
    if BITS == 4:
        cols = tl.arange(0, HEAD_DIM // 2)
        b = tl.load(cache_u8 + row[:, None] + cols[None, :], mask=mask[:, None], other=0).to(tl.int32)
        # Low nibble is the even channel: interleave (lo, hi) back into channel order.
        codes = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_N, HEAD_DIM))
    else:
        # 3 bits: 8 codes per 3 bytes, a little-endian 24-bit word per group of 8 channels.
        grp = tl.arange(0, HEAD_DIM // 8)
        p = cache_u8 + row[:, None] + 3 * grp[None, :]
        b0 = tl.load(p, mask=mask[:, None], other=0).to(tl.int32)
        b1 = tl.load(p + 1, mask=mask[:, None], other=0).to(tl.int32)
        b2 = tl.load(p + 2, mask=mask[:, None], other=0).to(tl.int32)
        w = b0 | (b1 << 8) | (b2 << 16)
        # Nested joins put code k of each group at index 4*i1 + 2*i2 + i3 = k, i.e. channel 8*g + k.
        even = tl.join(tl.join(w & 7, (w >> 12) & 7), tl.join((w >> 6) & 7, (w >> 18) & 7))
        odd = tl.join(tl.join((w >> 3) & 7, (w >> 15) & 7), tl.join((w >> 9) & 7, (w >> 21) & 7))
        codes = tl.reshape(tl.join(even, odd), (BLOCK_N, HEAD_DIM))
    return codes


@triton.jit
def _paged_attention_kernel(
    q_ptr, stride_qt, stride_qh,
    cache_u8, cache_16, stride_cb, stride_cs, stride_ch,
    bt_ptr, stride_bt,
    seq_lens_ptr, qsl_ptr, sinks_ptr, cent_ptr,
    out_ptr, stride_os, stride_ot, stride_oh,
    ml_ptr,
    qk_scale, v_scale, window,
    num_seqs, num_tokens, num_blocks, max_blocks,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    KEY_MODE: tl.constexpr, KEY_BITS: tl.constexpr, VALUE_MODE: tl.constexpr, VALUE_BITS: tl.constexpr,
    K_NORM_OFF: tl.constexpr, V_OFF: tl.constexpr, V_SCALE_OFF: tl.constexpr,
    FP8: tl.constexpr, QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence b owns query tiles [start(b), start(b+1)) with start(b) = qsl[b] // BLOCK_Q + b: a static grid.
    # Tensors from the start: ints equal to 1 are specialized to constants, which cannot be loop-carried.
    lo = tl.full([], 0, tl.int32)
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if BLOCK_Q == 1:
            mid_start = tl.load(qsl_ptr + mid)
        else:
            mid_start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        ok = mid_start <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    b = lo
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if BLOCK_Q == 1:
        q_tile = pid - q_start
    else:
        q_tile = (pid - (q_start // BLOCK_Q + b)) * BLOCK_Q
    if q_tile >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    qi = offs_m // GROUP_PAD
    hg = offs_m % GROUP_PAD
    q_local = q_tile + qi
    token = q_start + q_local
    row_ok = (qi < BLOCK_Q) & (q_local < q_len) & (hg < GROUP) & (token >= 0) & (token < num_tokens)
    head = kvh * GROUP + hg
    pos = ctx + q_local
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None], other=0.0,
    ).to(tl.float32).to(QK_DTYPE)

    # Keys this tile can see, then this split's share of them (whole BLOCK_N tiles).
    tile_last = tl.minimum(q_tile + BLOCK_Q, q_len) - 1
    kv_end = tl.minimum(seq_len, max_blocks * BLOCK_SIZE)
    if CAUSAL:
        kv_end = tl.minimum(kv_end, ctx + tile_last + 1)
    kv_begin = 0
    if HAS_WINDOW:
        kv_begin = tl.maximum(ctx + q_tile - window + 1, 0)
        if not CAUSAL:
            kv_end = tl.minimum(kv_end, ctx + tile_last + window)
    kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
    n_keys = tl.maximum(kv_end - kv_begin, 0)
    per_split = tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_begin = kv_begin + split * per_split
    s_end = tl.minimum(kv_end, s_begin + per_split)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch
    for start in range(s_begin, s_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < s_end
        # Clamp block ids: garbage table entries must never address outside the cache.
        if BLOCK_N <= BLOCK_SIZE:
            blk = tl.load(bt_row + start // BLOCK_SIZE)
        else:
            blk = tl.load(bt_row + tl.minimum(offs_n // BLOCK_SIZE, max_blocks - 1), mask=n_ok, other=0)
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1)
        row = blk.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + head_off  # bytes [BLOCK_N]

        # ---- scores, in log2 units ----
        if KEY_MODE == 0:
            k = tl.load(cache_16 + (row // 2)[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        elif KEY_MODE == 1:
            kb = tl.load(cache_u8 + row[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0)
            k = kb.to(FP8, bitcast=True)
        else:
            codes = _unpack_codes(cache_u8, row, n_ok, KEY_BITS, HEAD_DIM, BLOCK_N)
            k = tl.load(cent_ptr + codes)
        s = tl.dot(q, tl.trans(k.to(tl.float32).to(QK_DTYPE)), out_dtype=tl.float32) * qk_scale
        if KEY_MODE == 2:
            norm = tl.load(cache_16 + (row + K_NORM_OFF) // 2, mask=n_ok, other=0.0).to(tl.float32)
            s = s * norm[None, :]
        vis = n_ok[None, :] & (offs_n[None, :] >= 0)
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            vis = vis & (pos[:, None] - offs_n[None, :] < window)
            if not CAUSAL:
                vis = vis & (offs_n[None, :] - pos[:, None] < window)
        s = tl.where(vis, s, float("-inf"))

        # ---- online softmax ----
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new

        # ---- values ----
        if VALUE_MODE == 0:
            v = tl.load(cache_16 + ((row + V_OFF) // 2)[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
            acc += tl.dot(p.to(PV_DTYPE), v.to(tl.float32).to(PV_DTYPE), out_dtype=tl.float32)
        elif VALUE_MODE == 1:
            vb = tl.load(cache_u8 + (row + V_OFF)[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0)
            v = vb.to(FP8, bitcast=True).to(tl.float32).to(PV_DTYPE)
            acc += tl.dot(p.to(PV_DTYPE), v, out_dtype=tl.float32)
        else:
            vcodes = _unpack_codes(cache_u8, row + V_OFF, n_ok, VALUE_BITS, HEAD_DIM, BLOCK_N)
            vsc = tl.load(cache_16 + (row + V_SCALE_OFF) // 2, mask=n_ok, other=0.0).to(tl.float32)
            vzp = tl.load(cache_16 + (row + V_SCALE_OFF + 2) // 2, mask=n_ok, other=0.0).to(tl.float32)
            # v = zero + code * scale: fold the scale into P, and the zero point is a rank-1 term.
            acc += tl.dot((p * vsc[None, :]).to(PV_DTYPE), vcodes.to(tl.float32).to(PV_DTYPE), out_dtype=tl.float32)
            acc += tl.sum(p * vzp[None, :], 1)[:, None]

    if VALUE_MODE == 1:
        acc = acc * v_scale
    out_off = token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            corr = tl.exp2(m_i - m_f)
            l_i = l_i * corr + tl.exp2(sink - m_f)
            acc = acc * corr[:, None]
        o = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        tl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(out_ptr + split * stride_os + out_off, acc, mask=row_ok[:, None])
        ml_off = ((split * num_tokens + token.to(tl.int64)) * (stride_ot // HEAD_DIM) + head) * 2
        tl.store(ml_ptr + ml_off, m_i, mask=row_ok)
        tl.store(ml_ptr + ml_off + 1, l_i, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    part_ptr, ml_ptr, sinks_ptr, qsl_ptr, out_ptr, stride_ot, stride_oh,
    num_tokens, num_seqs,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    # Padding tokens past query_start_loc[-1] belong to no sequence: no split wrote them.
    valid = t < tl.load(qsl_ptr + num_seqs)
    base = (sp.to(tl.int64) * num_tokens + t) * NUM_Q_HEADS + h
    sp_ok = sp < tl.where(valid, NUM_SPLITS, 0)  # a comparison, not `&` with a scalar: the interpreter needs bool
    m = tl.load(ml_ptr + base * 2, mask=sp_ok, other=-1.0e30)
    l = tl.load(ml_ptr + base * 2 + 1, mask=sp_ok, other=0.0)
    m_f = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * 1.4426950408889634
        m_f = tl.maximum(m_f, sink)
        w = tl.exp2(m - m_f)
        denom = tl.sum(w * l, 0) + tl.exp2(sink - m_f)
    else:
        w = tl.exp2(m - m_f)
        denom = tl.sum(w * l, 0)
    acc = tl.load(part_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=sp_ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0)
    o = tl.where(valid & (denom > 0), o / tl.maximum(denom, 1e-30), 0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


# ---- launch heuristics --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _centroids(bits: int, device: torch.device) -> torch.Tensor:
    return lloyd_max(bits)[0].to(device)


def _interpreting(device: torch.device) -> bool:
    return device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_config(num_tokens: int, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  block_size: int, max_blocks: int, num_sms: int) -> dict:
    """Tile sizes and split count from shapes only (never tensor values), so a CUDA graph can capture it."""
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    avg_q = max(1, -(-num_tokens // max(batch, 1)))
    block_q = max(1, min(triton.next_power_of_2(avg_q), max(1, 64 // group_pad)))
    block_m = max(16, block_q * group_pad)
    block_n = 64 if head_dim <= 128 else 32
    num_tiles = num_tokens if block_q == 1 else num_tokens // block_q + batch
    programs = max(1, num_tiles * num_kv_heads)
    # Enough programs to fill every SM a few times over, but no split shorter than ~256 keys.
    want = -(-4 * num_sms // programs)
    cap = max(1, (max_blocks * block_size) // 256)
    splits = 1
    while splits * 2 <= min(want, cap, 64):
        splits *= 2
    return dict(group_pad=group_pad, block_q=block_q, block_m=block_m, block_n=block_n, num_tiles=num_tiles,
                num_splits=splits, num_warps=4, num_stages=2)


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    fmt: CacheFormat,
    causal: bool,
    sliding_window: Optional[int],
    sinks: Optional[torch.Tensor],
    scale: float,
    k_scale: float,
    v_scale: float,
    *,
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    block_q: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> torch.Tensor:
    """Launch the split-KV kernel (plus the split combiner); same contract as ``paged_attention_naive``.

    Also runs on CPU tensors under ``TRITON_INTERPRET=1``. The keyword overrides are for tests and tuning.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    batch, max_blocks = block_table.shape
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0 or batch == 0:
        return out
    device = query.device
    interp = _interpreting(device)
    num_sms = 132 if interp else _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    cfg = launch_config(num_tokens, batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_sms)
    if block_q is not None:
        cfg["block_q"] = block_q
        cfg["block_m"] = max(16, block_q * cfg["group_pad"])
        cfg["num_tiles"] = num_tokens if block_q == 1 else num_tokens // block_q + batch
    for key, val in (("num_splits", num_splits), ("block_n", block_n), ("num_warps", num_warps),
                     ("num_stages", num_stages)):
        if val is not None:
            cfg[key] = val
    splits = cfg["num_splits"]

    key_mode, value_mode = _KEY_MODES[fmt.key_mode], _VALUE_MODES[fmt.value_mode]
    q = query
    if key_mode == 2:
        # Rotate the query once; scores then come straight from the packed codes.
        q = query.float() @ rotation_matrix(head_dim, device)
    if interp:
        # The interpreter's bf16 matmul is unreliable; fp32 keeps it exact enough to compare.
        qk_dtype = pv_dtype = tl.float32
    else:
        dense = tl.bfloat16 if fmt.dense_dtype == torch.bfloat16 else tl.float16
        qk_dtype = dense if key_mode == 0 else tl.float16  # fp8 and centroids are exact in fp16
        pv_dtype = dense if value_mode == 0 else tl.float16  # fp8 and small integer codes too
    fp8 = tl.float8e5 if fmt.fp8_dtype == torch.float8_e5m2 else tl.float8e4nv
    cache_16 = kv_cache.view(fmt.dense_dtype or torch.float16)
    cent = _centroids(fmt.key_bits if key_mode == 2 else 4, device)
    qk_scale = scale * _LOG2E * (k_scale if key_mode == 1 else 1.0)
    sinks_arg = sinks if sinks is not None else cent  # never read without HAS_SINKS

    if splits == 1:
        target, ml = out, cent
        stride_os = 0
    else:
        target = torch.empty((splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=device)
        ml = torch.empty((splits, num_tokens, num_q_heads, 2), dtype=torch.float32, device=device)
        stride_os = target.stride(0)
    grid = (cfg["num_tiles"], num_kv_heads, splits)
    _paged_attention_kernel[grid](
        q, q.stride(0), q.stride(1),
        kv_cache, cache_16, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_table, block_table.stride(0),
        seq_lens, query_start_loc, sinks_arg, cent,
        target, stride_os, num_q_heads * head_dim, head_dim,
        ml,
        qk_scale, v_scale, sliding_window or 0,
        batch, num_tokens, num_blocks, max_blocks,
        GROUP=num_q_heads // num_kv_heads, GROUP_PAD=cfg["group_pad"], HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_Q=cfg["block_q"], BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], NUM_SPLITS=splits,
        CAUSAL=causal, HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
        KEY_MODE=key_mode, KEY_BITS=fmt.key_bits, VALUE_MODE=value_mode, VALUE_BITS=fmt.value_bits,
        K_NORM_OFF=fmt.key_norm_offset(head_dim), V_OFF=fmt.value_offset(head_dim),
        V_SCALE_OFF=fmt.value_scale_offset(head_dim),
        FP8=fp8, QK_DTYPE=qk_dtype, PV_DTYPE=pv_dtype,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if splits > 1:
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            target, ml, sinks_arg, query_start_loc, out, out.stride(0), out.stride(1),
            num_tokens, batch,
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, NUM_SPLITS=splits, HAS_SINKS=sinks is not None,
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out
