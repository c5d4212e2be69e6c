"""Experiment (not part of tqops): warp-specialized Gluon paged attention for the TurboQuant verify tile.

A producer partition (4 warps by default) loads the packed K and V codes of each 128-key tile, decodes them with the
byte-permute PTX of the Triton kernel (keys times their norm, values as code * scale + zero, both in fp16x2) and stores
the fp16 tiles to shared memory; the default partition (one warpgroup) runs both wgmmas with the keys as M (scores^T =
K q^T, out^T += V^T P^T) and the online softmax. mbarriers hand the stages over. Formats with MSE keys and uniform values
(turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc), head_dim 128, 32 query rows (q_len 16 x GQA 2), no
window or sinks; the query arrives rotated and scaled (host matmul, not timed). Correct on an H200 (max error 4.9e-4
against the Triton kernel), and at best as fast as the Triton kernel, see tqops/attention/NOTES.md, session 16.
Run on a CUDA machine with Triton 3.6: ``python experiments/gluon_ws_attention.py`` (JSON lines, $OUT/gluon_ws.json).
"""
import math
import os
import traceback

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait)

from tqops.attention import triton_paged as tp

# decode asm + scaling: keys x norm (mul.f16x2 with $5), values code * scale + zero (fma.f16x2 with $5, $6)
_K3 = gl.constexpr(tp._PAIR3_ASM.value[:-1] + "".join(f"mul.rn.f16x2 ${j}, ${j}, $5;\n" for j in range(4)) + "}")
_K4 = gl.constexpr(tp._PAIR4_ASM.value[:-1] + "".join(f"mul.rn.f16x2 ${j}, ${j}, $5;\n" for j in range(4)) + "}")
_FMA = "".join(f"fma.rn.f16x2 ${j}, ${j}, $5, $6;\n" for j in range(4)) + "}"
_V4 = gl.constexpr(tp._UNIFORM4_ASM.value[:-1] + _FMA)  # also 3-bit values: their nibble words decode alike


@gluon.jit
def _rows(bt_row, start, kvh_off, num_blocks, max_blocks, layout: gl.constexpr, STRIDE_CB: gl.constexpr,
          STRIDE_CS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Byte offsets [BLOCK_N] (int64) of the cache rows of keys start .. start + BLOCK_N (block ids clamped into the
    cache), and the key index in the tile."""
    j = gl.arange(0, BLOCK_N, layout=layout)
    blk = gl.load(bt_row + gl.minimum(start // BLOCK_SIZE + j // BLOCK_SIZE, max_blocks - 1))
    blk = gl.minimum(gl.maximum(blk, 0), num_blocks - 1)
    return blk.to(gl.int64) * STRIDE_CB + (kvh_off + (j % BLOCK_SIZE) * STRIDE_CS), j


@gluon.jit
def _pair16(x):
    """fp16 bits (int32 0..65535) duplicated into both halves."""
    return x | (x << 16)


@gluon.jit
def _join4(a, b, c, d):
    """4 tensors -> [..., 2, 2] that flattens (a reshape of the last two axes) to the order a, b, c, d."""
    return gl.join(gl.join(a, c), gl.join(b, d))


@gluon.jit
def _words_to_tile(words, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """int32 words [ROWS, HEAD_DIM // 2] of fp16 pairs -> fp16 [ROWS, HEAD_DIM]."""
    x = gl.reshape(gl.join(words, words >> 16), [ROWS, HEAD_DIM])
    return x.to(gl.int16).to(gl.float16, bitcast=True)


@gluon.jit
def _load_words4(cache_16, row, HW: gl.constexpr, BLOCK_N: gl.constexpr, L3: gl.constexpr):
    """4-bit codes of rows at byte offsets ``row`` -> int32 words [BLOCK_N, HW // 2] (two halfwords each)."""
    r = gl.convert_layout(row, gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    w = gl.arange(0, HW // 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    e = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    off = (r // 2)[:, None, None] + (2 * w)[None, :, None] + e[None, None, :]
    h = gl.load(cache_16 + off).to(gl.uint16, bitcast=True).to(gl.int32)
    lo, hi = gl.split(h)
    return lo | (hi << 16)


@gluon.jit
def _decode_tile(cache_16, row, ok, CODE_OFF: gl.constexpr, AUX_OFF: gl.constexpr, BITS: gl.constexpr,
                 KEYS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, L3: gl.constexpr, PW: gl.constexpr):
    """Loads and decodes one side (K x norm, or V = code * scale + zero) of a key tile -> fp16 [BLOCK_N, HEAD_DIM]."""
    LP: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, PW], [0, 1])  # [pairs, rows], pairs fastest
    if KEYS:
        a = gl.load(cache_16 + (row + AUX_OFF) // 2, mask=ok, other=0.0)
        a2 = _pair16(a.to(gl.uint16, bitcast=True).to(gl.int32))
        z2 = a2
    else:
        sc = gl.load(cache_16 + (row + AUX_OFF) // 2, mask=ok, other=0.0)
        zp = gl.load(cache_16 + (row + AUX_OFF + 2) // 2, mask=ok, other=0.0)
        a2 = _pair16(sc.to(gl.uint16, bitcast=True).to(gl.int32))
        z2 = _pair16(zp.to(gl.uint16, bitcast=True).to(gl.int32))
    if BITS == 4:
        w = _load_words4(cache_16, row + CODE_OFF, HEAD_DIM // 4, BLOCK_N, L3)
        a2w = gl.broadcast(gl.convert_layout(a2, gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None], w)[0]
        if KEYS:
            p0, p1, p2, p3 = gl.inline_asm_elementwise(_K4, "=r,=r,=r,=r,r,r", [w, a2w], dtype=(gl.int32,) * 4,
                                                       is_pure=True, pack=1)
        else:
            z2w = gl.broadcast(gl.convert_layout(z2, gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None], w)[0]
            p0, p1, p2, p3 = gl.inline_asm_elementwise(_V4, "=r,=r,=r,=r,r,r,r", [w, a2w, z2w],
                                                       dtype=(gl.int32,) * 4, is_pure=True, pack=1)
        words = gl.reshape(_join4(p0, p1, p2, p3), [BLOCK_N, HEAD_DIM // 2])
    else:
        rp = gl.convert_layout(row + CODE_OFF, gl.SliceLayout(0, LP))
        ptr = cache_16 + (rp // 2)[None, :] + 3 * gl.arange(0, HEAD_DIM // 16, layout=gl.SliceLayout(1, LP))[:, None]
        h0 = gl.load(ptr).to(gl.uint16, bitcast=True).to(gl.int32)
        h1 = gl.load(ptr + 1).to(gl.uint16, bitcast=True).to(gl.int32)
        h2 = gl.load(ptr + 2).to(gl.uint16, bitcast=True).to(gl.int32)
        # nibble words of groups c and c + HEAD_DIM / 16 (naive.pack_codes, triton_paged._load_side)
        top = ((h0 >> 3) & 0x1111) | ((h1 >> 2) & 0x2222) | ((h2 >> 1) & 0x4444)
        g0 = ((h1 << 16) | h0) & 0x77777777
        g1 = ((top << 16) | h2) & 0x77777777
        a2p = gl.broadcast(gl.convert_layout(a2, gl.SliceLayout(0, LP))[None, :], g0)[0]
        if KEYS:
            x0, x1, x2, x3 = gl.inline_asm_elementwise(_K3, "=r,=r,=r,=r,r,r", [g0, a2p], dtype=(gl.int32,) * 4,
                                                       is_pure=True, pack=1)
            y0, y1, y2, y3 = gl.inline_asm_elementwise(_K3, "=r,=r,=r,=r,r,r", [g1, a2p], dtype=(gl.int32,) * 4,
                                                       is_pure=True, pack=1)
        else:
            z2p = gl.broadcast(gl.convert_layout(z2, gl.SliceLayout(0, LP))[None, :], g0)[0]
            x0, x1, x2, x3 = gl.inline_asm_elementwise(_V4, "=r,=r,=r,=r,r,r,r", [g0, a2p, z2p],
                                                       dtype=(gl.int32,) * 4, is_pure=True, pack=1)
            y0, y1, y2, y3 = gl.inline_asm_elementwise(_V4, "=r,=r,=r,=r,r,r,r", [g1, a2p, z2p],
                                                       dtype=(gl.int32,) * 4, is_pure=True, pack=1)
        # word 2 * e1 + e2 of chunk c's group h (group c + h * HEAD_DIM / 16) at [c, .., e1, e2, h]
        w8 = gl.join(_join4(x0, x1, x2, x3), _join4(y0, y1, y2, y3))
        words = gl.reshape(gl.permute(w8, [1, 4, 0, 2, 3]), [BLOCK_N, HEAD_DIM // 2])
    return _words_to_tile(words, BLOCK_N, HEAD_DIM)


@gluon.jit
def _producer(cache_16, bt_row, kvh_off, num_blocks, max_blocks, s_begin, s_end, n_tiles,
              k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
              K_NORM_OFF: gl.constexpr, V_OFF: gl.constexpr, V_SCALE_OFF: gl.constexpr,
              KEY_BITS: gl.constexpr, VALUE_BITS: gl.constexpr, STRIDE_CB: gl.constexpr, STRIDE_CS: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              PW: gl.constexpr, IDS_AHEAD: gl.constexpr):
    """Fills the K and V stages of every key tile of this split.

    IDS_AHEAD: the next tile's block ids load before this tile decodes (the block id -> codes chain was exposed:
    one producer warpgroup per program has nothing else to hide it with)."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 2], [4, 8, 1], [PW, 1, 1], [2, 1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
    row, j = _rows(bt_row, s_begin, kvh_off, num_blocks, max_blocks, row_l, STRIDE_CB, STRIDE_CS, BLOCK_N,
                   BLOCK_SIZE)
    for i in range(n_tiles):
        stage = i % STAGES
        phase = ((i // STAGES) & 1) ^ 1
        start = s_begin + i * BLOCK_N
        ok = j < s_end - start
        if IDS_AHEAD:
            row_next, j = _rows(bt_row, start + BLOCK_N, kvh_off, num_blocks, max_blocks, row_l, STRIDE_CB,
                                STRIDE_CS, BLOCK_N, BLOCK_SIZE)
        kt = _decode_tile(cache_16, row, ok, 0, K_NORM_OFF, KEY_BITS, True, BLOCK_N, HEAD_DIM, L3, PW)
        mbarrier.wait(k_empty.index(stage), phase)
        k_smem.index(stage).store(kt)
        fence_async_shared()
        mbarrier.arrive(k_ready.index(stage), count=1)
        vt = _decode_tile(cache_16, row, ok, V_OFF, V_SCALE_OFF, VALUE_BITS, False, BLOCK_N, HEAD_DIM, L3, PW)
        mbarrier.wait(v_empty.index(stage), phase)
        v_smem.index(stage).store(vt)
        fence_async_shared()
        mbarrier.arrive(v_ready.index(stage), count=1)
        if IDS_AHEAD:
            row = row_next
        else:
            row, j = _rows(bt_row, start + BLOCK_N, kvh_off, num_blocks, max_blocks, row_l, STRIDE_CB, STRIDE_CS,
                           BLOCK_N, BLOCK_SIZE)


@gluon.jit
def _consumer(q_ptr, stride_qt, stride_qh, out_ptr, stride_os, stride_ot, stride_oh, ml_ptr,
              q_start, q_len, q_tile, ctx, kvh, split, s_begin, s_end, full_hi, n_tiles, num_tokens,
              q_smem, k_smem, v_smem, p_smem, k_ready, k_empty, v_ready, v_empty,
              GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr, L_SUM: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    col_l: gl.constexpr = gl.SliceLayout(0, mma)  # query rows (N)
    key_l: gl.constexpr = gl.SliceLayout(1, mma)  # keys / channels (M)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    # query tile -> shared memory (the wgmma B operand, transposed view)
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, QL))
    qi = r // GROUP
    token = q_start + q_tile + qi
    ok_r = (q_tile + qi) < q_len
    head = kvh * GROUP + r % GROUP
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, QL))
    qv = gl.load(q_ptr + (token.to(gl.int64) * stride_qt + head * stride_qh)[:, None] + d[None, :],
                 mask=ok_r[:, None], other=0.0)
    q_smem.store(qv)
    fence_async_shared()

    rc = gl.arange(0, BLOCK_M, layout=col_l)
    pos = ctx + q_tile + rc // GROUP
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, col_l)
    l_acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    l_i = gl.zeros([BLOCK_M], gl.float32, col_l)
    acc = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, mma)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    for i in range(n_tiles):
        stage = i % STAGES
        phase = (i // STAGES) & 1
        start = s_begin + i * BLOCK_N
        mbarrier.wait(k_ready.index(stage), phase)
        s = warpgroup_mma(k_smem.index(stage), q_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(stage), count=1)
        if start + BLOCK_N > full_hi:
            kp = start + gl.arange(0, BLOCK_N, layout=key_l)
            vis = kp[:, None] < s_end
            if CAUSAL:
                vis = vis & (kp[:, None] <= pos[None, :])
            s = gl.where(vis, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        if L_SUM:
            # A per-tile row sum (a second cross-warp reduction) instead of a [BLOCK_N, BLOCK_M] running sum: the
            # 32 registers it frees stopped the consumer's spills (3bit_nc 97.4 -> 92.6 us with IDS_AHEAD).
            l_i = l_i * alpha + gl.sum(p, 0)
        else:
            l_acc = l_acc * alpha[None, :] + p
        acc = acc * alpha[None, :]
        m_i = m_new
        p_smem.store(gl.permute(p.to(gl.float16), (1, 0)))
        fence_async_shared()
        mbarrier.wait(v_ready.index(stage), phase)
        acc = warpgroup_mma(v_smem.index(stage).permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(stage), count=1)

    if not L_SUM:
        l_i = gl.sum(l_acc, 0)
    dd = gl.arange(0, HEAD_DIM, layout=key_l)
    tok_c = q_start + q_tile + rc // GROUP
    head_c = kvh * GROUP + rc % GROUP
    ok_c = (q_tile + rc // GROUP) < q_len
    out_off = split * stride_os + tok_c.to(gl.int64) * stride_ot + head_c * stride_oh
    gl.store(out_ptr + out_off[None, :] + dd[:, None], acc, mask=ok_c[None, :])
    ml_off = ((split * num_tokens + tok_c.to(gl.int64)) * (stride_ot // HEAD_DIM) + head_c) * 2
    gl.store(ml_ptr + ml_off, m_i, mask=ok_c)
    gl.store(ml_ptr + ml_off + 1, l_i, mask=ok_c)


@gluon.jit
def ws_kernel(q_ptr, stride_qt, stride_qh, cache_16, bt_ptr, stride_bt, seq_lens_ptr, qsl_ptr,
              out_ptr, stride_os, stride_ot, stride_oh, ml_ptr, num_seqs, num_tokens, num_blocks, max_blocks,
              STRIDE_CB: gl.constexpr, STRIDE_CS: gl.constexpr, STRIDE_CH: gl.constexpr,
              GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_Q: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr, CAUSAL: gl.constexpr,
              KEY_BITS: gl.constexpr, VALUE_BITS: gl.constexpr, K_NORM_OFF: gl.constexpr, V_OFF: gl.constexpr,
              V_SCALE_OFF: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
              PW: gl.constexpr,
              IDS_AHEAD: gl.constexpr, L_SUM: gl.constexpr):
    pid = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    lo = pid * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mid_start = gl.load(qsl_ptr + mid) // BLOCK_Q + mid
        ok = mid_start <= pid
        lo = gl.where(ok, mid, lo)
        hi = gl.where(ok, hi, mid - 1)
    b = lo
    q_start = gl.load(qsl_ptr + b)
    q_len = gl.load(qsl_ptr + b + 1) - q_start
    q_tile = (pid - (q_start // BLOCK_Q + b)) * BLOCK_Q
    if q_tile < q_len:
        seq_len = gl.load(seq_lens_ptr + b)
        ctx = seq_len - q_len
        tile_last = gl.minimum(q_tile + BLOCK_Q, q_len) - 1
        kv_end = gl.minimum(seq_len, max_blocks * BLOCK_SIZE)
        if CAUSAL:
            kv_end = gl.minimum(kv_end, ctx + tile_last + 1)
        n_keys = gl.maximum(kv_end, 0)
        per_split = gl.cdiv(gl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
        s_begin = split * per_split
        s_end = gl.minimum(kv_end, s_begin + per_split)
        n_tiles = gl.cdiv(gl.maximum(s_end - s_begin, 0), BLOCK_N)
        full_hi = s_end
        if CAUSAL:
            full_hi = gl.minimum(full_hi, ctx + q_tile + 1)
        bt_row = bt_ptr + b.to(gl.int64) * stride_bt
        kvh_off = kvh.to(gl.int64) * STRIDE_CH

        qL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float16)
        kL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float16)
        pL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float16)
        q_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_M, HEAD_DIM], qL)
        k_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, HEAD_DIM], kL)
        v_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, HEAD_DIM], kL)
        p_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_M, BLOCK_N], pL)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(st), count=1)
            mbarrier.init(k_empty.index(st), count=1)
            mbarrier.init(v_ready.index(st), count=1)
            mbarrier.init(v_empty.index(st), count=1)

        gl.warp_specialize([
            (_consumer, (q_ptr, stride_qt, stride_qh, out_ptr, stride_os, stride_ot, stride_oh, ml_ptr, q_start,
                         q_len, q_tile, ctx, kvh, split, s_begin, s_end, full_hi, n_tiles, num_tokens, q_smem,
                         k_smem, v_smem, p_smem, k_ready, k_empty, v_ready, v_empty, GROUP, BLOCK_Q, BLOCK_M,
                         BLOCK_N, HEAD_DIM, CAUSAL, STAGES, L_SUM)),
            (_producer, (cache_16, bt_row, kvh_off, num_blocks, max_blocks, s_begin, s_end, n_tiles,
                         k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                         K_NORM_OFF, V_OFF, V_SCALE_OFF, KEY_BITS, VALUE_BITS, STRIDE_CB, STRIDE_CS,
                         BLOCK_N, BLOCK_SIZE, HEAD_DIM, STAGES, PW, IDS_AHEAD)),
        ], [PW], [PRODUCER_REGS])


def ws_attention(query, kv_cache, block_table, seq_lens, qsl, fmt, causal, scale, *, splits=4, stages=1, regs=120,
                 maxnreg=128, q_rot=None, pw=4, ids_ahead=True, l_sum=True):
    """Same contract as ``paged_attention_triton`` for the supported case (see the module docstring); the keyword
    arguments pick the partitioning and register split. Splits merge in the Triton combiner."""
    from tqops.quant.rotation import rotation_matrix
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    batch, max_blocks = block_table.shape
    group = num_q_heads // num_kv_heads
    if q_rot is None:
        q_rot = ((query.float() @ rotation_matrix(head_dim, query.device)) * (scale * tp._LOG2E)).to(torch.float16)
    cache_16 = kv_cache.view(torch.float16)
    part = torch.empty((splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=query.device)
    ml = torch.empty((splits, num_tokens, num_q_heads, 2), dtype=torch.float32, device=query.device)
    block_q = 16
    grid = (num_tokens // block_q + batch, num_kv_heads, splits)
    ws_kernel[grid](q_rot, q_rot.stride(0), q_rot.stride(1), cache_16, block_table, block_table.stride(0), seq_lens,
                    qsl, part, part.stride(0), num_q_heads * head_dim, head_dim, ml, batch, num_tokens, num_blocks,
                    max_blocks, STRIDE_CB=kv_cache.stride(0), STRIDE_CS=kv_cache.stride(1),
                    STRIDE_CH=kv_cache.stride(2), GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                    BLOCK_Q=block_q, BLOCK_M=block_q * group, BLOCK_N=128, NUM_SPLITS=splits, CAUSAL=causal,
                    KEY_BITS=fmt.key_bits, VALUE_BITS=fmt.value_bits, K_NORM_OFF=fmt.key_norm_offset(head_dim),
                    V_OFF=fmt.value_offset(head_dim), V_SCALE_OFF=fmt.value_scale_offset(head_dim), STAGES=stages,
                    PRODUCER_REGS=regs, PW=pw, IDS_AHEAD=ids_ahead, L_SUM=l_sum,
                    num_warps=4, maxnreg=maxnreg)
    out = torch.empty_like(query)
    tp.combine_splits(part, ml, None, qsl, out, batch)
    return out


def main() -> None:
    """The e2e verify shape (16 q / 8 kv heads, d 128, 8 x 8K keys, q_len 16): Triton vs warp-specialized Gluon."""
    from tqops.attention.bench_attention import time_graph
    from tqops.formats import get_format
    from tqops.quant.rotation import rotation_matrix
    from verify_case import ResultLog, verify_case

    log = ResultLog("gluon_ws.json")

    configs = (
        dict(stages=1, regs=120, maxnreg=128),  # 2 programs per SM, 8 warps each
        dict(stages=1, regs=128, maxnreg=128),
        dict(stages=1, regs=112, maxnreg=128, ids_ahead=False, l_sum=False),
        dict(stages=2, pw=8, regs=96, maxnreg=128),  # 8 producer warps, 1 program per SM
    )
    B, D = 8, 128
    for name in os.environ.get("FMTS", "turboquant_3bit_nc,turboquant_k3v4_nc,turboquant_4bit_nc").split(","):
        fmt = get_format(name)
        cache, bt, q, qsl, seq = verify_case(name, B, head_dim=D)
        scale = 1 / math.sqrt(D)
        q_rot = ((q.float() @ rotation_matrix(D, q.device)) * (scale * tp._LOG2E)).to(torch.float16)
        for causal in (True, False):
            def triton_attn():
                return tp.paged_attention_triton(q, cache, bt, seq, qsl, fmt, causal, None, None, scale, 1.0, 1.0)

            ref = triton_attn()
            log(fmt=name, causal=causal, kernel="triton", us=round(time_graph(triton_attn), 1))
            for cfg in configs:
                try:
                    def ws():
                        return ws_attention(q, cache, bt, seq, qsl, fmt, causal, scale, q_rot=q_rot, **cfg)

                    err = (ws().float() - ref.float()).abs().max().item()  # NaN if either kernel read the poison
                    log(fmt=name, causal=causal, kernel="gluon ws", **cfg, us=round(time_graph(ws), 1), err=err)
                except Exception:  # a compile or launch failure is a result of the experiment too
                    log(fmt=name, causal=causal, kernel="gluon ws", **cfg, error=traceback.format_exc()[-1500:])
    log.save()


if __name__ == "__main__":
    main()
