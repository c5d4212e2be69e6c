"""Attention without a PagedKVCache: each call stores the keys it is given in a transient paged cache, then attends."""
from __future__ import annotations

from typing import Optional

import torch

from ..device_constants import allocate_kv_cache
from ..formats import get_format

# The model config attribute naming the format of a forward without a PagedKVCache (from_pretrained passes unknown
# keyword arguments to the config: from_pretrained(..., attn_implementation="tqops", tqops_cache_format="fp8_e4m3")).
FORMAT_ATTRIBUTE = "tqops_cache_format"
BLOCK_SIZE = 16


def transient_format(module: torch.nn.Module, query: torch.Tensor) -> str:
    """``module.config.tqops_cache_format`` where set (a ValueError names an unknown one), else the 16-bit format of
    the query's dtype (bf16 for bf16 and fp32 models, fp16 for fp16 ones)."""
    name = getattr(getattr(module, "config", None), FORMAT_ATTRIBUTE, None)
    if name is None:
        return "fp16" if query.dtype == torch.float16 else "bf16"
    try:
        return get_format(name).name
    except (KeyError, ValueError) as err:
        raise ValueError(f"config.{FORMAT_ATTRIBUTE}={name!r}: {err}") from None


def transient_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
                        fmt: str, causal: bool, sliding_window: Optional[int], sinks: Optional[torch.Tensor],
                        scale: float) -> torch.Tensor:
    """Paged attention of ``query`` ``[batch, heads, q_len, d]`` over every key of its rows, ``key`` / ``value``
    ``[batch, kv_heads, kv_len, d]`` (a forward without a cache, or a transformers cache's whole K/V), stored first in
    a cache of format ``fmt`` that lives for this call -> ``[batch, q_len, heads, d]``.

    ``mask`` ``[batch, >= kv_len]`` bool marks real tokens (None: all). Each row's real keys are packed to positions
    0 .. r - 1 and its real queries (the real columns among the last ``q_len``) are its last real keys, so left and
    right padding both line up; padding queries come out 0. No host sync: it compiles and captures."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    device = query.device
    real = (torch.ones(batch, kv_len, dtype=torch.bool, device=device) if mask is None
            else mask[:, -kv_len:].to(device=device, dtype=torch.bool))
    blocks = max(1, -(-kv_len // BLOCK_SIZE))  # per row
    cache = allocate_kv_cache(fmt, batch * blocks, BLOCK_SIZE, kv_heads, head_dim, device=device)
    block_table = torch.arange(batch * blocks, dtype=torch.int32, device=device).view(batch, blocks)
    rows = torch.arange(batch, device=device)[:, None]
    slots = torch.where(real, rows * blocks * BLOCK_SIZE + real.cumsum(1) - 1, -1)
    packed = [t.transpose(1, 2).reshape(batch * kv_len, kv_heads, head_dim) for t in (key, value)]
    torch.ops.tqops.kv_store(*packed, cache, slots.flatten(), fmt, 1.0, 1.0)
    # Padding queries first, then the real ones in order: query i of a row then sits at seq_len - q_len + i, which is
    # its packed position for the real ones (the padding ones see some keys, and are zeroed below).
    is_query = real[:, -q_len:]
    order = torch.argsort(is_query.to(torch.int8), dim=1, stable=True)  # [batch, q_len]
    q = query.transpose(1, 2).gather(1, order[:, :, None, None].expand(-1, -1, heads, head_dim))
    seq_lens = real.sum(1, dtype=torch.int32)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
    out = torch.ops.tqops.paged_attention(q.reshape(batch * q_len, heads, head_dim), cache, block_table, seq_lens,
                                          query_start_loc, fmt, causal, sliding_window, sinks, scale, 1.0, 1.0)
    out = torch.empty_like(q).scatter_(1, order[:, :, None, None].expand(-1, -1, heads, head_dim),
                                       out.view(batch, q_len, heads, head_dim))
    return torch.where(is_query[:, :, None, None], out, 0)
