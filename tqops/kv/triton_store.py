"""Fused Triton kv_store: quantize K/V and write them into the paged cache in one launch, matching kv_store_naive."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..formats import CacheFormat
from ..norm.triton_norm import qk_norm_rope_triton, rms_rope_tile
from ..pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from ..quant import lloyd_max, rotation_signs
from .codecs import (FP32_SQRT_MAX, KEY_MODES, MODE_DENSE, MODE_FP8, VALUE_MODES, _bucketize_half, _fp8_prepare,
                     _fwht, _half_sat, _soft_bf16_bits, _soft_fp8_bits, _store_packed, _token_block,
                     _uniform_codes, _uniform_row_params)
from .naive import split_qkv
from .triton_store_rows import _kv_store_rows_kernel


@triton.jit(do_not_specialize=["num_tokens", "num_slots"])
def _kv_store_kernel(
    key_ptr, value_ptr, slot_ptr,
    cache_u8, cache_f16, cache_dense, cache_f8,
    signs_ptr,
    num_tokens, num_slots,
    k_st, k_sh, k_sd, v_st, v_sh, v_sd,
    k_scale, v_scale, sqrt_d, mid_bound,
    p0, p1, p2, p3, p4, p5, p6, q0, q1, q2, q3, q4, q5, q6, q7,
    NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SLOT_BYTES: tl.constexpr,
    KEY_MODE: tl.constexpr, KEY_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    VALUE_MODE: tl.constexpr, VALUE_BITS: tl.constexpr,
    KEY_NORM_OFF: tl.constexpr, VALUE_OFF: tl.constexpr, VALUE_SCALE_OFF: tl.constexpr,
    K_SCALE_MODE: tl.constexpr, V_SCALE_MODE: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    FP8_MIN_NORMAL_BITS: tl.constexpr, FP8_SUB_SCALE: tl.constexpr,
    SOFT_FP8: tl.constexpr, SOFT_BF16: tl.constexpr,
    LOG2_D: tl.constexpr, BLOCK_R: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr,
    q_ptr=None, q_out_ptr=None, q_st=0, qw_ptr=None, kw_ptr=None, pos_ptr=None, inv_freq_ptr=None, eps=0.0,
    NORM_ROPE: tl.constexpr = False, NUM_Q_HEADS: tl.constexpr = 0,
):
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    # A program stores BLOCK_R tokens of one head and walks (token block, head) pairs with a grid stride, so
    # the host may launch fewer programs than pairs (persistent grid) as well as one per pair.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    HALF: tl.constexpr = 1 << (KEY_BITS - 1)
    num_pairs = tl.cdiv(num_tokens, BLOCK_R) * NUM_HEADS
    for pair in range(pid, num_pairs, tl.num_programs(0)):
        tok, head, dst_row, ok = _token_block(pair, slot_ptr, num_tokens, num_slots, NUM_HEADS, BLOCK_R)
        dst = dst_row * SLOT_BYTES  # byte offset
        m2 = ok[:, None] & col_ok[None, :]
        # Both loads before any store: the compiler cannot hoist a load above a store that may alias it, and
        # the bytes in flight are what keeps this memory-bound kernel busy.
        k_raw = tl.load(key_ptr + head * k_sh + tok[:, None] * k_st + cols[None, :] * k_sd, mask=m2, other=0.0)
        v_raw = tl.load(value_ptr + head * v_sh + tok[:, None] * v_st + cols[None, :] * v_sd, mask=m2, other=0.0)
        if NORM_ROPE:
            # The keys arrive straight from the projection (unit channel stride): normed and rotated here,
            # rounded to the model dtype as qk_norm_rope's output is, then stored like any key.
            k_pos = tl.load(pos_ptr + tok, mask=tok < num_tokens, other=0)
            k_raw = rms_rope_tile(key_ptr + head * k_sh + tok[:, None] * k_st, k_raw, cols, m2, kw_ptr, k_pos,
                                  inv_freq_ptr, eps, D, key_ptr.dtype.element_ty)

        # ---- key ----
        if KEY_MODE == MODE_DENSE:
            k = k_raw.to(tl.float32)
            k_dst = cache_dense + (dst_row * (SLOT_BYTES // 2))[:, None] + cols[None, :]
            if SOFT_BF16:
                tl.store(k_dst, _soft_bf16_bits(k), mask=m2)
            else:
                tl.store(k_dst, k.to(cache_dense.dtype.element_ty), mask=m2)
        elif KEY_MODE == MODE_FP8:
            k = _fp8_prepare(k_raw.to(tl.float32), k_scale, K_SCALE_MODE, FP8_MAX)
            if SOFT_FP8:
                k_bits = _soft_fp8_bits(k, FP8_MANT, FP8_BIAS, FP8_MIN_NORMAL_BITS, FP8_SUB_SCALE)
                tl.store(cache_u8 + dst[:, None] + cols[None, :], k_bits.to(tl.uint8), mask=m2)
            else:
                tl.store(cache_f8 + dst[:, None] + cols[None, :], k.to(cache_f8.dtype.element_ty), mask=m2)
        else:
            k = k_raw.to(tl.float32)
            norm = tl.sqrt_rn(tl.sum(k * k, axis=1))
            # The reference bucketizes sqrt(d) * R k / ||k||; a reciprocal multiply moves it by an ulp or two,
            # which only matters within float rounding of a boundary.
            # An overflowed (inf) norm divides as sqrt(fp32 max), as in the reference: z lands in the outer buckets.
            rnorm = tl.math.div_rn(tl.full([BLOCK_R], 1.0, tl.float32),
                                   tl.minimum(tl.maximum(norm, 1e-30), FP32_SQRT_MAX))
            # y = sqrt(d) * (k @ R^T) with sqrt(d) * R^T = diag(signs) H: the Walsh-Hadamard butterfly of the
            # sign-flipped key, fp32 adds only, so the codes match the fp32 reference.
            y = _fwht(k * tl.load(signs_ptr + cols)[None, :], BLOCK_R, D, LOG2_D)
            z = y * rnorm[:, None]
            # The codebook is symmetric: bucketize |z| against the positive boundaries (p_j, scalar args)
            # and pick the half with the reference's own middle boundary; q_i = squared centroids, exact.
            step, c2 = _bucketize_half(tl.abs(z), p0, p1, p2, p3, p4, p5, p6, q0, q1, q2, q3, q4, q5, q6, q7,
                                       KEY_BITS)
            code = tl.where(z > mid_bound, HALF + step, HALF - 1 - step)
            c2_sum = tl.sum(c2, axis=1)
            _store_packed(cache_u8, dst, code, ok, BLOCK_R, D, KEY_BITS)
            if NORM_CORRECTION:
                # Folding 1/||c|| into the stored norm, as the reference does.
                stored = tl.math.div_rn(norm, tl.sqrt_rn(c2_sum))
            else:
                stored = tl.math.div_rn(norm, tl.zeros_like(norm) + sqrt_d)
            tl.store(cache_f16 + (dst + KEY_NORM_OFF) // 2, _half_sat(stored, ASM), mask=ok)

        # ---- value ----
        if VALUE_MODE == MODE_DENSE:
            v = v_raw.to(tl.float32)
            v_dst = cache_dense + (dst_row * (SLOT_BYTES // 2) + VALUE_OFF // 2)[:, None] + cols[None, :]
            if SOFT_BF16:
                tl.store(v_dst, _soft_bf16_bits(v), mask=m2)
            else:
                tl.store(v_dst, v.to(cache_dense.dtype.element_ty), mask=m2)
        elif VALUE_MODE == MODE_FP8:
            v = _fp8_prepare(v_raw.to(tl.float32), v_scale, V_SCALE_MODE, FP8_MAX)
            if SOFT_FP8:
                v_bits = _soft_fp8_bits(v, FP8_MANT, FP8_BIAS, FP8_MIN_NORMAL_BITS, FP8_SUB_SCALE)
                tl.store(cache_u8 + (dst + VALUE_OFF)[:, None] + cols[None, :], v_bits.to(tl.uint8), mask=m2)
            else:
                tl.store(cache_f8 + (dst + VALUE_OFF)[:, None] + cols[None, :], v.to(cache_f8.dtype.element_ty),
                         mask=m2)
        else:
            LEVELS: tl.constexpr = (1 << VALUE_BITS) - 1
            v = v_raw.to(tl.float32)
            zero, scale, gain = _uniform_row_params(tl.min(v, axis=1), tl.max(v, axis=1), LEVELS, ASM)
            vcode = _uniform_codes(v, zero[:, None], gain[:, None], LEVELS, ASM)
            _store_packed(cache_u8, dst + VALUE_OFF, vcode, ok, BLOCK_R, D, VALUE_BITS)
            sz = cache_f16 + (dst + VALUE_SCALE_OFF) // 2
            tl.store(sz, scale.to(tl.float16), mask=ok)
            tl.store(sz + 1, zero.to(tl.float16), mask=ok)

    if NORM_ROPE and NUM_Q_HEADS > 0:
        # Fused with qk_norm_rope (qk_norm_rope_store): the (token block, query head) pairs follow the kv pairs in
        # the same grid-stride order; their programs only normalize and rotate queries.
        nprog = tl.num_programs(0)
        first = pid + tl.cdiv(tl.maximum(num_pairs - pid, 0), nprog) * nprog
        for pair in range(first, num_pairs + tl.cdiv(num_tokens, BLOCK_R) * NUM_Q_HEADS, nprog):
            qb = (pair - num_pairs) // NUM_Q_HEADS
            q_head = (pair - num_pairs) - qb * NUM_Q_HEADS
            q_tok = (qb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
            q_ok = (q_tok < num_tokens)[:, None] & col_ok[None, :]
            q_row = q_ptr + q_tok[:, None] * q_st + q_head * D
            q_raw = tl.load(q_row + cols[None, :], mask=q_ok, other=0.0)
            q_pos = tl.load(pos_ptr + q_tok, mask=q_tok < num_tokens, other=0)
            q = rms_rope_tile(q_row, q_raw, cols, q_ok, qw_ptr, q_pos, inv_freq_ptr, eps, D,
                              q_out_ptr.dtype.element_ty)
            tl.store(q_out_ptr + (q_tok[:, None] * NUM_Q_HEADS + q_head) * D + cols[None, :], q, mask=q_ok)


# ---- host side ------------------------------------------------------------------------------


class NormRope(NamedTuple):
    """The qk_norm_rope half of a fused launch: raw queries ``query`` [n, heads * head_dim] (unit channel stride)
    normalized and rotated into ``q_out`` [n, heads, head_dim]; the key weight, positions [n], fp32 frequencies
    [head_dim // 2] and eps apply to the keys too."""
    query: torch.Tensor
    q_out: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    positions: torch.Tensor
    inv_freq: torch.Tensor
    eps: float


@functools.lru_cache(maxsize=None)
def _half_codebook(bits: int) -> tuple[float, ...]:
    """Middle boundary, 7 positive boundaries and 8 squared positive centroids (fp32 values, as the reference
    squares them), zero-padded for fewer bits: scalar kernel arguments."""
    centroids, bounds = lloyd_max(bits)
    half = 1 << (bits - 1)
    # The kernel relies on the mirror symmetry of the Gaussian codebook.
    assert torch.equal(centroids, -centroids.flip(0)) and torch.equal(bounds[half:], -bounds[: half - 1].flip(0))
    pos_c = centroids[half:]
    pos_b = bounds[half:].tolist() + [0.0] * (8 - half)
    pos_c2 = (pos_c * pos_c).tolist() + [0.0] * (8 - half)
    return (float(bounds[half - 1]), *pos_b, *pos_c2)


@functools.lru_cache(maxsize=None)
def _signs_on(head_dim: int, device: torch.device) -> torch.Tensor:
    """float32 [head_dim] on ``device``: the +-1 sign flips of the rotation (quant.rotation_signs)."""
    return rotation_signs(head_dim).to(torch.float32).to(device)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def device_constants(fmt: CacheFormat, head_dim: int, device: torch.device) -> None:
    """Make (and cache) every device tensor a store into a ``fmt`` cache on ``device`` reads, so none is first made
    inside a captured step (see tqops.device_constants)."""
    _sm_count(device)
    if fmt.key_mode == "mse":
        _signs_on(head_dim, device)


def clear_device_constants() -> None:
    for made in (_signs_on, _sm_count):
        made.cache_clear()


def _scale_mode(scale: float) -> tuple[int, float]:
    """(mode, argument) for _fp8_prepare: skip a scale of 1, multiply by the exact reciprocal of a power of two."""
    scale = float(scale)
    if scale == 1.0:
        return 0, 1.0
    mantissa, exponent = math.frexp(scale)
    if mantissa == 0.5 and -125 <= exponent <= 126:
        return 1, math.ldexp(1.0, 1 - exponent)
    return 2, scale


def _interpreted() -> bool:
    # Decided when the kernel was decorated (TRITON_INTERPRET at import), not by the current environment.
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kv_store_kernel, InterpretedFunction)


# MSE caches take the general kernel fused with the q/k norm and RoPE up to this many tokens, and qk_norm_rope's
# kernel then the row-per-thread store beyond: the fused launch was faster (or even) up to 2,048 tokens for the MSE
# presets and slower at 16K tokens with 16 query heads (H100 figures in docs/tuning.md).
NORM_ROPE_MSE_MAX_TOKENS = 2048


def default_config(fmt: CacheFormat, head_dim: int, dtype: torch.dtype, norm_rope: bool = False) -> dict:
    """Launch parameters: tokens per program (block_r, one head each), warps, programs per SM (0: one per
    (token block, head)), integer-math casts (soft_cast), the row-per-thread kernel for MSE keys (rows) and its
    centroid-count norm correction (c2_counts). ``norm_rope``: for a launch fused with the q/k norm and RoPE
    (``qk_norm_rope_store``), which only the general kernel has."""
    if rows_kernel_applies(fmt, head_dim) and not norm_rope:
        # 4 rows per 1-warp program (8 threads per row) beat wider programs and the general kernel. A 72-register
        # cap (no spills) raises the resident warps per SM, and a persistent grid of 84 programs per SM beats one
        # program per 4 rows. Counting centroids instead of a select tree pays off with 4-bit values only (H200
        # sweeps in docs/tuning.md). Same kernel under the interpreter.
        compiled = not _interpreted()
        return dict(block_r=max(1, 512 // head_dim), num_warps=1, programs_per_sm=84 if compiled else 0,
                    soft_cast=not compiled, rows=True, c2_counts=fmt.value_bits == 4,
                    maxnreg=72 if compiled else None)
    if _interpreted():
        # Small blocks so the tests cover several programs; integer-math casts since the interpreter's are wrong.
        return dict(block_r=16, num_warps=4, programs_per_sm=0, soft_cast=True)
    if norm_rope:
        # 4 tokens per 4-warp program: the norm and the rotation (cos and sin per element) run on every row of a
        # tile, and at decode sizes the plain store's 16-32-row tiles are mostly padding; they made the fused
        # launch slower than qk_norm_rope's kernel and the store together (H200 figures in docs/tuning.md). MSE keys
        # add the butterfly and the bucketing, and 2 tokens per 2-warp program was the fastest tile or close to it
        # at every size the fused launch takes (H100 sweep in docs/tuning.md).
        if fmt.key_mode == "mse":
            return dict(block_r=2, num_warps=2, programs_per_sm=0, soft_cast=False)
        return dict(block_r=4, num_warps=4, programs_per_sm=0, soft_cast=False)
    # 16 elements of K and of V per thread. Quantizing formats are ALU-heavy and run best as small 4-warp
    # programs; copies take bigger ones (docs/tuning.md).
    block_d = triton.next_power_of_2(head_dim)
    if fmt.key_mode == "dense":
        return dict(block_r=max(1, 4096 // block_d), num_warps=8, programs_per_sm=0, soft_cast=False)
    return dict(block_r=max(1, 2048 // block_d), num_warps=4, programs_per_sm=0, soft_cast=False)


def rows_kernel_applies(fmt: CacheFormat, head_dim: int) -> bool:
    """Whether triton_store_rows can store this format: MSE keys, uniform values, power-of-two head_dim."""
    return fmt.key_mode == "mse" and fmt.value_mode == "uniform" and head_dim & (head_dim - 1) == 0 and head_dim >= 16


def launch(key, value, kv_cache, slot_mapping, fmt: CacheFormat, k_scale: float, v_scale: float, *,
           block_r: int, num_warps: int, programs_per_sm: int, soft_cast: bool,
           num_stages: int | None = None, rows: bool = False,
           c2_counts: bool = False, maxnreg: int | None = None, norm_rope: Optional[NormRope] = None) -> None:
    """kv_store_triton with explicit launch parameters (see default_config). ``rows``: the row-per-thread
    kernel of triton_store_rows (MSE formats; block_r and num_warps then set the rows per warp). ``norm_rope``:
    the keys are raw projections (unit channel stride) to RMSNorm and rotate first, and the same launch normalizes
    and rotates the queries (general kernel only)."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    num_blocks, block_size, _, slot_bytes = kv_cache.shape
    device = kv_cache.device
    if rows and rows_kernel_applies(fmt, head_dim):
        if norm_rope is not None:
            raise ValueError("norm_rope needs the general store kernel (rows=False)")
        _launch_rows(key, value, kv_cache, slot_mapping, fmt, block_r, num_warps, programs_per_sm, c2_counts,
                     maxnreg)
        return
    mse, fp8 = fmt.key_mode == "mse", fmt.fp8_dtype is not None
    if mse:
        signs = _signs_on(head_dim, device)
        codebook = _half_codebook(fmt.key_bits)
    else:
        signs = kv_cache  # never read: the key branch is pruned at compile time
        codebook = (0.0,) * 16
    soft_bf16 = soft_cast and fmt.dense_dtype == torch.bfloat16
    if fmt.dense_dtype is not None:
        dense_view = kv_cache.view(torch.int16 if soft_bf16 else fmt.dense_dtype)
    else:
        dense_view = kv_cache
    k_mode, k_scale_arg = _scale_mode(k_scale)
    v_mode, v_scale_arg = _scale_mode(v_scale)
    e5m2 = fmt.fp8_dtype == torch.float8_e5m2
    fp8_mant, fp8_bias = (2, 15) if e5m2 else (3, 7)
    fused = {}
    num_q_heads = 0
    if norm_rope is not None:
        num_q_heads = norm_rope.q_out.shape[1]
        fused = dict(q_ptr=norm_rope.query, q_out_ptr=norm_rope.q_out, q_st=norm_rope.query.stride(0),
                     qw_ptr=norm_rope.q_weight, kw_ptr=norm_rope.k_weight, pos_ptr=norm_rope.positions,
                     inv_freq_ptr=norm_rope.inv_freq, eps=float(norm_rope.eps), NORM_ROPE=True,
                     NUM_Q_HEADS=num_q_heads)
    grid_size = _grid_size(num_tokens, block_r, num_heads + num_q_heads, programs_per_sm, device)
    _kv_store_kernel[(grid_size,)](
        key, value, slot_mapping,
        kv_cache, kv_cache.view(torch.float16), dense_view,
        kv_cache.view(fmt.fp8_dtype) if fp8 and not soft_cast else kv_cache,
        signs,
        num_tokens, num_blocks * block_size,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        k_scale_arg, v_scale_arg, float(head_dim**0.5), *codebook,
        NUM_HEADS=num_heads, D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), SLOT_BYTES=slot_bytes,
        KEY_MODE=KEY_MODES[fmt.key_mode], KEY_BITS=fmt.key_bits, NORM_CORRECTION=fmt.norm_correction,
        VALUE_MODE=VALUE_MODES[fmt.value_mode], VALUE_BITS=fmt.value_bits,
        KEY_NORM_OFF=fmt.key_norm_offset(head_dim), VALUE_OFF=fmt.value_offset(head_dim),
        VALUE_SCALE_OFF=fmt.value_scale_offset(head_dim),
        K_SCALE_MODE=k_mode, V_SCALE_MODE=v_mode, FP8_MAX=float(torch.finfo(fmt.fp8_dtype).max) if fp8 else 0.0,
        FP8_MANT=fp8_mant, FP8_BIAS=fp8_bias,
        FP8_MIN_NORMAL_BITS=(128 - fp8_bias) << 23, FP8_SUB_SCALE=float(2.0 ** (fp8_bias - 1 + fp8_mant)),
        SOFT_FP8=soft_cast and fp8, SOFT_BF16=soft_bf16,
        LOG2_D=head_dim.bit_length() - 1, BLOCK_R=block_r, ASM=not _interpreted(),
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
        **pdl_launch_args(device, num_tokens == 1),  # a batch-1 decode step's store
        **fused,
    )


def _grid_size(num_tokens: int, block_r: int, num_heads: int, programs_per_sm: int, device) -> int:
    """One program per (token block, head), or at most programs_per_sm per SM walking them (persistent grid)."""
    size = triton.cdiv(num_tokens, block_r) * num_heads
    if programs_per_sm:
        size = min(size, programs_per_sm * (_sm_count(device) if device.type == "cuda" else 1))
    return size


@functools.lru_cache(maxsize=None)
def _sign_words(head_dim: int) -> dict:
    """The rotation's sign flips as constexpr words S0..S7 (bit c % 32 of word c // 32 set: channel c is negated)."""
    if head_dim > 256:
        raise ValueError(f"the row-per-thread store kernel supports head_dim <= 256 (8 sign words), got {head_dim}")
    negated = (rotation_signs(head_dim) < 0).tolist()
    words = [sum(1 << b for b in range(32) if 32 * w + b < head_dim and negated[32 * w + b]) for w in range(8)]
    return {f"S{w}": words[w] - (1 << 32) * (words[w] >> 31) for w in range(8)}  # as signed int32


def _launch_rows(key, value, kv_cache, slot_mapping, fmt: CacheFormat, block_r: int, num_warps: int,
                 programs_per_sm: int, c2_counts: bool, maxnreg: int | None = None) -> None:

    num_tokens, num_heads, head_dim = key.shape
    num_blocks, block_size, _, slot_bytes = kv_cache.shape
    chunk = 16 // key.element_size()  # channels per 16-byte load
    grid_size = _grid_size(num_tokens, block_r, num_heads, programs_per_sm, key.device)
    _kv_store_rows_kernel[(grid_size,)](
        key, value, slot_mapping, kv_cache, kv_cache.view(torch.float16),
        num_tokens, num_blocks * block_size,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        float(head_dim**0.5), *_half_codebook(fmt.key_bits)[1:],  # the middle boundary is 0: not passed
        NUM_HEADS=num_heads, D=head_dim, E=chunk, SLOT_BYTES=slot_bytes,
        KEY_BITS=fmt.key_bits, NORM_CORRECTION=fmt.norm_correction, VALUE_BITS=fmt.value_bits,
        KEY_NORM_OFF=fmt.key_norm_offset(head_dim), VALUE_OFF=fmt.value_offset(head_dim),
        VALUE_SCALE_OFF=fmt.value_scale_offset(head_dim),
        LOG2_A=(head_dim // chunk).bit_length() - 1, LOG2_E=chunk.bit_length() - 1, BLOCK_R=block_r,
        C2_COUNTS=c2_counts, ASM=not _interpreted(), **_sign_words(head_dim),
        num_warps=num_warps, **({} if maxnreg is None else {"maxnreg": maxnreg}),
        **pdl_launch_args(key.device, num_tokens == 1),
    )


def kv_store_triton(key, value, kv_cache, slot_mapping, fmt: CacheFormat, k_scale: float, v_scale: float) -> None:
    """Same contract as kv_store_naive, in one kernel launch with no host sync (CUDA-graph capturable).

    The Hadamard sign table for TurboQuant keys is made on the device when ``tqops.allocate_kv_cache`` allocates a
    cache there (tqops.device_constants); for a cache allocated otherwise it is made by the first call, which must
    then not be inside a graph capture or a cudagraph-trees warm-up.
    """
    cfg = default_config(fmt, key.shape[2], key.dtype)
    launch(key, value, kv_cache, slot_mapping, fmt, k_scale, v_scale, **cfg)


def qk_norm_rope_store_triton(qkv, q_weight, k_weight, positions, inv_freq, num_heads: int, num_kv_heads: int,
                              eps: float, kv_cache, slot_mapping, fmt: CacheFormat, k_scale: float,
                              v_scale: float) -> torch.Tensor:
    """Same contract as ``qk_norm_rope_store_naive``: one launch of the general store kernel for two or more tokens
    (MSE caches: up to ``NORM_ROPE_MSE_MAX_TOKENS``), else qk_norm_rope's kernel and then the store."""
    head_dim = 2 * inv_freq.shape[0]
    # One token (a batch-1 decode step) takes two launches: with programmatic dependent launch the second one's
    # start overlaps the first, and the fused kernel's chain of norm, rotation and encode is the longer one for a
    # single token (H200 figures in docs/tuning.md).
    n = qkv.shape[0]
    fuse = n > 1 and (n <= NORM_ROPE_MSE_MAX_TOKENS or not rows_kernel_applies(fmt, head_dim))
    cfg = default_config(fmt, head_dim, qkv.dtype, norm_rope=fuse)
    keys, values = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    if not fuse:
        q, k = qk_norm_rope_triton(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps)
        launch(k, values, kv_cache, slot_mapping, fmt, k_scale, v_scale, **cfg)
        return q
    q = qkv.new_empty(qkv.shape[0], num_heads, head_dim)
    fused = NormRope(qkv[:, :num_heads * head_dim], q, q_weight, k_weight, positions, inv_freq, eps)
    launch(keys, values, kv_cache, slot_mapping, fmt, k_scale, v_scale, **cfg, norm_rope=fused)
    return q
