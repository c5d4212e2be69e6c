"""Fused Triton kv_store: quantize K/V and write them into the paged cache in one launch, matching kv_store_naive."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..formats import CacheFormat
from ..quant import lloyd_max, rotation_matrix

_KEY_MODES = {"dense": 0, "fp8": 1, "mse": 2}
_VALUE_MODES = {"dense": 0, "fp8": 1, "uniform": 2}

# How the rotation dot runs. Exactness matters more than speed here: codes must match the fp32 reference.
DOT_IEEE = 0  # fp32 x fp32 FMA (the interpreter's only faithful mode)
DOT_NATIVE16 = 1  # bf16/fp16 operands: the +-1 Hadamard and the 16-bit inputs are exact, accumulation is fp32
DOT_TF32 = 2  # tf32: also exact for 16-bit inputs (their mantissas fit in tf32)
DOT_TF32X3 = 3  # fp32 inputs: split into two tf32 halves, ~fp32 accuracy


@triton.jit
def _store_packed(cache_u8, byte_off, codes, mask, BLOCK_R: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Pack int32 codes [BLOCK_R, D] like naive.pack_codes and store them at byte_off [BLOCK_R] (int64)."""
    m = mask[:, None]
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(codes, (BLOCK_R, D // 2, 2)))
        cols = tl.arange(0, D // 2)
        tl.store(cache_u8 + byte_off[:, None] + cols[None, :], (lo | (hi << 4)).to(tl.uint8), mask=m)
    else:
        tl.static_assert(BITS == 3)
        groups = tl.reshape(codes, (BLOCK_R, D // 8, 8))
        shifts = tl.arange(0, 8) * 3
        # Disjoint bit fields, so the sum is the 24-bit little-endian word of 8 codes.
        word = tl.sum(groups << shifts[None, None, :], axis=2)
        ptr = cache_u8 + byte_off[:, None] + (tl.arange(0, D // 8) * 3)[None, :]
        tl.store(ptr, (word & 0xFF).to(tl.uint8), mask=m)
        tl.store(ptr + 1, ((word >> 8) & 0xFF).to(tl.uint8), mask=m)
        tl.store(ptr + 2, ((word >> 16) & 0xFF).to(tl.uint8), mask=m)


@triton.jit
def _fp8_encode(x, scale, FP8_MAX: tl.constexpr):
    # Division, not a reciprocal multiply, to round like the reference's x / scale.
    y = tl.math.div_rn(x, tl.zeros_like(x) + scale)
    # Saturate: an out-of-range fp8 cast would give NaN/inf.
    return tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _soft_fp8_bits(x, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr):
    """fp32 (already clamped to the fp8 range) -> fp8 bits as int32, round to nearest even, in integer math.

    The interpreter's own fp8 cast does not carry a mantissa round-up into the exponent (1.97 -> 1.0).
    """
    SHIFT: tl.constexpr = 23 - FP8_MANT
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal results: round the fp32 mantissa to FP8_MANT bits (a carry bumps the exponent), then rebias.
    rounded = (mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT
    normal = rounded - ((127 - FP8_BIAS) << FP8_MANT)
    # Subnormal results: the code is |x| / 2^(1 - bias - mant) rounded to an integer (2^23 trick, exact RNE).
    scaled = mag.to(tl.float32, bitcast=True) * (2.0 ** (FP8_BIAS - 1 + FP8_MANT))
    sub = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag < ((128 - FP8_BIAS) << 23), sub, normal)
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
def _store_dense(ptr, x, mask, SOFT_CAST: tl.constexpr):
    if SOFT_CAST and ptr.dtype.element_ty == tl.int16:
        tl.store(ptr, _soft_bf16_bits(x), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_fp8(ptr, x, mask, SOFT_CAST: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr):
    if SOFT_CAST:
        tl.store(ptr, _soft_fp8_bits(x, FP8_MANT, FP8_BIAS).to(tl.uint8), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows", "num_slots", "k_st", "k_sh", "v_st", "v_sh"])
def _kv_store_kernel(
    key_ptr, value_ptr, slot_ptr,
    cache_u8, cache_f16, cache_dense, cache_f8,
    hs_ptr, bounds_ptr, cents_ptr,
    num_rows, num_slots,
    k_st, k_sh, k_sd, v_st, v_sh, v_sd,
    k_scale, v_scale, sqrt_d,
    NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SLOT_BYTES: tl.constexpr,
    KEY_MODE: tl.constexpr, KEY_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    VALUE_MODE: tl.constexpr, VALUE_BITS: tl.constexpr,
    KEY_NORM_OFF: tl.constexpr, VALUE_OFF: tl.constexpr, VALUE_SCALE_OFF: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    SOFT_CAST: tl.constexpr, DOT_MODE: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # Rows are (token, head) pairs flattened token-major; a program walks row blocks with a grid stride,
    # so the host may launch fewer programs than blocks (persistent) and load the Hadamard matrix once.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    if KEY_MODE == 2:
        hs = tl.load(hs_ptr + cols[:, None] * D + cols[None, :])
    num_row_blocks = tl.cdiv(num_rows, BLOCK_R)
    for rb in range(pid, num_row_blocks, tl.num_programs(0)):
        rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        in_rows = rows < num_rows
        tok = (rows // NUM_HEADS).to(tl.int64)
        head = rows % NUM_HEADS
        slot = tl.load(slot_ptr + tok, mask=in_rows, other=-1).to(tl.int64)
        # The bound check keeps a bad slot_mapping from writing outside the cache.
        ok = in_rows & (slot >= 0) & (slot < num_slots)
        dst_row = slot * NUM_HEADS + head  # index of this (slot, head) in the flat cache
        dst = dst_row * SLOT_BYTES  # byte offset
        m2 = ok[:, None] & col_ok[None, :]
        k_ptrs = key_ptr + tok[:, None] * k_st + head[:, None] * k_sh + cols[None, :] * k_sd
        v_ptrs = value_ptr + tok[:, None] * v_st + head[:, None] * v_sh + cols[None, :] * v_sd

        # ---- key ----
        if KEY_MODE == 0:
            k = tl.load(k_ptrs, mask=m2).to(tl.float32)
            _store_dense(cache_dense + (dst_row * (SLOT_BYTES // 2))[:, None] + cols[None, :], k, m2, SOFT_CAST)
        elif KEY_MODE == 1:
            k = _fp8_encode(tl.load(k_ptrs, mask=m2).to(tl.float32), k_scale, FP8_MAX)
            _store_fp8(cache_f8 + dst[:, None] + cols[None, :], k, m2, SOFT_CAST, FP8_MANT, FP8_BIAS)
        else:
            k_raw = tl.load(k_ptrs, mask=m2, other=0.0)
            k = k_raw.to(tl.float32)
            # hs = sqrt(d) * R^T has +-1 entries, so y = sqrt(d) * (k @ R^T) with exact products.
            if DOT_MODE == 0:
                y = tl.dot(k, hs, input_precision="ieee")
            elif DOT_MODE == 1:
                y = tl.dot(k_raw, hs)
            elif DOT_MODE == 2:
                y = tl.dot(k, hs, input_precision="tf32")
            else:
                y = tl.dot(k, hs, input_precision="tf32x3")
            norm = tl.sqrt_rn(tl.sum(k * k, axis=1))
            # Unit-variance coordinates sqrt(d) * R k / ||k||, the quantity the reference bucketizes.
            z = tl.math.div_rn(y, tl.zeros_like(y) + tl.maximum(norm, 1e-30)[:, None])
            code = tl.zeros([BLOCK_R, BLOCK_D], tl.int32)
            cval = tl.zeros([BLOCK_R, BLOCK_D], tl.float32) + tl.load(cents_ptr)
            # Boundaries ascend, so "z > b_i" holds for a prefix of i: count it, and select the centroid
            # by replacement (exact, unlike summing centroid gaps).
            for i in tl.static_range((1 << KEY_BITS) - 1):
                above = z > tl.load(bounds_ptr + i)
                code += above.to(tl.int32)
                cval = tl.where(above, tl.load(cents_ptr + i + 1), cval)
            if NORM_CORRECTION:
                stored = tl.math.div_rn(norm, tl.sqrt_rn(tl.sum(cval * cval, axis=1)))
            else:
                stored = tl.math.div_rn(norm, tl.zeros_like(norm) + sqrt_d)
            _store_packed(cache_u8, dst, code, ok, BLOCK_R, D, KEY_BITS)
            tl.store(cache_f16 + (dst + KEY_NORM_OFF) // 2, stored.to(tl.float16), mask=ok)

        # ---- value ----
        if VALUE_MODE == 0:
            v = tl.load(v_ptrs, mask=m2).to(tl.float32)
            _store_dense(cache_dense + (dst_row * (SLOT_BYTES // 2) + VALUE_OFF // 2)[:, None] + cols[None, :], v, m2,
                         SOFT_CAST)
        elif VALUE_MODE == 1:
            v = _fp8_encode(tl.load(v_ptrs, mask=m2).to(tl.float32), v_scale, FP8_MAX)
            _store_fp8(cache_f8 + (dst + VALUE_OFF)[:, None] + cols[None, :], v, m2, SOFT_CAST, FP8_MANT, FP8_BIAS)
        else:
            LEVELS: tl.constexpr = (1 << VALUE_BITS) - 1
            v = tl.load(v_ptrs, mask=m2, other=0.0).to(tl.float32)
            # Same operation order and fp16 roundings as naive.value_scale_zero.
            zero = tl.min(v, axis=1).to(tl.float16).to(tl.float32)
            span = tl.maximum(tl.max(v, axis=1) - zero, 0.0)
            levels = tl.full([BLOCK_R], LEVELS, tl.float32)
            scale = (tl.math.div_rn(span, levels) * 1.0009765625).to(tl.float16).to(tl.float32)
            pos = scale > 0
            safe = tl.where(pos, scale, 1.0)
            q = tl.math.div_rn(v - zero[:, None], tl.zeros_like(v) + safe[:, None])
            q = tl.where(pos[:, None], q, 0.0)
            vcode = tl.minimum(tl.maximum(tl.floor(q + 0.5), 0.0), LEVELS).to(tl.int32)
            _store_packed(cache_u8, dst + VALUE_OFF, vcode, ok, BLOCK_R, D, VALUE_BITS)
            sz = cache_f16 + (dst + VALUE_SCALE_OFF) // 2
            tl.store(sz, scale.to(tl.float16), mask=ok)
            tl.store(sz + 1, zero.to(tl.float16), mask=ok)


# ---- host side ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _hadamard_signs(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Rounding sqrt(d) * R^T recovers its exact +-1 entries, representable in every dot dtype.
    hs = torch.round(rotation_matrix(head_dim) * head_dim**0.5)
    return hs.to(dtype).to(device).contiguous()


@functools.lru_cache(maxsize=None)
def _codebook(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    centroids, bounds = lloyd_max(bits)
    return centroids.to(device), bounds.to(device)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _interpreted() -> bool:
    # Decided when the kernel was decorated (TRITON_INTERPRET at import), not by the current environment.
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kv_store_kernel, InterpretedFunction)


def default_config(fmt: CacheFormat, head_dim: int, dtype: torch.dtype) -> dict:
    """Launch parameters for one format/shape: rows per program, warps, programs per SM (0 = one per block), dot mode."""
    if _interpreted():
        return dict(block_r=16, num_warps=4, programs_per_sm=0, dot_mode=DOT_IEEE, soft_cast=True)
    dot_mode = DOT_NATIVE16 if dtype in (torch.bfloat16, torch.float16) else DOT_TF32X3
    if fmt.key_mode == "mse":
        block_r = 32 if head_dim >= 256 else 64
        return dict(block_r=block_r, num_warps=8, programs_per_sm=0, dot_mode=dot_mode, soft_cast=False)
    return dict(block_r=max(8, 8192 // triton.next_power_of_2(head_dim)), num_warps=8, programs_per_sm=0,
                dot_mode=dot_mode, soft_cast=False)


def launch(key, value, kv_cache, slot_mapping, fmt: CacheFormat, k_scale: float, v_scale: float, *,
           block_r: int, num_warps: int, programs_per_sm: int, dot_mode: int, soft_cast: bool) -> None:
    """kv_store_triton with explicit launch parameters (for tuning)."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    num_blocks, block_size, _, slot_bytes = kv_cache.shape
    device = kv_cache.device
    mse, fp8 = fmt.key_mode == "mse", fmt.fp8_dtype is not None
    if mse:
        if dot_mode == DOT_NATIVE16 and key.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError("DOT_NATIVE16 needs bf16/fp16 keys")
        hs_dtype = key.dtype if dot_mode == DOT_NATIVE16 else torch.float32
        hs = _hadamard_signs(head_dim, hs_dtype, device)
        cents, bounds = _codebook(fmt.key_bits, device)
    else:
        hs = cents = bounds = kv_cache  # unused by the pruned branches
    num_rows = num_tokens * num_heads
    dense_view = kv_cache
    if fmt.dense_dtype is not None:
        soft_bf16 = soft_cast and fmt.dense_dtype == torch.bfloat16
        dense_view = kv_cache.view(torch.int16 if soft_bf16 else fmt.dense_dtype)
    num_row_blocks = triton.cdiv(num_rows, block_r)
    grid_size = num_row_blocks
    if programs_per_sm and device.type == "cuda":
        grid_size = min(grid_size, programs_per_sm * _sm_count(device))
    _kv_store_kernel[(grid_size,)](
        key, value, slot_mapping,
        kv_cache,
        kv_cache.view(torch.float16),
        dense_view,
        kv_cache if soft_cast else kv_cache.view(fmt.fp8_dtype) if fp8 else kv_cache,
        hs, bounds, cents,
        num_rows, num_blocks * block_size,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        float(k_scale), float(v_scale), float(head_dim**0.5),
        NUM_HEADS=num_heads, D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), SLOT_BYTES=slot_bytes,
        KEY_MODE=_KEY_MODES[fmt.key_mode], KEY_BITS=fmt.key_bits, NORM_CORRECTION=fmt.norm_correction,
        VALUE_MODE=_VALUE_MODES[fmt.value_mode], VALUE_BITS=fmt.value_bits,
        KEY_NORM_OFF=fmt.key_norm_offset(head_dim), VALUE_OFF=fmt.value_offset(head_dim),
        VALUE_SCALE_OFF=fmt.value_scale_offset(head_dim),
        FP8_MAX=float(torch.finfo(fmt.fp8_dtype).max) if fp8 else 0.0,
        FP8_MANT=2 if fmt.fp8_dtype == torch.float8_e5m2 else 3, FP8_BIAS=15 if fmt.fp8_dtype == torch.float8_e5m2 else 7,
        SOFT_CAST=soft_cast, DOT_MODE=dot_mode, BLOCK_R=block_r,
        num_warps=num_warps,
    )


def kv_store_triton(key, value, kv_cache, slot_mapping, fmt: CacheFormat, k_scale: float, v_scale: float) -> None:
    """Same contract as kv_store_naive, in one kernel launch with no host sync (CUDA-graph capturable).

    The small constant tables (Hadamard signs, codebook) are built and cached on the first call per
    device/head_dim/dtype, so run once before capturing a graph.
    """
    cfg = default_config(fmt, key.shape[2], key.dtype)
    launch(key, value, kv_cache, slot_mapping, fmt, k_scale, v_scale, **cfg)
