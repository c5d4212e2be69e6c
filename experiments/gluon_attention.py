"""Experiment (not part of tqops): Gluon paged attention for turboquant_4bit_nc with per-warp split-K.

Each of the W warps of a program owns its own keys and online softmax over all 32 query rows (16 tokens x GQA 2),
so no warp decodes another's keys and P never leaves its warp; the W partial softmaxes merge once at the end.
Decoded keys and values go through shared memory (ldmatrix), the query is read from shared memory per channel
chunk, and the query arrives rotated (host matmul). Correct on an H200 (max error 5e-4 against the Triton kernel,
bf16 output), but slower: see tqops/attention/NOTES.md, session 11. Run on a CUDA machine with Triton 3.6:
``python experiments/gluon_attention.py`` (prints JSON lines, writes $OUT/gluon.json).
"""
import math
import os
import traceback

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from tqops.attention.bench_attention import time_graph
from tqops.attention.triton_paged import (_PAIR4_ASM, _UNIFORM4_ASM, combine_splits, launch_config,
                                          paged_attention_triton)
from tqops.formats import get_format
from tqops.quant import rotation_matrix
from verify_case import ResultLog, verify_case


@gluon.jit
def _fp16_pairs(words, W: gl.constexpr, N: gl.constexpr, D: gl.constexpr):
    """int32 words [W, N, D/2] of fp16 channel pairs -> fp16 [W, N, D] in channel order."""
    x = gl.reshape(gl.join(words, words >> 16), [W, N, D])
    return x.to(gl.int16).to(gl.float16, bitcast=True)


@gluon.jit
def _gluon_attention_kernel(
    q_ptr, stride_qt, stride_qh,
    cache_u8, cache_16,
    bt_ptr, stride_bt,
    seq_lens_ptr, qsl_ptr,
    out_ptr, stride_os, stride_ot, stride_oh,
    ml_ptr,
    qk_scale,
    num_seqs, num_tokens, num_blocks, max_blocks,
    STRIDE_CB: gl.constexpr, STRIDE_CS: gl.constexpr, STRIDE_CH: gl.constexpr,
    GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    BLOCK_Q: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr,
    CAUSAL: gl.constexpr,
    K_NORM_OFF: gl.constexpr, V_OFF: gl.constexpr, V_SCALE_OFF: gl.constexpr,
    W: gl.constexpr, KC: gl.constexpr = 32,
):
    M: gl.constexpr = BLOCK_M
    N: gl.constexpr = BLOCK_N
    D: gl.constexpr = HEAD_DIM
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    ROWS: gl.constexpr = gl.SliceLayout(2, MMA)        # [W, M]
    KEYS: gl.constexpr = gl.SliceLayout(1, MMA)        # [W, N]
    OUT2: gl.constexpr = gl.SliceLayout(0, MMA)        # [M, D]
    # raw code tiles [W, N, D/2]: 16 bytes per thread, warps along W
    CODES: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [W, 1, 1], [2, 1, 0])
    CROWS: gl.constexpr = gl.SliceLayout(2, CODES)     # [W, N]
    QL: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [W, 1, 1], [2, 1, 0])  # [W, M, D]
    SMEM: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0])

    pid = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)

    # The sequence owning query tile `pid`: the binary search of tqops' Triton kernel, copied because it is inline
    # there (sharing it would mean a helper in the library kernel, for an experiment).
    lo = gl.to_tensor(0)
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

        # ---- query [W, M, D] (pre-rotated fp16), replicated per warp, into shared memory ----
        qm = gl.arange(0, M, layout=gl.SliceLayout(0, gl.SliceLayout(2, QL)))
        qd = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, QL)))
        qw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, QL)))
        q_tok = q_start + q_tile + qm // GROUP_PAD
        q_ok = ((qm // GROUP_PAD) < BLOCK_Q) & (q_tile + qm // GROUP_PAD < q_len) & (qm % GROUP_PAD < GROUP)
        q_head = kvh * GROUP + qm % GROUP_PAD
        q_off = q_tok.to(gl.int64) * stride_qt + q_head * stride_qh
        q_ptrs = q_ptr + (qw[:, None, None] * 0 + q_off[None, :, None]) + qd[None, None, :]
        q_mask = (qw[:, None, None] >= 0) & q_ok[None, :, None] & (qd[None, None, :] >= 0)
        q3 = gl.load(q_ptrs, mask=q_mask, other=0.0)
        q_s = gl.allocate_shared_memory(gl.float16, [W, M, D], SMEM, q3)
        k_s = gl.allocate_shared_memory(gl.float16, [W, N, D], SMEM)
        v_s = gl.allocate_shared_memory(gl.float16, [W, N, D], SMEM)

        # ---- this split's keys, whole W * N tiles ----
        tile_last = gl.minimum(q_tile + BLOCK_Q, q_len) - 1
        kv_end = gl.minimum(seq_len, max_blocks * BLOCK_SIZE)
        if CAUSAL:
            kv_end = gl.minimum(kv_end, ctx + tile_last + 1)
        STEP: gl.constexpr = W * N
        per_split = gl.cdiv(gl.cdiv(kv_end, NUM_SPLITS), STEP) * STEP
        s_begin = split * per_split
        s_end = gl.minimum(kv_end, s_begin + per_split)
        full_hi = s_end
        if CAUSAL:
            full_hi = gl.minimum(full_hi, ctx + q_tile + 1)

        rm = gl.arange(0, M, layout=gl.SliceLayout(0, ROWS))
        pos = ctx + q_tile + rm // GROUP_PAD  # [M]
        kw = gl.arange(0, W, layout=gl.SliceLayout(1, KEYS))
        kj = gl.arange(0, N, layout=gl.SliceLayout(0, KEYS))
        cw = gl.arange(0, W, layout=gl.SliceLayout(1, CROWS))
        cj = gl.arange(0, N, layout=gl.SliceLayout(0, CROWS))
        cc = gl.arange(0, D // 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, CODES)))
        bt_row = bt_ptr + b.to(gl.int64) * stride_bt
        kvh_off = kvh.to(gl.int64) * STRIDE_CH

        m_i = gl.full([W, M], -1.0e30, gl.float32, ROWS)
        l_i = gl.full([W, M], 0.0, gl.float32, ROWS)
        z_i = gl.full([W, M], 0.0, gl.float32, ROWS)
        acc = gl.full([W, M, D], 0.0, gl.float32, MMA)
        for start in range(s_begin, s_end, STEP):
            # The same cache rows in the code layout and in the score layout: computing them twice is cheaper than
            # converting one layout to the other.
            ckey = start + cw[:, None] * N + cj[None, :]
            cblk = gl.load(bt_row + gl.minimum(ckey // BLOCK_SIZE, max_blocks - 1))
            cblk = gl.minimum(gl.maximum(cblk, 0), num_blocks - 1)
            crow = cblk.to(gl.int64) * STRIDE_CB + kvh_off + (ckey % BLOCK_SIZE) * STRIDE_CS
            key = start + kw[:, None] * N + kj[None, :]
            blk = gl.load(bt_row + gl.minimum(key // BLOCK_SIZE, max_blocks - 1))
            blk = gl.minimum(gl.maximum(blk, 0), num_blocks - 1)
            row = blk.to(gl.int64) * STRIDE_CB + kvh_off + (key % BLOCK_SIZE) * STRIDE_CS

            kc = gl.load(cache_u8 + crow[:, :, None] + cc[None, None, :])
            vc = gl.load(cache_u8 + crow[:, :, None] + V_OFF + cc[None, None, :])
            kn = gl.load(cache_16 + (row + K_NORM_OFF) // 2).to(gl.float32)
            # Scales of keys past the split end get 0: their p is 0, but a NaN scale would still poison P @ V.
            vs = gl.load(cache_16 + (row + V_SCALE_OFF) // 2, mask=key < s_end, other=0.0).to(gl.float32)
            vz = gl.load(cache_16 + (row + V_SCALE_OFF + 2) // 2, mask=key < s_end, other=0.0).to(gl.float32)

            kp = gl.inline_asm_elementwise(_PAIR4_ASM, "=r,=r,=r,=r,r", [kc], dtype=gl.int32, is_pure=True, pack=4)
            k_s.store(_fp16_pairs(kp, W, N, D))
            # Scores in KC-channel chunks, each chunk's operands read from shared memory right before its mma. Meant
            # to keep the whole query operand (64 registers) from being live at once; on sm_90 it did not change the
            # register count (243 with and without), so KC = D would do as well.
            s = gl.full([W, M, N], 0.0, gl.float32, MMA)
            for c in gl.static_range(D // KC):
                s = mma_v2(q_s.slice(c * KC, KC, dim=2).load(A_OP),
                           k_s.slice(c * KC, KC, dim=2).permute([0, 2, 1]).load(B_OP), s)
            s = s * (kn * qk_scale)[:, None, :]
            if start + STEP > full_hi:
                vis = (key < s_end)[:, None, :]
                if CAUSAL:
                    vis = vis & (key[:, None, :] <= pos[None, :, None])
                s = gl.where(vis, s, -float("inf"))

            m_new = gl.maximum(m_i, gl.max(s, 2))
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha
            z_i = z_i * alpha
            acc = acc * alpha[:, :, None]
            m_i = m_new
            p = gl.exp2(s - m_i[:, :, None])
            l_i = l_i + gl.sum(p, 2)
            z_i = z_i + gl.sum(p * vz[:, None, :], 2)

            vp = gl.inline_asm_elementwise(_UNIFORM4_ASM, "=r,=r,=r,=r,r", [vc], dtype=gl.int32, is_pure=True,
                                           pack=4)
            v_s.store(_fp16_pairs(vp, W, N, D))
            pv = gl.convert_layout((p * vs[:, None, :]).to(gl.float16), A_OP)
            acc = mma_v2(pv, v_s.load(B_OP), acc)

        acc = acc + z_i[:, :, None]
        m = gl.max(m_i, 0)
        corr = gl.exp2(m_i - m[None, :])
        l = gl.sum(l_i * corr, 0)
        o = gl.sum(acc * corr[:, :, None], 0)  # [M, D] in OUT2

        om = gl.arange(0, M, layout=gl.SliceLayout(1, OUT2))
        od = gl.arange(0, D, layout=gl.SliceLayout(0, OUT2))
        o_tok = q_start + q_tile + om // GROUP_PAD
        o_ok = ((om // GROUP_PAD) < BLOCK_Q) & (q_tile + om // GROUP_PAD < q_len) & (om % GROUP_PAD < GROUP)
        o_head = kvh * GROUP + om % GROUP_PAD
        out_row = o_tok.to(gl.int64)[:, None] * stride_ot + o_head[:, None] * stride_oh + od[None, :]
        o_mask = o_ok[:, None] & (od[None, :] >= 0)
        if NUM_SPLITS == 1:
            inv = gl.where(l > 0, 1.0 / gl.maximum(l, 1e-30), 0.0)
            inv = gl.convert_layout(inv, gl.SliceLayout(1, OUT2))
            gl.store(out_ptr + out_row, (o * inv[:, None]).to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            gl.store(out_ptr + split * stride_os + out_row, o, mask=o_mask)
            mo = gl.convert_layout(m, gl.SliceLayout(1, OUT2))
            lo_ = gl.convert_layout(l, gl.SliceLayout(1, OUT2))
            ml_off = ((split * num_tokens + o_tok.to(gl.int64)) * (stride_ot // HEAD_DIM) + o_head) * 2
            gl.store(ml_ptr + ml_off, mo, mask=o_ok)
            gl.store(ml_ptr + ml_off + 1, lo_, mask=o_ok)


def gluon_attn(q_rot, cache, bt, seq, qsl, fmt, splits, W, N=16, causal=True):
    """q_rot [num_tokens, num_q_heads, head_dim] fp16, rotated; every sequence has q_len 16 -> bf16 output."""
    T, Hq, D = q_rot.shape
    nb, bs, Hkv, _ = cache.shape
    B, maxb = bt.shape
    group = Hq // Hkv
    gp = triton.next_power_of_2(group)
    block_q = 16
    M = block_q * gp
    tiles = T // block_q + B
    out = torch.zeros(T, Hq, D, device="cuda", dtype=torch.bfloat16)
    part = torch.empty(splits, T, Hq, D, device="cuda", dtype=torch.float32)
    ml = torch.empty(splits, T, Hq, 2, device="cuda", dtype=torch.float32)
    c16 = cache.view(torch.float16)
    target = out if splits == 1 else part
    _gluon_attention_kernel[(tiles, Hkv, splits)](
        q_rot, q_rot.stride(0), q_rot.stride(1), cache, c16, bt, bt.stride(0), seq, qsl,
        target, part.stride(0), Hq * D, D, ml, 1.0 / math.sqrt(D) * 1.4426950408889634,
        B, T, nb, maxb,
        STRIDE_CB=cache.stride(0), STRIDE_CS=cache.stride(1), STRIDE_CH=cache.stride(2), GROUP=group, GROUP_PAD=gp,
        HEAD_DIM=D, BLOCK_SIZE=bs, BLOCK_Q=block_q, BLOCK_M=M, BLOCK_N=N, NUM_SPLITS=splits, CAUSAL=causal,
        K_NORM_OFF=fmt.key_norm_offset(D), V_OFF=fmt.value_offset(D), V_SCALE_OFF=fmt.value_scale_offset(D), W=W,
        num_warps=W)
    if splits > 1:
        combine_splits(part, ml, None, qsl, out, B)
    return out


def main() -> None:
    """The e2e verify shape (16 q / 8 kv heads, d 128, 8K keys, q_len 16, causal) at batch 8 and 1: Triton vs Gluon."""
    log = ResultLog("gluon.json")

    fmts = os.environ.get("FMTS", "bf16,turboquant_4bit_nc").split(",")
    for name in fmts:
        fmt = get_format(name)
        for B in (8, 1):
            Hq, Hkv, D = 16, 8, 128
            cache, bt, q, qsl, seq = verify_case(name, B, q_heads=Hq, kv_heads=Hkv, head_dim=D)
            T = q.shape[0]
            scale = 1 / math.sqrt(D)

            def triton_attn():
                return paged_attention_triton(q, cache, bt, seq, qsl, fmt, True, None, None, scale, 1.0, 1.0)

            ref = triton_attn()
            cfg = launch_config(T, B, Hq, Hkv, D, 16, bt.shape[1], 132, fmt)
            log(fmt=name, B=B, kernel="triton", splits=cfg["num_splits"], us=round(time_graph(triton_attn), 1))
            if name == "bf16":
                continue
            q_rot = (q.float() @ rotation_matrix(D, torch.device("cuda"))).half()
            for W, mult in ((4, 1), (8, 1), (4, 2), (2, 2)):
                sp = max(1, int(cfg["num_splits"] * mult))
                try:
                    o = gluon_attn(q_rot, cache, bt, seq, qsl, fmt, sp, W)
                    err = (o.float() - ref.float()).abs().max().item()  # NaN if either kernel read the poison
                    t = time_graph(lambda: gluon_attn(q_rot, cache, bt, seq, qsl, fmt, sp, W))
                    log(fmt=name, B=B, kernel=f"gluon W{W}", splits=sp, us=round(t, 1), err=err)
                except Exception:  # a compile or launch failure is a result of the experiment too
                    log(fmt=name, B=B, kernel=f"gluon W{W}", splits=sp, error=traceback.format_exc()[-1500:])
    log.save()


if __name__ == "__main__":
    main()
