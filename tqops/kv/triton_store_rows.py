"""Row-per-thread Triton kv_store for TurboQuant MSE keys: the Walsh-Hadamard butterfly never leaves registers.

The tile is ``[A, BLOCK_R, E]`` with channel = a * E + e and E channels = 16 bytes of input, so Triton's load
layout gives each thread E contiguous channels of one row and repeats the A dimension in that thread's registers:
a thread holds a whole row (or 1/2, 1/4 of it when BLOCK_R is below 32 rows per warp). Every butterfly stage, the
norms, the value range and the bit packing are then register operations; the general kernel in triton_store runs
the same math on a [rows, channels] tile whose upper butterfly stages cross threads through shared memory.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import pdl_launch_dependents, pdl_wait
from .codecs import (FP32_MAX, _bucketize_half, _half_sat, _store_pack3, _token_block, _uniform_codes,
                     _uniform_row_params, fwht_rows)


@triton.jit
def _const_signs(chan, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr, S4: tl.constexpr,
                 S5: tl.constexpr, S6: tl.constexpr, S7: tl.constexpr):
    """+-1.0 per channel [A, 1, E] from the rotation's sign bits, 32 channels per constexpr word (bit set: -1).
    Where a thread holds whole rows the channel of every register is a compile-time constant and this folds into
    the first butterfly stage; elsewhere it is a few integer ops, still cheaper than a table load per tile."""
    w = tl.where(chan < 32, S0, tl.where(chan < 64, S1, tl.where(chan < 96, S2, tl.where(chan < 128, S3,
        tl.where(chan < 160, S4, tl.where(chan < 192, S5, tl.where(chan < 224, S6, S7)))))))
    return 1.0 - 2.0 * ((w >> (chan & 31)) & 1).to(tl.float32)


@triton.jit
def _store_codes_rows(cache_u8, byte_off, codes, ok, A: tl.constexpr, R: tl.constexpr, E: tl.constexpr,
                      BITS: tl.constexpr):
    """Pack int32 codes [A, R, E] like naive.pack_codes into the rows starting at byte_off [R] (int64)."""
    m = ok[None, :, None]
    row = byte_off[None, :, None]
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(codes, (A, R, E // 2, 2)))
        cols = (tl.arange(0, A) * (E // 2))[:, None, None] + tl.arange(0, E // 2)[None, None, :]
        tl.store(cache_u8 + row + cols, (lo | (hi << 4)).to(tl.uint8), mask=m)
    else:
        tl.static_assert(BITS == 3)
        G: tl.constexpr = 8 // E  # input chunks per 8-channel group
        C: tl.constexpr = A * E // 16  # 16-code chunks: groups c and c + C
        groups = tl.reshape(tl.permute(tl.reshape(codes, (2, C, G, R, E)), (0, 1, 3, 2, 4)), (2, C, R, 8))
        lo, hi = tl.split(tl.permute(groups, (1, 2, 3, 0)))
        ptr = cache_u8 + byte_off[None, :] + (tl.arange(0, C) * 6)[:, None]
        _store_pack3(ptr, lo, hi, ok[None, :], C, R)


@triton.jit
def _sum_squared_centroids(step, q0, q1, q2, q3, q4, q5, q6, q7, A: tl.constexpr, E: tl.constexpr,
                           BITS: tl.constexpr):
    """||c||^2 per row from the bucket steps [A, R, E]: a 9-bit count per step in one int64 (the top step's
    count is what the others leave of A * E), so each element costs a shift and an add, not a select tree."""
    one = tl.full(step.shape, 1, tl.int64)
    packed = tl.sum(tl.sum(one << (step * 9).to(tl.int64), axis=2), axis=0)  # wraps past bit 63: harmless
    c0 = (packed & 511).to(tl.float32)
    c1 = ((packed >> 9) & 511).to(tl.float32)
    c2 = ((packed >> 18) & 511).to(tl.float32)
    if BITS == 3:
        return c0 * q0 + c1 * q1 + c2 * q2 + (A * E - c0 - c1 - c2) * q3
    c3 = ((packed >> 27) & 511).to(tl.float32)
    c4 = ((packed >> 36) & 511).to(tl.float32)
    c5 = ((packed >> 45) & 511).to(tl.float32)
    c6 = ((packed >> 54) & 511).to(tl.float32)
    c7 = A * E - c0 - c1 - c2 - c3 - c4 - c5 - c6
    return c0 * q0 + c1 * q1 + c2 * q2 + c3 * q3 + c4 * q4 + c5 * q5 + c6 * q6 + c7 * q7


@triton.jit(do_not_specialize=["num_tokens", "num_slots"])
def _kv_store_rows_kernel(
    key_ptr, value_ptr, slot_ptr, cache_u8, cache_f16,
    num_tokens, num_slots,
    k_st, k_sh, k_sd, v_st, v_sh, v_sd,
    sqrt_d,
    p0, p1, p2, p3, p4, p5, p6, q0, q1, q2, q3, q4, q5, q6, q7,
    NUM_HEADS: tl.constexpr, D: tl.constexpr, E: tl.constexpr, SLOT_BYTES: tl.constexpr,
    KEY_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr, VALUE_BITS: tl.constexpr,
    KEY_NORM_OFF: tl.constexpr, VALUE_OFF: tl.constexpr, VALUE_SCALE_OFF: tl.constexpr,
    LOG2_A: tl.constexpr, LOG2_E: tl.constexpr, BLOCK_R: tl.constexpr, C2_COUNTS: tl.constexpr, ASM: tl.constexpr,
    S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
    S4: tl.constexpr, S5: tl.constexpr, S6: tl.constexpr, S7: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    # Same contract and grid as triton_store._kv_store_kernel (MSE keys, uniform values only): a program stores
    # BLOCK_R tokens of one head and walks (token block, head) pairs with a grid stride.
    A: tl.constexpr = D // E
    HALF: tl.constexpr = 1 << (KEY_BITS - 1)
    LEVELS: tl.constexpr = (1 << VALUE_BITS) - 1
    pid = tl.program_id(0)
    chan = (tl.arange(0, A) * E)[:, None, None] + tl.arange(0, E)[None, None, :]  # [A, 1, E]
    chan_rows = (tl.arange(0, A) * E)[None, :, None] + tl.arange(0, E)[None, None, :]  # [1, A, E]
    # sqrt(d) * R^T = diag(signs) H. The signs are compile-time words: cheaper than a table load per tile
    # (docs/tuning.md), and free where a thread's channels are constants.
    signs = _const_signs(chan, S0, S1, S2, S3, S4, S5, S6, S7)
    num_pairs = tl.cdiv(num_tokens, BLOCK_R) * NUM_HEADS
    for pair in range(pid, num_pairs, tl.num_programs(0)):
        tok, head, dst_row, ok = _token_block(pair, slot_ptr, num_tokens, num_slots, NUM_HEADS, BLOCK_R)
        dst = dst_row * SLOT_BYTES  # byte offset of this (slot, head)
        m3 = ok[:, None, None]
        t3 = tok[:, None, None]
        k = tl.load(key_ptr + head * k_sh + t3 * k_st + chan_rows * k_sd, mask=m3, other=0.0)
        v_raw = tl.load(value_ptr + head * v_sh + t3 * v_st + chan_rows * v_sd, mask=m3, other=0.0)
        k = tl.permute(k, (1, 0, 2)).to(tl.float32)

        # ---- key: rotate, bucketize against the symmetric Lloyd-Max codebook, fold 1/||c|| into the norm ----
        # Approximate reciprocal square roots (a few fp32 ulps) where the general kernel rounds correctly: the
        # results land in fp16 or decide a bucket, inside the reference's tie tolerance, and each correctly rounded
        # one costs a check and a branch per row.
        # An overflowed (inf) sum of squares counts as fp32 max, as in the reference: z lands in the outer buckets.
        sumsq = tl.sum(tl.sum(k * k, axis=2), axis=0)
        rnorm = tl.math.rsqrt(tl.minimum(tl.maximum(sumsq, 1.1754943508222875e-38), FP32_MAX))
        norm = tl.sqrt(sumsq)  # not sumsq * rnorm, which is NaN where sumsq overflows
        z = fwht_rows(k * signs, A, BLOCK_R, E, LOG2_A, LOG2_E) * rnorm[None, :, None]
        above, c2 = _bucketize_half(tl.abs(z), p0, p1, p2, p3, p4, p5, p6, q0, q1, q2, q3, q4, q5, q6, q7, KEY_BITS,
                                    HALF)  # above = HALF + step
        # HALF + step above the middle boundary (0 by symmetry), HALF - 1 - step = (HALF + step) ^ (2 HALF - 1)
        # below, the sign read from z's bits: two integer ops instead of a compare, an add and a select. z = +-0
        # sits on the boundary and may take either side, as a tie may.
        below = (z.to(tl.int32, bitcast=True) >> 31) & (2 * HALF - 1)
        code = above ^ below
        _store_codes_rows(cache_u8, dst, code, ok, A, BLOCK_R, E, KEY_BITS)
        if NORM_CORRECTION:
            if C2_COUNTS:
                c2_sum = _sum_squared_centroids(above - HALF, q0, q1, q2, q3, q4, q5, q6, q7, A, E, KEY_BITS)
            else:
                c2_sum = tl.sum(tl.sum(c2, axis=2), axis=0)
            stored = norm * tl.math.rsqrt(c2_sum)
        else:
            stored = norm * (1.0 / sqrt_d)
        tl.store(cache_f16 + (dst + KEY_NORM_OFF) // 2, _half_sat(stored, ASM), mask=ok)

        # ---- value: per-token asymmetric uniform ----
        v = tl.permute(v_raw, (1, 0, 2)).to(tl.float32)
        zero, scale, gain = _uniform_row_params(tl.min(tl.min(v, axis=2), axis=0), tl.max(tl.max(v, axis=2), axis=0),
                                                LEVELS, ASM)
        vcode = _uniform_codes(v, zero[None, :, None], gain[None, :, None], LEVELS, ASM)
        _store_codes_rows(cache_u8, dst + VALUE_OFF, vcode, ok, A, BLOCK_R, E, VALUE_BITS)
        sz = cache_f16 + (dst + VALUE_SCALE_OFF) // 2
        tl.store(sz, scale.to(tl.float16), mask=ok)
        tl.store(sz + 1, zero.to(tl.float16), mask=ok)
