"""The paged_attention custom op: registration, fake impl, validation and device dispatch."""
from __future__ import annotations

import logging
from typing import Optional, Union

import torch

from ..checks import (FLOAT_DTYPES, INDEX_DTYPES, check_cache, check_has_data, check_int32_values, check_same_size,
                      check_scale, check_tensor, in_graph_region)
from ..formats import CacheFormat, get_format
from .naive import paged_attention_naive
from .plan import AttentionPlan, plan_attention

logger = logging.getLogger(__name__)

# The kernels specialize on these; TurboQuant's rotation needs a power of two anyway.
ATTENTION_HEAD_DIMS = (64, 128, 256)


@torch.library.custom_op("tqops::paged_attention", mutates_args=())
def _paged_attention_op(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_format: str,
    causal: bool,
    sliding_window: Optional[int],
    sinks: Optional[torch.Tensor],
    scale: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    fmt = get_format(cache_format)
    check_attention_args(query, kv_cache, block_table, seq_lens, query_start_loc, fmt, causal, sliding_window, sinks,
                         scale, k_scale, v_scale)
    plan = plan_attention(query, kv_cache, block_table, fmt, causal, sliding_window, sinks)
    logger.debug("paged_attention: %s for %s x %s tokens", plan.backend, fmt.name, plan.shape.num_tokens)
    return _run(plan, query, kv_cache, block_table, seq_lens, query_start_loc, sinks, scale, k_scale, v_scale)


@_paged_attention_op.register_fake
def _(query, kv_cache, block_table, seq_lens, query_start_loc, cache_format, causal, sliding_window, sinks,
      scale, k_scale, v_scale):
    check_attention_args(query, kv_cache, block_table, seq_lens, query_start_loc, get_format(cache_format), causal,
                         sliding_window, sinks, scale, k_scale, v_scale)
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def check_attention_args(query, kv_cache, block_table, seq_lens, query_start_loc, fmt: CacheFormat, causal,
                         sliding_window, sinks, scale, k_scale, v_scale) -> None:
    """Shapes, dtypes, devices and scalars (no tensor values), so the op and its fake impl run it too."""
    check_tensor("query", query, dtypes=FLOAT_DTYPES, ndim=3)
    num_tokens, num_q_heads, head_dim = query.shape
    head_dim = int(head_dim)  # a kernel constant: specialize on it under compile's dynamic shapes
    if head_dim not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"query has head_dim={head_dim}; paged_attention supports {ATTENTION_HEAD_DIMS}")
    check_cache(kv_cache, fmt, head_dim)
    device = kv_cache.device
    check_tensor("query", query, device=device)
    num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"query has {num_q_heads} heads, not a multiple of the cache's {num_kv_heads} kv heads (GQA/MQA)"
        )
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"cache block_size={block_size} must be a power of two >= 16")
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2, device=device)
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1, device=device)
    check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, ndim=1, device=device)
    batch = seq_lens.shape[0]
    check_same_size(block_table.shape[0] == batch,
                    f"block_table has {block_table.shape[0]} rows; expected one per sequence ({batch})")
    check_same_size(block_table.shape[1] >= 1, "block_table must have at least one column (max_blocks >= 1)")
    check_same_size(query_start_loc.shape[0] == batch + 1,
                    f"query_start_loc has {query_start_loc.shape[0]} entries; expected batch + 1 = {batch + 1}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
            raise TypeError(f"sliding_window must be an int or None, got {type(sliding_window).__name__}")
        if sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=(torch.float32,), ndim=1, device=device)
        if sinks.shape[0] != num_q_heads:
            raise ValueError(f"sinks has {sinks.shape[0]} entries; expected one per query head ({num_q_heads})")
    if scale is not None:
        check_scale("scale", scale)
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)


def check_attention_values(block_table, seq_lens, query_start_loc, num_tokens: int, num_blocks: int,
                           block_size: int, *, padded: bool = False) -> None:
    """Eager-only checks that read tensor values (each one syncs the host). ``padded`` (the layer path): tokens past
    ``query_start_loc[-1]`` and sequences of seq_len 0 are padding; otherwise the sequences cover every token."""
    if in_graph_region():
        return
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc), ("block_table", block_table)):
        check_int32_values(name, t)
    max_blocks = block_table.shape[1]
    lens = seq_lens.long()
    if seq_lens.numel():
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 0 or hi > max_blocks * block_size:
            b = int(((lens < 0) | (lens > max_blocks * block_size)).nonzero()[0, 0])
            raise ValueError(
                f"seq_lens[{b}] = {int(lens[b])}; expected values in [0, max_blocks * block_size] = "
                f"[0, {max_blocks * block_size}] (the block table has {max_blocks} blocks of {block_size} per sequence)"
            )
    starts = query_start_loc.long()
    last_ok = int(starts[-1]) <= num_tokens if padded else int(starts[-1]) == num_tokens
    if int(starts[0]) != 0 or not last_ok:
        end = f"at most num_tokens={num_tokens}" if padded else f"at num_tokens={num_tokens}"
        raise ValueError(
            f"query_start_loc must start at 0 and end {end}; got first {int(starts[0])}, last {int(starts[-1])}"
        )
    q_lens = starts[1:] - starts[:-1]
    if bool((q_lens < 0).any()):
        raise ValueError("query_start_loc must be non-decreasing")
    # With padding, a sequence of seq_len 0 is a padding sequence (a CUDA-graph bucket's): it sees no key.
    too_many = (q_lens > lens) & (lens > 0) if padded else q_lens > lens
    if bool(too_many.any()):
        b = int(too_many.nonzero()[0, 0])
        raise ValueError(
            f"sequence {b} has q_len={int(q_lens[b])} queries but seq_lens[{b}]={int(lens[b])}; "
            "seq_lens must count this step's tokens too (q_len <= seq_len)"
        )
    # Only the entries that cover a sequence's keys are read; the rest may hold anything (padding).
    used = torch.arange(max_blocks, device=block_table.device)[None, :] < (lens[:, None] + block_size - 1) // block_size
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise IndexError(
            f"block_table[{b}, {i}] = {int(block_table[b, i])} is out of range; expected a block index in "
            f"[0, {num_blocks}) for every block below seq_lens"
        )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    fmt: Union[str, CacheFormat],
    *,
    causal: bool = True,
    sliding_window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of packed queries over a paged, possibly quantized KV cache.

    query ``[num_tokens, num_q_heads, head_dim]`` (bf16/fp16/fp32), sequences back to back;
    kv_cache ``[num_blocks, block_size, num_kv_heads, slot_bytes]`` uint8 in format ``fmt``;
    block_table ``[batch, max_blocks]``; seq_lens ``[batch]`` (every key of the sequence, this step's tokens
    included); query_start_loc ``[batch + 1]``; index tensors int32 or int64.
    Query i of a sequence with q_len queries sits at position ``seq_len - q_len + i``. ``causal``: key j is
    visible iff j <= pos; otherwise every j < seq_len. ``sliding_window=W`` also needs pos - j < W (and
    j - pos < W when not causal). ``sinks`` ``[num_q_heads]`` float32 logits join the softmax denominator.
    Returns ``[num_tokens, num_q_heads, head_dim]`` in query's dtype. A NaN in a query, or in a key or value that a
    row attends to, makes that row NaN. Values are checked here in eager mode (every index value must fit int32; no
    tensor may be on the meta device); the raw op drops keys whose block entry lies outside ``[0, num_blocks)`` or
    past ``max_blocks`` (never reading them) and writes no row outside ``[0, num_tokens)``; rows no sequence covers
    are 0. An int64 index past int32 is out of range there too (``plan.int32_indices``).
    """
    fmt = get_format(fmt)
    check_attention_args(query, kv_cache, block_table, seq_lens, query_start_loc, fmt, causal, sliding_window, sinks,
                         scale, k_scale, v_scale)
    for name, t in (("query", query), ("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc), ("sinks", sinks)):
        check_has_data(name, t)
    scale = query.shape[2] ** -0.5 if scale is None else float(scale)
    k_scale, v_scale = float(k_scale), float(v_scale)
    num_blocks, block_size = kv_cache.shape[:2]
    check_attention_values(block_table, seq_lens, query_start_loc, query.shape[0], num_blocks, block_size)
    return torch.ops.tqops.paged_attention(
        query, kv_cache, block_table, seq_lens, query_start_loc, fmt.name,
        causal, sliding_window, sinks, scale, k_scale, v_scale,
    )


def run_attention(plan: AttentionPlan, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, sinks: Optional[torch.Tensor], scale: float,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """The raw op's work for a plan made before (``plan.plan_attention``, once for calls of one shape): the plan's
    backend over these tensors, which must be those it was made for (checked: shapes, strides, sinks). No argument
    or value checks beyond that; the op's rules for out-of-range indices hold."""
    plan.check(query, kv_cache, block_table, sinks)
    return _run(plan, query, kv_cache, block_table, seq_lens, query_start_loc, sinks, float(scale), float(k_scale),
                float(v_scale))


def _run(plan: AttentionPlan, query, kv_cache, block_table, seq_lens, query_start_loc, sinks, scale, k_scale,
         v_scale) -> torch.Tensor:
    if plan.backend == "reference":
        return paged_attention_naive(query, kv_cache, block_table, seq_lens, query_start_loc, plan.fmt, plan.causal,
                                     plan.sliding_window, sinks, scale, k_scale, v_scale)
    from . import cuda_paged, cuda_verify, triton_paged

    backend = {"cuda_verify": cuda_verify, "cuda_paged": cuda_paged, "triton": triton_paged}[plan.backend]
    return backend.run(plan, query, kv_cache, block_table, seq_lens, query_start_loc, sinks, scale, k_scale, v_scale)
