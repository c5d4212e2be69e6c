"""The sm_90 verify kernel for turboquant_4bit_nc caches: 5-16 query tokens per sequence on warpgroup MMAs
(cuda/turboquant_verify.cu), built with NVRTC and launched as the plan's ``cuda_launch.VerifyLaunch`` says."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch

from ..formats import CacheFormat, get_format
from . import constants as dc
from . import cuda_paged
from .cuda_launch import VERIFY_FORMAT, VERIFY_SMEM_BYTES, VERIFY_STAGE_ROW, VERIFY_THREADS, enabled
from .cuda_launch import VERIFY_MIN_TABLE_KEYS as MIN_TABLE_KEYS  # noqa: F401  (tools/sanitize_kernels.py reads it)
from .cuda_paged import ByValue, build_kernel, launch_split_kv
from .plan import CallShape, accepts, cuda_indices, device_props, plan_attention

_SOURCE = Path(__file__).with_name("cuda") / "turboquant_verify.cu"


def applies(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, fmt: CacheFormat,
            sliding_window: Optional[int]) -> bool:
    """Whether the kernel's rules take this call (``plan.accepts``)."""
    return query.is_cuda and accepts("cuda_verify", CallShape.of(query, kv_cache, block_table), fmt, sliding_window,
                                     device_props(query.device))


@functools.lru_cache(maxsize=None)
def _kernel(q_bf16: bool, device_index: int):
    """turboquant_verify<q_bf16> built for ``device_index`` (NVRTC for sm_90a, about a second)."""
    return build_kernel(_SOURCE, f"turboquant_verify<{'true' if q_bf16 else 'false'}>", VERIFY_SMEM_BYTES,
                        device_index, compute_capability="90a")


def tensor_map(kv_cache: torch.Tensor) -> ByValue:
    """The TMA tensor map the kernel stages ``kv_cache`` through (``cuda_paged.tensor_map``): boxes of
    ``VERIFY_STAGE_ROW`` bytes x min(block size, 64) slots."""
    return cuda_paged.tensor_map(kv_cache, VERIFY_STAGE_ROW, min(kv_cache.shape[1], 64))


def device_constants(fmt: CacheFormat, head_dim: int, device: torch.device) -> None:
    """Build the kernels before any launch, so none is first built inside a captured step."""
    if fmt == VERIFY_FORMAT and head_dim == 128 and enabled() and hasattr(torch.cuda, "_compile_kernel") \
            and torch.cuda.get_device_capability(device) == (9, 0):

        dc.rotation_signs(head_dim, device)
        dc.centroid_pairs(4, device)
        for q_bf16 in (True, False):
            _kernel(q_bf16, device.index)


def clear_device_constants() -> None:
    _kernel.cache_clear()  # the tensor maps are cuda_paged's


def run(plan, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor, sinks: Optional[torch.Tensor], scale: float, k_scale: float,
        v_scale: float) -> torch.Tensor:
    """Launch the kernel as ``plan`` (a cuda_verify ``AttentionPlan``) says; same contract as
    ``paged_attention_naive`` (the format's keys and values carry their own scales)."""
    if plan.shape.empty:
        return torch.zeros_like(query, memory_format=torch.contiguous_format)
    launch, head_dim = plan.launch, plan.shape.head_dim
    block_table, seq_lens, query_start_loc = cuda_indices(plan, query, kv_cache, block_table, seq_lens,
                                                          query_start_loc)
    # 16-byte query loads: whole contiguous rows
    if query.stride(2) != 1 or query.stride(1) % 8 or query.stride(0) % 8 or query.data_ptr() % 16:
        query = query.contiguous()
    signs, pairs = dc.rotation_signs(head_dim, query.device), dc.centroid_pairs(4, query.device)
    return launch_split_kv(_kernel(launch.q_bf16, launch.device_index), launch.grid, VERIFY_THREADS,
                           VERIFY_SMEM_BYTES, query, kv_cache, block_table, seq_lens, query_start_loc, signs, pairs,
                           scale * dc.LOG2E, launch.block_q, launch.splits, plan.causal, sinks,
                           (tensor_map(kv_cache),))


def paged_attention_verify(query, kv_cache, block_table, seq_lens, query_start_loc, fmt, causal: bool,
                           sinks: Optional[torch.Tensor], scale: float, *,
                           num_splits: Optional[int] = None) -> torch.Tensor:
    """Same contract as ``paged_attention_naive`` for the calls ``cuda_launch.verify_eligible`` accepts (the
    query-length and cache-size rules aside, which only choose the faster kernel), through a cuda_verify plan;
    ``num_splits`` (a power of two) overrides the launch's."""
    plan = plan_attention(query, kv_cache, block_table, get_format(fmt), causal, None, sinks, backend="cuda_verify",
                          overrides={} if num_splits is None else dict(num_splits=num_splits))
    return run(plan, query, kv_cache, block_table, seq_lens, query_start_loc, sinks, scale, 1.0, 1.0)
