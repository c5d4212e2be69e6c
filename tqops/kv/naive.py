"""Pure-torch kv_store / kv_load: the CPU implementation and the oracle for the Triton kernel.

Shapes: key/value ``[num_tokens, num_kv_heads, head_dim]``, cache ``[num_blocks, block_size, num_kv_heads,
slot_bytes]`` uint8, slot_mapping ``[num_tokens]`` (negative = skip).
"""
from __future__ import annotations

import torch
from einops import rearrange

from ..formats import CacheFormat
from ..norm.naive import qk_norm_rope_naive
from ..quant import lloyd_max, rotation_matrix

# ---- bit packing ----------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., d]`` integer codes -> ``[..., d * bits // 8]`` uint8. 4-bit: channel 2i in the low nibble of byte i.
    3-bit: 16-code chunks laid out so that the attention kernel's decoders get nibble words with a few masks."""
    c = codes.to(torch.int32)
    if bits == 4:
        c = rearrange(c, "... (n pair) -> ... n pair", pair=2)
        return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)
    if bits == 3:
        # A 16-code chunk n holds channels 8n .. 8n + 7 and d/2 + 8n .. d/2 + 8n + 7 (x_0 .. x_15) in 3 halfwords:
        # x_4q .. x_4q+3 in bits 0-2 of the nibbles of halfword q, and bit q of x_12 .. x_15 in bit 3 of those nibbles.
        x = rearrange(c, "... (h n k) -> ... n (h k)", h=2, k=8)
        nib = rearrange(x[..., :12], "... n (q k) -> ... n q k", k=4)
        q = torch.arange(3, dtype=torch.int32, device=c.device)[:, None]
        nib = nib | (((x[..., None, 12:] >> q) & 1) << 3)
        half = (nib << torch.arange(0, 16, 4, dtype=torch.int32, device=c.device)).sum(-1)
        out = torch.stack([half & 0xFF, half >> 8], -1)
        return rearrange(out, "... n q two -> ... (n q two)").to(torch.uint8)
    raise ValueError(f"unsupported code width {bits}")


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_codes: ``[..., d * bits // 8]`` uint8 -> ``[..., d]`` int64 codes."""
    p = packed.to(torch.int32)
    if bits == 4:
        return rearrange(torch.stack([p & 0xF, p >> 4], -1), "... n pair -> ... (n pair)").long()
    if bits == 3:
        half = rearrange(p, "... (n q two) -> ... n q two", q=3, two=2)
        half = half[..., 0] | (half[..., 1] << 8)
        nib = (half[..., None] >> torch.arange(0, 16, 4, dtype=torch.int32, device=p.device)) & 15  # [..., n, q, k]
        top = ((nib >> 3) << torch.arange(3, dtype=torch.int32, device=p.device)[:, None]).sum(-2)
        x = torch.cat([rearrange(nib & 7, "... n q k -> ... n (q k)"), top], -1)
        return rearrange(x, "... n (h k) -> ... (h n k)", h=2).long()
    raise ValueError(f"unsupported code width {bits}")


FP16_MAX = torch.finfo(torch.float16).max
# sqrt of the largest fp32: where a key's fp32 sum of squares overflows, its norm saturates here.
FP32_SQRT_MAX = float(torch.tensor(torch.finfo(torch.float32).max).sqrt())


def _half_saturate(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp16 saturated at +-65504, where a plain conversion overflows to +-inf."""
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``[...]`` -> its fp16 bits (saturated) as uint8 ``[..., 2]``."""
    return _half_saturate(x).unsqueeze(-1).contiguous().view(torch.uint8)


def _read_half(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 2]`` -> float32 ``[...]``."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def fp8_saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp to the fp8 range so large values saturate instead of becoming NaN/inf."""
    fmax = torch.finfo(dtype).max
    return x.clamp(-fmax, fmax).to(dtype)


# ---- encoders: float32 [n, H, d] -> uint8 [n, H, bytes] ----------------------------------


def encode_mse_keys(x: torch.Tensor, bits: int, norm_correction: bool) -> torch.Tensor:
    d = x.shape[-1]
    centroids, bounds = (t.to(x.device) for t in lloyd_max(bits))
    norm = x.norm(dim=-1, keepdim=True)  # inf where the fp32 sum of squares overflows, as in the kernels
    # Unit-variance coordinates: sqrt(d) * R x / ||x|| ~ N(0, 1).
    # An inf norm divides as sqrt(fp32 max): z lands in the outer buckets with its signs, not all at 0 or NaN.
    z = (x @ rotation_matrix(d, x.device)) * (d**0.5 / norm.clamp(1e-30, FP32_SQRT_MAX))
    codes = (z.unsqueeze(-1) > bounds).sum(-1)
    if norm_correction:
        # Folding 1/||c|| into the norm makes the reconstruction norm exactly ||x||.
        stored = norm / centroids[codes].norm(dim=-1, keepdim=True)
    else:
        stored = norm / d**0.5
    return torch.cat([pack_codes(codes, bits), _half_bytes(stored.squeeze(-1))], -1)


def value_scale_zero(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16-representable (scale, zero) ``[n, H, 1]`` of the values clipped to +-65504, with zero + levels*scale >=
    their max: the zero saturates at +-65504 and the span ends at 65504, so a value beyond them gets code 0 / levels
    (it is clipped) and the scale never saturates."""
    levels = (1 << bits) - 1
    zero = _half_saturate(v.amin(-1, keepdim=True)).float()
    # finite: both ends are within +-65504
    span = (v.amax(-1, keepdim=True).clamp(max=FP16_MAX) - zero).clamp_min(0)
    # Round the scale up (by more than half an fp16 ulp) so the top code still reaches max(v).
    scale = _half_saturate(span / levels * (1.0 + 2.0**-10)).float()
    return scale, zero


def encode_uniform_values(v: torch.Tensor, bits: int) -> torch.Tensor:
    levels = (1 << bits) - 1
    scale, zero = value_scale_zero(v, bits)
    q = torch.where(scale > 0, (v - zero) / scale, torch.zeros_like(v))
    codes = torch.floor(q + 0.5).clamp(0, levels)
    return torch.cat([pack_codes(codes, bits), _half_bytes(scale.squeeze(-1)), _half_bytes(zero.squeeze(-1))], -1)


def _encode_fp8(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    return fp8_saturate(x / scale, dtype).view(torch.uint8)


def encode_slots(key: torch.Tensor, value: torch.Tensor, fmt: CacheFormat, k_scale: float, v_scale: float):
    """``[n, H, d]`` key/value -> ``[n, H, slot_bytes]`` uint8."""
    if fmt.key_mode == "dense":
        return torch.cat([key.to(fmt.dense_dtype).view(torch.uint8), value.to(fmt.dense_dtype).view(torch.uint8)], -1)
    k, v = key.float(), value.float()
    if fmt.key_mode == "fp8":
        kb = _encode_fp8(k, fmt.fp8_dtype, k_scale)
    else:
        kb = encode_mse_keys(k, fmt.key_bits, fmt.norm_correction)
    if fmt.value_mode == "fp8":
        vb = _encode_fp8(v, fmt.fp8_dtype, v_scale)
    else:
        vb = encode_uniform_values(v, fmt.value_bits)
    return torch.cat([kb, vb], -1)


# ---- decoders: uint8 [n, H, slot_bytes] -> float32 [n, H, d] ------------------------------


def decode_keys_rotated(slots: torch.Tensor, fmt: CacheFormat, head_dim: int) -> torch.Tensor:
    """MSE keys in the rotated space (``R k_hat``): what attention scores against the rotated query."""
    centroids, _ = lloyd_max(fmt.key_bits)
    codes = unpack_codes(slots[..., : fmt.key_code_bytes(head_dim)], fmt.key_bits)
    off = fmt.key_norm_offset(head_dim)
    norm = _read_half(slots[..., off : off + 2])
    return centroids.to(slots.device)[codes] * norm.unsqueeze(-1)


def decode_slots(slots: torch.Tensor, fmt: CacheFormat, head_dim: int, k_scale: float, v_scale: float,
                 rotated_keys: bool = False):
    """K and V of ``slots``; with ``rotated_keys``, MSE keys stay in the rotated space (as attention scores them)."""
    kb, vo = fmt.key_bytes(head_dim), fmt.value_offset(head_dim)
    if fmt.key_mode == "dense":
        key = slots[..., :kb].contiguous().view(fmt.dense_dtype).float()
    elif fmt.key_mode == "fp8":
        key = slots[..., :kb].contiguous().view(fmt.fp8_dtype).float() * k_scale
    else:
        key = decode_keys_rotated(slots, fmt, head_dim)
        if not rotated_keys:
            key = key @ rotation_matrix(head_dim, slots.device).t()
    vslots = slots[..., vo:]
    if fmt.value_mode == "dense":
        value = vslots.contiguous().view(fmt.dense_dtype).float()
    elif fmt.value_mode == "fp8":
        value = vslots.contiguous().view(fmt.fp8_dtype).float() * v_scale
    else:
        nb = fmt.value_code_bytes(head_dim)
        codes = unpack_codes(vslots[..., :nb], fmt.value_bits).float()
        scale = _read_half(vslots[..., nb : nb + 2]).unsqueeze(-1)
        zero = _read_half(vslots[..., nb + 2 : nb + 4]).unsqueeze(-1)
        value = zero + codes * scale
    return key, value


# ---- the ops ----------------------------------------------------------------------------------


def _slots_in_cache(slot_mapping: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``[n]`` bool: the slots a store writes and a load reads. Negative and past-the-end slots are skipped, as in the
    Triton store kernel, so the raw ops never touch memory outside the cache on any device."""
    return (slot_mapping >= 0) & (slot_mapping < num_slots)


def kv_store_naive(key, value, kv_cache, slot_mapping, fmt: CacheFormat, k_scale: float, v_scale: float) -> None:
    num_kv_heads, slot_bytes = kv_cache.shape[2], kv_cache.shape[3]
    flat = kv_cache.view(-1, num_kv_heads, slot_bytes)
    keep = _slots_in_cache(slot_mapping, flat.shape[0])
    slots = slot_mapping[keep].long()
    flat[slots] = encode_slots(key[keep], value[keep], fmt, k_scale, v_scale)


def kv_load_naive(kv_cache, slot_mapping, fmt: CacheFormat, head_dim: int, k_scale: float, v_scale: float):
    num_kv_heads, slot_bytes = kv_cache.shape[2], kv_cache.shape[3]
    flat = kv_cache.view(-1, num_kv_heads, slot_bytes)
    keep = _slots_in_cache(slot_mapping, flat.shape[0]).view(-1, 1, 1)
    slots = flat[slot_mapping.long().clamp(0, max(flat.shape[0] - 1, 0))]
    key, value = decode_slots(slots, fmt, head_dim, k_scale, v_scale)
    zero = torch.zeros((), dtype=torch.float32, device=key.device)
    return torch.where(keep, key, zero), torch.where(keep, value, zero)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Views of a fused projection's keys and values, each ``[n, num_kv_heads, head_dim]``, in ``qkv`` ``[n,
    (num_heads + 2 * num_kv_heads) * head_dim]`` (queries, keys, values)."""
    start = num_heads * head_dim
    keys = qkv[:, start:start + num_kv_heads * head_dim].unflatten(-1, (num_kv_heads, head_dim))
    return keys, qkv[:, start + num_kv_heads * head_dim:].unflatten(-1, (num_kv_heads, head_dim))


def qk_norm_rope_store_naive(qkv, q_weight, k_weight, positions, inv_freq, num_heads: int, num_kv_heads: int,
                             eps: float, kv_cache, slot_mapping, fmt: CacheFormat, k_scale: float,
                             v_scale: float) -> torch.Tensor:
    """``qkv`` ``[n, (num_heads + 2 * num_kv_heads) * head_dim]`` -> the normed, rotated queries ``[n, num_heads,
    head_dim]``; its keys, normed and rotated the same way, and its values are stored at ``slot_mapping``:
    ``qk_norm_rope_naive`` and then ``kv_store_naive``."""
    q, k = qk_norm_rope_naive(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps)
    _, values = split_qkv(qkv, num_heads, num_kv_heads, 2 * inv_freq.shape[0])
    kv_store_naive(k, values, kv_cache, slot_mapping, fmt, k_scale, v_scale)
    return q.contiguous()
