"""Triton codecs shared by the store kernels and paged attention: saturation, bucketing, bit packing, Hadamard
butterflies, fp8/bf16 rounding, uniform value parameters, and the format-mode ids the kernels specialize on."""
from __future__ import annotations

import triton
import triton.language as tl

# The kernels' KEY_MODE / VALUE_MODE constants for each CacheFormat key_mode / value_mode, and their names inside
# the kernels (a side is dense, fp8, or packed: MSE codes for keys, uniform codes for values).
MODE_DENSE: tl.constexpr = tl.constexpr(0)
MODE_FP8: tl.constexpr = tl.constexpr(1)
MODE_MSE: tl.constexpr = tl.constexpr(2)
MODE_UNIFORM: tl.constexpr = tl.constexpr(2)
KEY_MODES = {"dense": MODE_DENSE.value, "fp8": MODE_FP8.value, "mse": MODE_MSE.value}
VALUE_MODES = {"dense": MODE_DENSE.value, "fp8": MODE_FP8.value, "uniform": MODE_UNIFORM.value}

# Saturation, as in naive: fp16 fields stop at +-65504, and a key whose fp32 sum of squares overflows normalizes
# by sqrt(fp32 max) (as rounded to fp32) instead of inf.
FP16_MAX: tl.constexpr = tl.constexpr(65504.0)
FP32_SQRT_MAX: tl.constexpr = tl.constexpr(1.8446742974197924e19)
FP32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _store_packed(cache_u8, byte_off, codes, mask, BLOCK_R: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr):
    """Pack int32 codes [BLOCK_R, N] like naive.pack_codes and store them at byte_off [BLOCK_R] (int64)."""
    m = mask[:, None]
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(codes, (BLOCK_R, N // 2, 2)))
        cols = tl.arange(0, N // 2)
        tl.store(cache_u8 + byte_off[:, None] + cols[None, :], (lo | (hi << 4)).to(tl.uint8), mask=m)
    else:
        tl.static_assert(BITS == 3)
        lo, hi = tl.split(tl.permute(tl.reshape(codes, (BLOCK_R, 2, N // 16, 8)), (0, 2, 3, 1)))
        ptr = cache_u8 + byte_off[:, None] + (tl.arange(0, N // 16) * 6)[None, :]
        _store_pack3(ptr, lo, hi, m, BLOCK_R, N // 16)


@triton.jit
def _store_pack3(ptr, lo, hi, mask, X: tl.constexpr, Y: tl.constexpr):
    """Store 16-code chunks like naive.pack_codes: ``lo`` / ``hi`` [X, Y, 8] are the codes of channels 8c + k and
    d/2 + 8c + k of chunk c, ``ptr`` [X, Y] its first byte. Each halfword goes out as two bytes: rows are only
    2-byte aligned, and the store is not where the time goes."""
    lo_a, lo_b = tl.split(tl.permute(tl.reshape(lo, (X, Y, 2, 4)), (0, 1, 3, 2)))
    hi_a, top = tl.split(tl.permute(tl.reshape(hi, (X, Y, 2, 4)), (0, 1, 3, 2)))
    nibble = (tl.arange(0, 4) * 4)[None, None, :]
    h0 = tl.sum((lo_a | ((top & 1) << 3)) << nibble, axis=2)
    h1 = tl.sum((lo_b | ((top & 2) << 2)) << nibble, axis=2)
    h2 = tl.sum((hi_a | ((top & 4) << 1)) << nibble, axis=2)
    tl.store(ptr, (h0 & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + 1, (h0 >> 8).to(tl.uint8), mask=mask)
    tl.store(ptr + 2, (h1 & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + 3, (h1 >> 8).to(tl.uint8), mask=mask)
    tl.store(ptr + 4, (h2 & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + 5, (h2 >> 8).to(tl.uint8), mask=mask)


@triton.jit
def _bucketize_half(mag, p0, p1, p2, p3, p4, p5, p6, q0, q1, q2, q3, q4, q5, q6, q7, BITS: tl.constexpr,
                    OFFSET: tl.constexpr = 0):
    """OFFSET + index among the positive Lloyd-Max buckets (count of ascending boundaries p_j < mag) and the squared
    centroid of that bucket (q_i), by a binary search of selects: log2 compares instead of one per boundary. The
    offset rides in the first select for free."""
    if BITS == 4:
        b2 = mag > p3
        b1 = mag > tl.where(b2, p5, p1)
        b0 = mag > tl.where(b2, tl.where(b1, p6, p4), tl.where(b1, p2, p0))
        step = tl.where(b2, OFFSET + 4, OFFSET) + b1.to(tl.int32) * 2 + b0.to(tl.int32)
        c2 = tl.where(b2, tl.where(b1, tl.where(b0, q7, q6), tl.where(b0, q5, q4)),
                      tl.where(b1, tl.where(b0, q3, q2), tl.where(b0, q1, q0)))
    else:
        tl.static_assert(BITS == 3)
        b1 = mag > p1
        b0 = mag > tl.where(b1, p2, p0)
        step = tl.where(b1, OFFSET + 2, OFFSET) + b0.to(tl.int32)
        c2 = tl.where(b1, tl.where(b0, q3, q2), tl.where(b0, q1, q0))
    return step, c2


@triton.jit
def _fwht(x, BLOCK_R: tl.constexpr, N: tl.constexpr, LOG2_N: tl.constexpr):
    """x [BLOCK_R, N] @ H_N (Sylvester Hadamard, unnormalized) by log2(N) butterfly stages."""
    for s in tl.static_range(LOG2_N):
        # Pair element i with i + h inside blocks of 2h, h = 2^s: (u, v) -> (u + v, u - v).
        x4 = tl.permute(tl.reshape(x, (BLOCK_R, N >> (s + 1), 2, 1 << s)), (0, 1, 3, 2))
        u, v = tl.split(x4)
        x = tl.reshape(tl.permute(tl.join(u + v, u - v), (0, 1, 3, 2)), (BLOCK_R, N))
    return x


@triton.jit
def _fp8_prepare(x, scale, SCALE_MODE: tl.constexpr, FP8_MAX: tl.constexpr):
    """x / scale saturated to the fp8 range. SCALE_MODE 0: scale is 1; 1: ``scale`` holds the exact reciprocal
    of a power-of-two scale (a product then rounds like the quotient); 2: general scale, true division."""
    if SCALE_MODE == 0:
        y = x
    elif SCALE_MODE == 1:
        y = x * scale
    else:
        y = tl.math.div_rn(x, tl.zeros_like(x) + scale)
    # Saturate: an out-of-range fp8 cast would give NaN/inf.
    return tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _soft_fp8_bits(x, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_MIN_NORMAL_BITS: tl.constexpr,
                   FP8_SUB_SCALE: tl.constexpr):
    """fp32 (already clamped to the fp8 range) -> fp8 bits as int32, round to nearest even, in integer math.

    The interpreter's own fp8 cast does not carry a mantissa round-up into the exponent (1.97 -> 1.0).
    """
    SHIFT: tl.constexpr = 23 - FP8_MANT
    HALF_MINUS_ONE: tl.constexpr = (1 << (SHIFT - 1)) - 1
    REBIAS: tl.constexpr = (127 - FP8_BIAS) << FP8_MANT
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal results: round the fp32 mantissa to FP8_MANT bits (a carry bumps the exponent), then rebias.
    normal = ((mag + HALF_MINUS_ONE + ((mag >> SHIFT) & 1)) >> SHIFT) - REBIAS
    # Subnormal results: the code is |x| / 2^(1 - bias - mant) rounded to an integer (2^23 trick: exact RNE).
    small = tl.minimum(mag, FP8_MIN_NORMAL_BITS).to(tl.float32, bitcast=True)
    sub = ((small * FP8_SUB_SCALE + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag < FP8_MIN_NORMAL_BITS, sub, normal)
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return code | sign


@triton.jit
def _soft_bf16_bits(x):
    """fp32 -> bf16 bits as int16, round to nearest even (the interpreter's bf16 cast truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, ((bits >> 16) & 0x8000) | 0x7FC0, rounded)
    return rounded.to(tl.int16)


@triton.jit
def _token_block(pair, slot_ptr, num_tokens, num_slots, NUM_HEADS: tl.constexpr, BLOCK_R: tl.constexpr):
    """Tokens [BLOCK_R] (int64) and head (scalar) of grid-stride step ``pair``, their (slot, head) row index in
    the flat cache, and which rows to store (in range, slot >= 0 and inside the cache).

    The head is a scalar on purpose: a per-row "row % heads" makes Triton 3.6 overestimate the alignment of the
    slot addresses and emit misaligned vector stores."""
    tb = pair // NUM_HEADS
    head = pair - tb * NUM_HEADS
    tok = tb * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = tok < num_tokens
    tok = tok.to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=in_rows, other=-1).to(tl.int64)
    # The bound check keeps a bad slot_mapping from writing outside the cache.
    ok = in_rows & (slot >= 0) & (slot < num_slots)
    return tok, head, slot * NUM_HEADS + head, ok


@triton.jit
def _sat_fma(x, y, z, ASM: tl.constexpr):
    """clamp(x * y + z, 0, 1), NaN -> 0, for same-shape tensors: one saturating FMA (``fma.rn.sat``) where compiled,
    instead of two min/max on the integer pipe (which issues at half the FMA pipe's rate on an H200)."""
    if ASM:
        return tl.inline_asm_elementwise("fma.rn.sat.f32 $0, $1, $2, $3;", "=f,f,f,f", [x, y, z],
                                         dtype=tl.float32, is_pure=True, pack=1)
    t = tl.fma(x, y, z)
    return tl.where(t > 0.0, tl.minimum(t, 1.0), 0.0)


@triton.jit
def _half_sat(x, ASM: tl.constexpr):
    """fp32 -> fp16 saturated at +-65504 (a plain conversion gives +-inf); compiled, one cvt.rn.satfinite, no dearer
    than the plain cvt, where a clamp would add instructions."""
    if ASM:
        return tl.inline_asm_elementwise("cvt.rn.satfinite.f16.f32 $0, $1;", "=h,f", [x], dtype=tl.float16,
                                         is_pure=True, pack=1)
    return tl.minimum(tl.maximum(x, -FP16_MAX), FP16_MAX).to(tl.float16)


@triton.jit
def _uniform_row_params(vmin, vmax, LEVELS: tl.constexpr, ASM: tl.constexpr):
    """Per-row (zero, scale) of asymmetric uniform values clipped to +-65504, with naive.value_scale_zero's
    operations, order and fp16 roundings (the zero saturates at +-65504, the span ends at 65504, so the scale never
    saturates and a value beyond gets code 0 / LEVELS), and the encoder's gain a = 1 / (scale * LEVELS) (0 where scale
    is 0, so those rows encode as code 0).

    The quotients are approximate (a product by 1 / LEVELS, a fast reciprocal): within a few fp32 ulps, which the
    fp16 rounding of the scale absorbs or the byte-for-byte test counts as a tie, and without the correctly rounded
    division's check and branch per row (docs/tuning.md)."""
    zero = _half_sat(vmin, ASM).to(tl.float32)
    span = tl.maximum(tl.minimum(vmax, FP16_MAX, propagate_nan=tl.PropagateNan.ALL) - zero, 0.0)
    scale = _half_sat(span * (1.0 / LEVELS) * 1.0009765625, ASM).to(tl.float32)
    pos = scale > 0
    return zero, scale, tl.where(pos, 1.0 / (tl.where(pos, scale, 1.0) * LEVELS), 0.0)


@triton.jit
def _uniform_codes(v, zero, a, LEVELS: tl.constexpr, ASM: tl.constexpr):
    """rint(clamp((v - zero) * a, 0, 1) * LEVELS) as int32, zero and a broadcastable to v.

    The clamp is the saturation of one FMA, the rint an FMA with 2^23 (whose ulp is 1), and the code is read from
    the low mantissa bits: fewer integer-pipe instructions than a quotient, clamps, floor and conversion. Differs from
    the reference's floor(q + 0.5) only within a few ulps of a half-integer q."""
    a = a + tl.zeros_like(v)
    u = _sat_fma(v, a, -zero * a, ASM)
    t = tl.fma(u, tl.full(v.shape, LEVELS, tl.float32), tl.full(v.shape, 8388608.0, tl.float32))
    return t.to(tl.int32, bitcast=True) & LEVELS


@triton.jit
def fwht_rows(x, A: tl.constexpr, R: tl.constexpr, E: tl.constexpr, LOG2_A: tl.constexpr, LOG2_E: tl.constexpr):
    """x [A, R, E] (channel a * E + e) times the Sylvester Hadamard matrix of order A * E, per row."""
    for s in tl.static_range(LOG2_E):
        # Pair channel e with e + h inside blocks of 2h, h = 2^s: (u, v) -> (u + v, u - v).
        x5 = tl.permute(tl.reshape(x, (A, R, E >> (s + 1), 2, 1 << s)), (0, 1, 2, 4, 3))
        u, v = tl.split(x5)
        x = tl.reshape(tl.permute(tl.join(u + v, u - v), (0, 1, 2, 4, 3)), (A, R, E))
    for s in tl.static_range(LOG2_A):
        x5 = tl.permute(tl.reshape(x, (A >> (s + 1), 2, 1 << s, R, E)), (0, 2, 3, 4, 1))
        u, v = tl.split(x5)
        x = tl.reshape(tl.permute(tl.join(u + v, u - v), (0, 4, 1, 2, 3)), (A, R, E))
    return x
