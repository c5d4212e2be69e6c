"""The kv_store / kv_load custom ops: registration, fake impls, validation and device dispatch."""
from __future__ import annotations

from typing import Union

import torch

from ..checks import (FLOAT_DTYPES, INDEX_DTYPES, check_cache, check_has_data, check_same_size, check_scale,
                      check_slot_values, check_tensor)
from ..formats import CacheFormat, get_format
from ..norm.ops import check_qk_norm_rope_args
from .naive import kv_load_naive, kv_store_naive, qk_norm_rope_store_naive, split_qkv


@torch.library.custom_op("tqops::kv_store", mutates_args=("kv_cache",))
def _kv_store_op(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_format: str,
    k_scale: float,
    v_scale: float,
) -> None:
    fmt = get_format(cache_format)
    check_store_args(key, value, kv_cache, slot_mapping, fmt, k_scale, v_scale)
    if key.shape[0] == 0:
        return
    if kv_cache.is_cuda:
        from .triton_store import kv_store_triton

        kv_store_triton(key, value, kv_cache, slot_mapping, fmt, k_scale, v_scale)
    else:
        kv_store_naive(key, value, kv_cache, slot_mapping, fmt, k_scale, v_scale)


@_kv_store_op.register_fake
def _(key, value, kv_cache, slot_mapping, cache_format, k_scale, v_scale) -> None:
    check_store_args(key, value, kv_cache, slot_mapping, get_format(cache_format), k_scale, v_scale)
    return None


def check_qk_norm_rope_store_args(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps,
                                  kv_cache, slot_mapping, fmt: CacheFormat, k_scale, v_scale) -> None:
    """qk_norm_rope's checks, then the store's on qkv's key and value views (no tensor values)."""
    check_qk_norm_rope_args(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps)
    check_cache(kv_cache, fmt, 2 * inv_freq.shape[0])
    check_tensor("qkv", qkv, device=kv_cache.device)
    keys, values = split_qkv(qkv, num_heads, num_kv_heads, 2 * inv_freq.shape[0])
    check_store_args(keys, values, kv_cache, slot_mapping, fmt, k_scale, v_scale)


@torch.library.custom_op("tqops::qk_norm_rope_store", mutates_args=("kv_cache",))
def _qk_norm_rope_store_op(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_format: str,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    fmt = get_format(cache_format)
    args = (qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps)
    check_qk_norm_rope_store_args(*args, kv_cache, slot_mapping, fmt, k_scale, v_scale)
    if kv_cache.is_cuda and qkv.shape[0]:
        from .triton_store import qk_norm_rope_store_triton

        return qk_norm_rope_store_triton(*args, kv_cache, slot_mapping, fmt, k_scale, v_scale)
    return qk_norm_rope_store_naive(*args, kv_cache, slot_mapping, fmt, k_scale, v_scale)


@_qk_norm_rope_store_op.register_fake
def _(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps, kv_cache, slot_mapping,
      cache_format, k_scale, v_scale):
    check_qk_norm_rope_store_args(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps,
                                  kv_cache, slot_mapping, get_format(cache_format), k_scale, v_scale)
    return qkv.new_empty(qkv.shape[0], num_heads, 2 * inv_freq.shape[0])


@torch.library.custom_op("tqops::kv_load", mutates_args=())
def _kv_load_op(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_format: str,
    head_dim: int,
    k_scale: float,
    v_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_load_args(kv_cache, slot_mapping, get_format(cache_format), head_dim, k_scale, v_scale)
    # A readback for tests and dense paths: the vectorized torch decoder runs on every device.
    return kv_load_naive(kv_cache, slot_mapping, get_format(cache_format), head_dim, k_scale, v_scale)


@_kv_load_op.register_fake
def _(kv_cache, slot_mapping, cache_format, head_dim, k_scale, v_scale):
    check_load_args(kv_cache, slot_mapping, get_format(cache_format), head_dim, k_scale, v_scale)
    shape = (slot_mapping.shape[0], kv_cache.shape[2], head_dim)
    return kv_cache.new_empty(shape, dtype=torch.float32), kv_cache.new_empty(shape, dtype=torch.float32)


def check_store_args(key, value, kv_cache, slot_mapping, fmt: CacheFormat, k_scale, v_scale) -> None:
    """Shapes, dtypes, devices and scales of a store: no tensor values, so the op and its fake impl run it too."""
    check_tensor("key", key, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("value", value, dtypes=FLOAT_DTYPES, ndim=3)
    num_tokens, num_kv_heads, head_dim = key.shape
    value_shape = f"value has shape {tuple(value.shape)}; expected the key's shape {tuple(key.shape)}"
    if value.shape[1:] != key.shape[1:]:
        raise ValueError(value_shape)
    check_same_size(value.shape[0] == num_tokens, value_shape)
    check_cache(kv_cache, fmt, head_dim)
    check_tensor("key", key, device=kv_cache.device)
    check_tensor("value", value, device=kv_cache.device)
    if kv_cache.shape[2] != num_kv_heads:
        raise ValueError(f"key has {num_kv_heads} kv heads; the cache was allocated for {kv_cache.shape[2]}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in head_dim (stride(-1) == 1)")
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, ndim=1, device=kv_cache.device)
    check_same_size(slot_mapping.shape[0] == num_tokens,
                    f"slot_mapping has {slot_mapping.shape[0]} entries; expected one per token ({num_tokens})")
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)


def check_load_args(kv_cache, slot_mapping, fmt: CacheFormat, head_dim, k_scale, v_scale) -> None:
    """Shapes, dtypes, devices and scales of a load (no tensor values)."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__}")
    check_cache(kv_cache, fmt, head_dim)
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, ndim=1, device=kv_cache.device)
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)


def kv_store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: Union[str, CacheFormat],
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Quantize ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``kv_cache`` in place.

    ``slot_mapping[i]`` (``[num_tokens]``, int32/int64) is ``block * block_size + offset``; negative skips token i.
    Slots must be distinct, below ``num_blocks * block_size`` and fit int32 (checked here in eager mode, as is that no
    tensor is on the meta device; the raw op skips out-of-range slots without writing them, on every device).
    """
    fmt = get_format(fmt)
    check_store_args(key, value, kv_cache, slot_mapping, fmt, k_scale, v_scale)
    for name, t in (("key", key), ("value", value), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        check_has_data(name, t)
    k_scale, v_scale = float(k_scale), float(v_scale)
    check_slot_values("slot_mapping", slot_mapping, kv_cache.shape[0] * kv_cache.shape[1])
    torch.ops.tqops.kv_store(key, value, kv_cache, slot_mapping, fmt.name, k_scale, v_scale)


def kv_load(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: Union[str, CacheFormat],
    head_dim: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized float32 K and V ``[num_tokens, num_kv_heads, head_dim]`` of the given slots (zeros where slot < 0;
    the raw op also returns zeros for slots past the cache)."""
    fmt = get_format(fmt)
    check_load_args(kv_cache, slot_mapping, fmt, head_dim, k_scale, v_scale)
    check_has_data("kv_cache", kv_cache)
    check_has_data("slot_mapping", slot_mapping)
    k_scale, v_scale = float(k_scale), float(v_scale)
    check_slot_values("slot_mapping", slot_mapping, kv_cache.shape[0] * kv_cache.shape[1], distinct=False)
    return torch.ops.tqops.kv_load(kv_cache, slot_mapping, fmt.name, head_dim, k_scale, v_scale)


def qk_norm_rope_store(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: Union[str, CacheFormat],
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """``tqops.norm.qk_norm_rope`` and ``kv_store`` of its keys and ``qkv``'s values in one op: ``qkv`` ``[num_tokens,
    (num_heads + 2 * num_kv_heads) * head_dim]`` (a fused projection's output) -> the normed, rotated queries
    ``[num_tokens, num_heads, head_dim]``; the keys, normed and rotated, and the values go into ``kv_cache`` at
    ``slot_mapping`` as ``kv_store`` puts them. On CUDA one kernel launch for two or more tokens (for the MSE
    formats up to 2,048; one token and longer MSE blocks run qk_norm_rope's kernel, then the store kernel)."""
    fmt = get_format(fmt)
    args = (qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, float(eps))
    check_qk_norm_rope_store_args(*args, kv_cache, slot_mapping, fmt, k_scale, v_scale)
    for name, t in (("qkv", qkv), ("q_weight", q_weight), ("k_weight", k_weight), ("positions", positions),
                    ("inv_freq", inv_freq), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        check_has_data(name, t)
    check_slot_values("slot_mapping", slot_mapping, kv_cache.shape[0] * kv_cache.shape[1])
    return torch.ops.tqops.qk_norm_rope_store(*args, kv_cache, slot_mapping, fmt.name, float(k_scale),
                                              float(v_scale))
