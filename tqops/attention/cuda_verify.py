"""The sm_90 verify kernel for turboquant_4bit_nc caches: 5-16 query tokens per sequence on warpgroup MMAs
(cuda/turboquant_verify.cu), built with NVRTC."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch

from ..formats import CacheFormat
from . import constants as dc
from . import cuda_paged
from .cuda_paged import ByValue, build_kernel, enabled, launch_split_kv
from .launch import query_tiles, wave_splits

_SOURCE = Path(__file__).with_name("cuda") / "turboquant_verify.cu"
FORMAT = "turboquant_4bit_nc"
ROWS = 64  # query rows (tokens x GQA group) per program: the N of the kernel's MMAs
THREADS = 128  # one warpgroup
PROGRAMS_PER_SM = 2
# Keys over the block table below which the Triton kernel runs: each program's query prologue costs about as much as
# a few dozen key tiles, and one 8K sequence measured slower (docs/tuning.md).
MIN_TABLE_KEYS = 32768
STAGE_ROW = 176  # bytes of a row's TMA box (the kernel's STAGE_ROW): the row and the 15 bytes before it at most
# Dynamic shared memory (the kernel's Smem::TOTAL): the replicated centroid-pair table, Q^T, P'^T, row maxima, four
# 64-key stages of STAGE_ROW-byte rows, their mbarriers and block flags; two programs fit an SM.
SMEM_BYTES = 32768 + 16384 + 8192 + 1024 + 4 * 64 * STAGE_ROW + 4 * 8 + 4 * 64
# Blocks of fewer slots make segments whose boxes do not land on 128-byte boundaries of shared memory.
MIN_BLOCK_SIZE = 8


def eligible(fmt_name: str, head_dim: int, query_dtype: torch.dtype, group: int, sliding_window: Optional[int],
             cache_ptr: int, block_stride: int, slot_stride: int, capability: tuple, avg_q_len: int,
             table_keys: int, block_size: int) -> bool:
    """Whether the kernel takes a call: a turboquant_4bit_nc cache at head_dim 128, 16-bit queries, no sliding
    window, query rows (tokens x GQA group) of a sequence that fill one program's ``ROWS`` (16 tokens at Qwen3's group
    of 4: a DFlash verify; with fewer rows, or more tiles per sequence, the Triton kernel measured as fast or faster),
    a 16-byte aligned cache whose block and slot strides are multiples of 16 and blocks of at least
    ``MIN_BLOCK_SIZE`` slots (the TMA boxes that stage it), an sm_90 GPU (wgmma), and at least ``MIN_TABLE_KEYS``
    keys over the block table."""
    return (fmt_name == FORMAT and head_dim == 128 and query_dtype in (torch.bfloat16, torch.float16)
            and sliding_window is None and ROWS - group < avg_q_len * group <= ROWS
            and cache_ptr % 16 == 0 and block_stride % 16 == 0 and slot_stride % 16 == 0
            and block_size >= MIN_BLOCK_SIZE and tuple(capability) == (9, 0) and table_keys >= MIN_TABLE_KEYS)


def applies(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, fmt: CacheFormat,
            sliding_window: Optional[int]) -> bool:
    num_tokens, num_q_heads, head_dim = query.shape
    batch = block_table.shape[0]
    return (enabled() and query.is_cuda and hasattr(torch.cuda, "_compile_kernel")
            and eligible(fmt.name, head_dim, query.dtype, num_q_heads // kv_cache.shape[2], sliding_window,
                         kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1),
                         torch.cuda.get_device_capability(query.device), -(-num_tokens // max(batch, 1)),
                         block_table.numel() * kv_cache.shape[1], kv_cache.shape[1]))


def launch_shape(num_tokens: int, batch: int, group: int, num_kv_heads: int, max_keys: int,
                 num_sms: int) -> tuple[int, int, int]:
    """(block_q, query tiles, splits): as many query tokens per program as fit ``ROWS`` rows, up to the average
    query length; the fewest splits that fill one wave of ``PROGRAMS_PER_SM`` programs per SM (``wave_splits``),
    counting the tiles that hold tokens (the grid's others exit at once)."""
    avg_q = max(1, -(-num_tokens // max(batch, 1)))
    block_q = max(1, min(avg_q, ROWS // group))
    programs = -(-num_tokens // block_q) * num_kv_heads
    return (block_q, query_tiles(num_tokens, batch, block_q),
            wave_splits(programs, max_keys, num_sms, 128, PROGRAMS_PER_SM))


@functools.lru_cache(maxsize=None)
def _kernel(q_bf16: bool, device_index: int):
    """turboquant_verify<q_bf16> built for ``device_index`` (NVRTC for sm_90a, about a second)."""
    return build_kernel(_SOURCE, f"turboquant_verify<{'true' if q_bf16 else 'false'}>", SMEM_BYTES, device_index,
                        compute_capability="90a")


def tensor_map(kv_cache: torch.Tensor) -> ByValue:
    """The TMA tensor map the kernel stages ``kv_cache`` through (``cuda_paged.tensor_map``): boxes of ``STAGE_ROW``
    bytes x min(block size, 64) slots."""
    return cuda_paged.tensor_map(kv_cache, STAGE_ROW, min(kv_cache.shape[1], 64))


def device_constants(fmt: CacheFormat, head_dim: int, device: torch.device) -> None:
    """Build the kernels before any launch, so none is first built inside a captured step."""
    if fmt.name == FORMAT and head_dim == 128 and enabled() and hasattr(torch.cuda, "_compile_kernel") \
            and torch.cuda.get_device_capability(device) == (9, 0):

        dc.rotation_signs(head_dim, device)
        dc.centroid_pairs(4, device)
        for q_bf16 in (True, False):
            _kernel(q_bf16, device.index)


def clear_device_constants() -> None:
    _kernel.cache_clear()  # the tensor maps are cuda_paged's


def paged_attention_verify(query, kv_cache, block_table, seq_lens, query_start_loc, fmt, causal: bool,
                           sinks: Optional[torch.Tensor], scale: float, *,
                           num_splits: Optional[int] = None) -> torch.Tensor:
    """Same contract as ``paged_attention_naive`` for the calls ``eligible`` accepts (the query-length and cache-size
    rules aside, which only choose the faster kernel). ``num_splits`` (a power of two) overrides the launch's."""
    from .triton_paged import int32_indices

    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = kv_cache.shape
    batch, max_blocks = block_table.shape
    block_table, seq_lens, query_start_loc = int32_indices(block_table, seq_lens, query_start_loc)
    if num_tokens == 0 or batch == 0:
        return torch.zeros_like(query, memory_format=torch.contiguous_format)
    # 16-byte query loads: whole contiguous rows
    if query.stride(2) != 1 or query.stride(1) % 8 or query.stride(0) % 8 or query.data_ptr() % 16:
        query = query.contiguous()
    if kv_cache.stride(1) % 16 or kv_cache.stride(0) % 16 or kv_cache.data_ptr() % 16:
        raise ValueError(f"kv_cache: the verify kernel needs a 16-byte aligned cache whose block and slot strides are "
                         f"multiples of 16 (see eligible); got slot stride {kv_cache.stride(1)}")
    if kv_cache.shape[1] < MIN_BLOCK_SIZE:
        raise ValueError(f"kv_cache: the verify kernel needs blocks of at least {MIN_BLOCK_SIZE} slots (see eligible); "
                         f"got {kv_cache.shape[1]}")
    device = query.device
    device_index = dc.device_index(device)
    signs, pairs = dc.rotation_signs(head_dim, device), dc.centroid_pairs(4, device)
    block_q, num_tiles, splits = launch_shape(num_tokens, batch, num_q_heads // num_kv_heads, num_kv_heads,
                                              max_blocks * block_size, dc.sm_count(device_index))
    splits = num_splits or splits
    return launch_split_kv(_kernel(query.dtype == torch.bfloat16, device_index), (num_tiles, num_kv_heads, splits),
                           THREADS, SMEM_BYTES, query, kv_cache, block_table, seq_lens, query_start_loc, signs, pairs,
                           scale * dc.LOG2E, block_q, splits, causal, sinks, (tensor_map(kv_cache),))
