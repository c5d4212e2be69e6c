"""Triton split-KV paged attention over every cache format, with query tokens x GQA group as the M tile."""
from __future__ import annotations

from typing import Optional

import torch

from ..formats import CacheFormat
from ..kv.codecs import KEY_MODES, VALUE_MODES
from ..quant import rotation_matrix
from ..pdl import pdl_launch_args
from . import constants as dc
from .combine import combine_splits
from .kernel import CacheLayout, Operands, Side, Switches, Tile, Visibility, _paged_attention_kernel
from .launch import launch_config  # noqa: F401  (tools and the benchmarks import it from here)
from .plan import AttentionPlan, int32_indices, plan_attention


def device_constants(fmt: CacheFormat, head_dim: int, device: torch.device) -> None:
    """Make (and cache) every device tensor a launch over a ``fmt`` cache on ``device`` reads, with the arguments
    the launch passes, so none is first made inside a captured step (see tqops.device_constants)."""
    dc.sm_count(device.index)
    dc.centroids(fmt.key_bits if fmt.key_mode == "mse" else 4, torch.float16, device)
    if fmt.key_mode == "mse":
        dc.rotation_signs(head_dim, device)
        rotation_matrix(head_dim, device)  # head_dim > 128 and fp32 queries rotate on the host
        if fmt.key_bits == 4:
            dc.centroid_pairs(4, device)


def clear_device_constants() -> None:
    dc.clear()


def run(plan, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor, sinks: Optional[torch.Tensor], scale: float, k_scale: float,
        v_scale: float) -> torch.Tensor:
    """Launch the split-KV kernel (plus the split combiner) as ``plan`` (a Triton ``AttentionPlan``) says; same
    contract as ``paged_attention_naive``."""
    if plan.shape.empty:
        return torch.zeros_like(query, memory_format=torch.contiguous_format)
    launch, fmt, s = plan.launch, plan.fmt, plan.shape
    block_table, seq_lens, query_start_loc = int32_indices(block_table, seq_lens, query_start_loc)
    made = torch.empty_like if launch.writes_every_row else torch.zeros_like
    out = made(query, memory_format=torch.contiguous_format)
    q, tables = _operands(plan, query, kv_cache, sinks)
    splits = launch.num_splits
    if splits == 1:
        target, ml, stride_os = out, tables[1], 0
    else:
        target = torch.empty((splits, s.num_tokens, s.num_q_heads, s.head_dim), dtype=torch.float32,
                             device=query.device)
        ml = torch.empty((splits, s.num_tokens, s.num_q_heads, 2), dtype=torch.float32, device=query.device)
        stride_os = target.stride(0)
    qk_scale = scale * dc.LOG2E * (k_scale if fmt.key_mode == "fp8" else 1.0)
    _paged_attention_kernel[(launch.num_tiles, s.num_kv_heads, splits)](
        q, q.stride(0), q.stride(1), kv_cache, kv_cache.view(fmt.dense_dtype or torch.float16),
        block_table, block_table.stride(0), seq_lens, query_start_loc, *tables,
        target, stride_os, s.num_q_heads * s.head_dim, s.head_dim, ml,
        qk_scale, v_scale, plan.sliding_window or 0, s.batch, s.num_tokens, s.num_blocks, s.max_blocks,
        **_constants(plan), num_warps=launch.num_warps, num_stages=launch.num_stages,
        **pdl_launch_args(query.device, s.num_tokens == 1),
        **({} if launch.maxnreg is None else dict(maxnreg=launch.maxnreg)),
    )
    if splits > 1:
        combine_splits(target, ml, sinks, query_start_loc, out, s.batch)
    return out


def _operands(plan, query: torch.Tensor, kv_cache: torch.Tensor,
              sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, tuple]:
    """The query the kernel reads (rotated on the host where the plan says so) and its table arguments: sinks,
    centroids, centroid pairs, rotation signs (a placeholder where the kernel reads none)."""
    launch, fmt, head_dim, device = plan.launch, plan.fmt, plan.shape.head_dim, query.device
    q = query.float() @ rotation_matrix(head_dim, device) if launch.host_rotation else query
    cent = dc.centroids(fmt.key_bits if fmt.key_mode == "mse" else 4,
                        torch.float32 if launch.interpreted else torch.float16, device)
    pairs = dc.centroid_pairs(4, device) if fmt.key_mode == "mse" and fmt.key_bits == 4 else cent
    signs = dc.rotation_signs(head_dim, device) if launch.rotate_in_kernel else cent
    return q, (sinks if sinks is not None else cent, cent, pairs, signs)  # sinks are never read without HAS_SINKS


def _constants(plan) -> dict:
    """The kernel's compile-time arguments for ``plan``."""
    launch, fmt, s = plan.launch, plan.fmt, plan.shape
    key_mode, value_mode = KEY_MODES[fmt.key_mode], VALUE_MODES[fmt.value_mode]
    return dict(
        LAYOUT=CacheLayout(*s.cache_strides, s.block_size, s.head_dim, s.head_dim.bit_length() - 1),
        KEYS=Side(key_mode, fmt.key_bits, 0, fmt.key_norm_offset(s.head_dim)),
        VALUES=Side(value_mode, fmt.value_bits, fmt.value_offset(s.head_dim), fmt.value_scale_offset(s.head_dim)),
        TILE=Tile(launch.block_q, launch.block_m, launch.block_n, s.group, launch.group_pad, launch.num_splits),
        SEES=Visibility(plan.causal, plan.sliding_window is not None, plan.has_sinks),
        OPERANDS=Operands(launch.fp8, launch.qk_dtype, launch.pv_dtype, launch.rotate_in_kernel, launch.split_query),
        SWITCHES=Switches(launch.key_pairs, launch.pair_asm, launch.value_halves, launch.keys_as_m, launch.prefetch,
                          launch.ids_ahead, launch.prefetch_l2, launch.row_loads),
    )


def paged_attention_triton(
    query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor, fmt: CacheFormat, causal: bool, sliding_window: Optional[int],
    sinks: Optional[torch.Tensor], scale: float, k_scale: float, v_scale: float, *,
    num_splits: Optional[int] = None, block_n: Optional[int] = None, block_q: Optional[int] = None,
    num_warps: Optional[int] = None, num_stages: Optional[int] = None, key_pairs: Optional[bool] = None,
    prefetch: Optional[bool] = None, rotate_query_in_kernel: Optional[bool] = None,
    split_query: Optional[bool] = None, value_halves: Optional[bool] = None, pair_asm: Optional[bool] = None,
    maxnreg: Optional[int] = None, keys_as_m: Optional[bool] = None, ids_ahead: Optional[bool] = None,
    prefetch_l2: Optional[bool] = None, row_loads: Optional[bool] = None, plan: Optional[AttentionPlan] = None,
) -> torch.Tensor:
    """Launch the split-KV kernel (plus the split combiner); same contract as ``paged_attention_naive``.

    Also runs on CPU tensors under ``TRITON_INTERPRET=1``. The keyword overrides (``launch.triton_launch``'s) are for
    tests and tuning; ``plan``, a Triton plan of these tensors made before, replaces them.
    """
    overrides = dict(num_splits=num_splits, block_n=block_n, block_q=block_q, num_warps=num_warps,
                     num_stages=num_stages, key_pairs=key_pairs, prefetch=prefetch,
                     rotate_query_in_kernel=rotate_query_in_kernel, split_query=split_query,
                     value_halves=value_halves, pair_asm=pair_asm, maxnreg=maxnreg, keys_as_m=keys_as_m,
                     ids_ahead=ids_ahead, prefetch_l2=prefetch_l2, row_loads=row_loads)
    given = {key: val for key, val in overrides.items() if val is not None}
    if plan is None:
        plan = plan_attention(query, kv_cache, block_table, fmt, causal, sliding_window, sinks, backend="triton",
                              overrides=given)
    elif plan.backend != "triton" or given:
        raise ValueError(f"plan: expected a Triton plan and no launch overrides; got a {plan.backend} plan and "
                         f"overrides {sorted(given)}")
    else:
        plan.check(query, kv_cache, block_table, sinks)
    return run(plan, query, kv_cache, block_table, seq_lens, query_start_loc, sinks, scale, k_scale, v_scale)
