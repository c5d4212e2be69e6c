"""The layer-level custom ops: store K/V (alone or with the q/k norm and RoPE) and attend, with metadata read from
the forward context by group."""
from __future__ import annotations

from typing import Optional

import torch

from .context import get_forward_context, group_metadata
from .metadata import check_context_slots, check_metadata


@torch.library.custom_op("tqops::layer_kv_store", mutates_args=("kv_cache",))
def layer_kv_store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_name: str,
    group: int,
    cache_format: str,
    k_scale: float,
    v_scale: float,
    context_rows: bool,
) -> None:
    """Store ``[num_tokens, num_kv_heads, head_dim]`` K/V at the group's slot_mapping (or context_slot_mapping)."""
    slots = _group_slots(kv_cache, layer_name, group, key.shape[0], context_rows)
    torch.ops.tqops.kv_store(key, value, kv_cache, slots, cache_format, k_scale, v_scale)


def _group_slots(kv_cache: torch.Tensor, layer_name: str, group: int, num_tokens: int,
                 context_rows: bool) -> torch.Tensor:
    """The group's checked metadata -> its slot_mapping (context_slot_mapping for DFlash context rows), which must
    have one entry per token."""
    meta = group_metadata(layer_name, group)
    where = f"layer {layer_name!r} (KV-cache group {group})"
    check_metadata(meta, kv_cache.shape[0], kv_cache.shape[1], kv_cache.device, where)
    slots = meta.context_slot_mapping if context_rows else meta.slot_mapping
    if slots is None:
        raise KeyError(f"layer {layer_name!r} stores context rows, but group {group} has no context_slot_mapping")
    if context_rows:
        positions = get_forward_context().context_positions
        if positions is None:
            # Without them no row's slot can be checked against the block table (it could be another sequence's).
            raise ValueError(f"layer {layer_name!r} stores DFlash context rows, but the forward context has no "
                             "context_positions; expected ForwardContext(..., context_positions=[num_tokens] "
                             "positions of the rows)")
        check_context_slots(meta, positions, kv_cache.shape[1], kv_cache.device, where)
    if slots.shape[0] != num_tokens:
        raise ValueError(
            f"layer {layer_name!r}: {num_tokens} tokens but group {group}'s "
            f"{'context_' if context_rows else ''}slot_mapping has {slots.shape[0]} entries"
        )
    return slots


@layer_kv_store.register_fake
def _(key, value, kv_cache, layer_name, group, cache_format, k_scale, v_scale, context_rows) -> None:
    return None


@torch.library.custom_op("tqops::layer_qk_norm_rope_store", mutates_args=("kv_cache",))
def layer_qk_norm_rope_store(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    kv_cache: torch.Tensor,
    layer_name: str,
    group: int,
    cache_format: str,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """``qk_norm_rope_store`` at the group's slot_mapping: the normed, rotated queries ``[num_tokens, num_heads,
    head_dim]`` of ``qkv``; its keys (normed, rotated) and values go into the cache."""
    slots = _group_slots(kv_cache, layer_name, group, qkv.shape[0], False)
    return torch.ops.tqops.qk_norm_rope_store(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads,
                                              eps, kv_cache, slots, cache_format, k_scale, v_scale)


@layer_qk_norm_rope_store.register_fake
def _(qkv, q_weight, k_weight, positions, inv_freq, num_heads, num_kv_heads, eps, kv_cache, layer_name, group,
      cache_format, k_scale, v_scale):
    return qkv.new_empty(qkv.shape[0], num_heads, 2 * inv_freq.shape[0])


@torch.library.custom_op("tqops::layer_attention", mutates_args=())
def layer_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_name: str,
    group: int,
    cache_format: str,
    causal: bool,
    sliding_window: Optional[int],
    sinks: Optional[torch.Tensor],
    scale: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """Paged attention of ``query`` ``[num_tokens, num_heads, head_dim]`` over the layer's cache and group metadata."""
    meta = group_metadata(layer_name, group)
    check_metadata(meta, kv_cache.shape[0], kv_cache.shape[1], kv_cache.device,
                   f"layer {layer_name!r} (KV-cache group {group})")
    if query.shape[0] != meta.slot_mapping.shape[0]:
        raise ValueError(
            f"layer {layer_name!r}: {query.shape[0]} query tokens but group {group}'s metadata packs "
            f"{meta.slot_mapping.shape[0]}"
        )
    return torch.ops.tqops.paged_attention(
        query, kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc, cache_format, causal,
        sliding_window, None if sinks is None else sinks.float(), scale, k_scale, v_scale,
    )


@layer_attention.register_fake
def _(query, kv_cache, layer_name, group, cache_format, causal, sliding_window, sinks, scale, k_scale, v_scale):
    return torch.empty_like(query, memory_format=torch.contiguous_format)
