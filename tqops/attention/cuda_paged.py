"""The CUDA split-KV kernel for the TurboQuant caches (turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc,
turboquant_k8v4) at head_dim 128 (cuda/turboquant_attention.cu), built with NVRTC and launched as the plan's
``cuda_launch.PagedLaunch`` says."""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Optional

import torch

from ..formats import CacheFormat, get_format
from . import constants as dc
from .combine import combine_splits
from .cuda_launch import (ALL_HEADS_KV_HEADS, ALL_HEADS_MAX_SMEM, PAGED_FORMATS, copy_bytes, decode_tma, enabled,
                          kernel_bits, min_capability, paged_key_tiles, smem_bytes, stage_row_bytes)
from .cuda_launch import FORMATS, all_heads_applies, all_heads_splits  # noqa: F401  (the benchmarks read them here)
from .plan import CallShape, accepts, cuda_indices, device_props, plan_attention

_SOURCE = Path(__file__).with_name("cuda") / "turboquant_attention.cu"
logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _kernel(n_tiles: int, num_warps: int, key_tiles: int, q_bf16: bool, bits: tuple, device_index: int,
            all_heads: bool, copy_piece: int):
    """turboquant_attention<n_tiles, num_warps, key_tiles, q_bf16, key bits, value bits, all_heads, copy_piece>
    built for ``device_index`` (NVRTC, about a second). No defaults: the lru_cache keys a call by the arguments
    given, so the builds of ``device_constants`` and the launch's lookups must pass the same ones."""
    return build_kernel(
        _SOURCE, f"turboquant_attention<{n_tiles}, {num_warps}, {key_tiles}, {'true' if q_bf16 else 'false'}, "
                 f"{bits[0]}, {bits[1]}, {'true' if all_heads else 'false'}, {copy_piece}>",
        ALL_HEADS_MAX_SMEM if all_heads else smem_bytes(num_warps, bits[0]),  # the most a launch asks
        device_index)


def build_kernel(source: Path, name: str, shared_mem: int, device_index: int, **compile_options):
    """The template instance ``name`` of ``source`` built with NVRTC for ``device_index`` (common.cuh beside it on
    the include path), opted into ``shared_mem`` bytes of dynamic shared memory."""
    logger.info("NVRTC: building %s from %s for cuda:%d (%d bytes of dynamic shared memory)", name, source.name,
                device_index, shared_mem)
    with torch.cuda.device(device_index):
        kernel = torch.cuda._compile_kernel(source.read_text(), name,
                                            nvcc_options=["-std=c++17", f"-I{source.parent}"], **compile_options)
        # Always opted into: static shared memory (the code keys' 32 KB table) counts against the default 48 KB,
        # and torch's set_shared_memory_config skips sizes below it.
        libcuda = torch.cuda._utils._get_gpu_runtime_library()
        max_dynamic_smem = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        torch.cuda._utils._check_cuda(libcuda.cuFuncSetAttribute(kernel.func, max_dynamic_smem, shared_mem))
        kernel.set_shared_memory_config(shared_mem)  # the launcher's own record of it
    return kernel


def applies(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, fmt: CacheFormat,
            sliding_window: Optional[int]) -> bool:
    """Whether the kernel's rules take this call (``plan.accepts``), whichever kernel the plan then picks."""
    return query.is_cuda and accepts("cuda_paged", CallShape.of(query, kv_cache, block_table), fmt, sliding_window,
                                     device_props(query.device))


def device_constants(fmt: CacheFormat, head_dim: int, device: torch.device,
                     num_kv_heads: Optional[int] = None) -> None:
    """Build the kernels before any launch, so none is first built inside a captured step: the 16-byte copy
    variants, and the 8-byte ones too where ``num_kv_heads`` rows make a slot that needs them (``copy_bytes``); the
    all-heads programs for ``num_kv_heads`` (all of ``ALL_HEADS_KV_HEADS`` where it is not given)."""
    if fmt in PAGED_FORMATS and head_dim == 128 and enabled() \
            and torch.cuda.get_device_capability(device) >= min_capability(fmt):

        bits = kernel_bits(fmt)
        dc.rotation_signs(head_dim, device)
        if bits[0] != 8:
            dc.centroid_pairs(bits[0], device)
        copies = {16}
        if num_kv_heads is not None:
            copies = (copies | {copy_bytes(num_kv_heads * fmt.slot_bytes(head_dim))}) - {0}
        for n_tiles, num_warps in ((1, 4), (1, 8), (2, 4)):
            for q_bf16 in (True, False):
                for cp in copies:
                    _kernel(n_tiles, num_warps, paged_key_tiles(n_tiles, bits[0]), q_bf16, bits, device.index, False,
                            cp)
        heads = ALL_HEADS_KV_HEADS if num_kv_heads is None else {num_kv_heads} & set(ALL_HEADS_KV_HEADS)
        for warps in heads:
            for q_bf16 in (True, False):
                _kernel(1, warps, paged_key_tiles(1, bits[0]), q_bf16, bits, device.index, True, 16)


def clear_device_constants() -> None:
    _kernel.cache_clear()
    _tensor_map.cache_clear()


class ByValue:
    """A kernel argument passed by value from host memory: ``size`` bytes at ``address`` (a struct such as a TMA
    tensor map), kept alive by ``owner``."""

    def __init__(self, address: int, size: int, owner: object):
        self.address, self.size, self.owner = address, size, owner


def _zeroed_map() -> ByValue:
    """A CUtensorMap's 128 bytes, zeroed, at a 64-byte boundary (its alignment) of a buffer the ByValue keeps."""
    buffer = ctypes.create_string_buffer(128 + 64)
    return ByValue((ctypes.addressof(buffer) + 63) & ~63, 128, buffer)


NO_TENSOR_MAP = _zeroed_map()  # the map argument where no map can be made; kernels given it never read it


def tensor_map(kv_cache: torch.Tensor, box_bytes: int, box_slots: int) -> ByValue:
    """A TMA tensor map of ``kv_cache`` as [blocks][slots][slot bytes] of uint8 with boxes of ``box_bytes`` x
    ``box_slots`` slots x 1 block, by value. Encoded by the driver on the host (no stream work, so a first call inside
    a CUDA-graph capture is fine) and kept per cache (pointer, shape, strides) and box. Bytes past a slot and slots
    past a block read as zeros."""
    return _tensor_map(kv_cache.data_ptr(), tuple(kv_cache.shape), tuple(kv_cache.stride()), box_bytes, box_slots)


@functools.lru_cache(maxsize=None)
def _tensor_map(data_ptr: int, shape: tuple, stride: tuple, box_bytes: int, box_slots: int) -> ByValue:
    num_blocks, block_size = shape[:2]
    cache_map = _zeroed_map()
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    libcuda = torch.cuda._utils._get_gpu_runtime_library()
    torch.cuda._utils._check_cuda(libcuda.cuTensorMapEncodeTiled(
        ctypes.c_void_p(cache_map.address), 0, 3, ctypes.c_void_p(data_ptr),  # uint8, rank 3
        (u64 * 3)(stride[1], block_size, num_blocks), (u64 * 2)(stride[1], stride[0]),
        (u32 * 3)(box_bytes, box_slots, 1), (u32 * 3)(1, 1, 1),
        0, 0, 2, 0))  # no interleave, no swizzle, 128-byte L2 promotion, zero fill out of bounds
    return cache_map


def decode_tensor_map(kv_cache: torch.Tensor, key_bits: int, copy_piece: int, capability: tuple) -> ByValue:
    """The decode kernel's map argument: boxes of a staged row (``stage_row_bytes``) x 16 slots (an M tile of keys)
    wherever its programs may stage by TMA (``cuda_launch.decode_tma``), else ``NO_TENSOR_MAP``."""
    if not decode_tma(copy_piece, capability):
        return NO_TENSOR_MAP
    return tensor_map(kv_cache, stage_row_bytes(key_bits), 16)


def launch(kernel, grid: tuple, block: tuple, shared_mem: int, args: list) -> None:
    """Launch an NVRTC-built ``kernel`` on the current stream, as its own ``__call__`` does (tensors as pointers,
    ints as int, floats as double), with ``ByValue`` arguments passed by value as well."""
    held, params = [], []
    for arg in args:
        if isinstance(arg, ByValue):
            params.append(arg.address)
            continue
        if isinstance(arg, torch.Tensor):
            value = ctypes.c_void_p(arg.data_ptr())
        elif isinstance(arg, int):
            value = ctypes.c_int(arg)
        elif isinstance(arg, float):
            value = ctypes.c_double(arg)
        else:
            raise TypeError(f"kernel argument {len(params)}: expected a tensor, int, float or ByValue, got "
                            f"{type(arg).__name__}")
        held.append(value)
        params.append(ctypes.addressof(value))
    libcuda = torch.cuda._utils._get_gpu_runtime_library()
    torch.cuda._utils._check_cuda(libcuda.cuLaunchKernel(
        kernel.func, *grid, *block, shared_mem, torch.cuda.current_stream()._as_parameter_,
        (ctypes.c_void_p * len(params))(*params), None))


def launch_split_kv(kernel, grid: tuple, threads: int, shared_mem: int, query, kv_cache, block_table, seq_lens,
                    query_start_loc, signs, pairs, qk_scale: float, block_q: int, splits: int, causal: bool,
                    sinks: Optional[torch.Tensor], extra_args: tuple) -> torch.Tensor:
    """Run ``kernel`` (either CUDA kernel: both take the arguments of common.cuh's ``SPLIT_KV_PARAMS``, then
    ``extra_args``, the tensor map) over fresh split partials and merge them into the output. The index tensors are
    int32."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    batch, max_blocks = block_table.shape
    part = torch.empty((splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=query.device)
    ml = torch.empty((splits, num_tokens, num_q_heads, 2), dtype=torch.float32, device=query.device)
    launch(kernel, grid, (threads, 1, 1), shared_mem,
           [query, query.stride(0), query.stride(1),
            kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            block_table, block_table.stride(0), seq_lens, query_start_loc, signs, pairs, part, ml,
            float(qk_scale), batch, num_tokens, num_blocks, max_blocks, block_size.bit_length() - 1,
            block_q, num_q_heads // num_kv_heads, splits, int(causal), num_q_heads, *extra_args])
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    combine_splits(part, ml, sinks, query_start_loc, out, batch)
    return out


def run(plan, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor, sinks: Optional[torch.Tensor], scale: float, k_scale: float,
        v_scale: float) -> torch.Tensor:
    """Launch the kernel as ``plan`` (a cuda_paged ``AttentionPlan``) says; same contract as ``paged_attention_naive``
    (``k_scale`` multiplies fp8 keys; the formats' values carry their own scales)."""
    if plan.shape.empty:
        return torch.zeros_like(query, memory_format=torch.contiguous_format)
    launch, head_dim = plan.launch, plan.shape.head_dim
    block_table, seq_lens, query_start_loc = cuda_indices(plan, query, kv_cache, block_table, seq_lens,
                                                          query_start_loc)
    if query.stride(2) != 1:
        query = query.contiguous()
    signs = dc.rotation_signs(head_dim, query.device)
    pairs = signs if launch.bits[0] == 8 else dc.centroid_pairs(launch.bits[0], query.device)  # fp8 keys read neither
    cache_map = tensor_map(kv_cache, stage_row_bytes(launch.bits[0]), 16) if launch.tma else NO_TENSOR_MAP
    qk_scale = scale * dc.LOG2E * (k_scale if launch.bits[0] == 8 else 1.0)
    return launch_split_kv(_kernel(*launch.kernel_key), launch.grid, 32 * launch.num_warps, launch.shared_mem, query,
                           kv_cache, block_table, seq_lens, query_start_loc, signs, pairs, qk_scale, launch.block_q,
                           launch.splits, plan.causal, sinks, (cache_map,))


def paged_attention_cuda(query, kv_cache, block_table, seq_lens, query_start_loc, fmt, causal: bool,
                         sinks: Optional[torch.Tensor], scale: float, *, num_splits: Optional[int] = None,
                         num_warps: Optional[int] = None, block_q: Optional[int] = None,
                         key_tiles: Optional[int] = None, k_scale: float = 1.0,
                         all_heads: Optional[bool] = None) -> torch.Tensor:
    """Same contract as ``paged_attention_naive`` for the calls ``cuda_launch.paged_eligible`` accepts (``k_scale``
    multiplies fp8 keys), through a cuda_paged plan with the keyword overrides of ``cuda_launch.paged_launch`` (for
    tests and tuning)."""
    overrides = dict(num_splits=num_splits, num_warps=num_warps, block_q=block_q, key_tiles=key_tiles,
                     all_heads=all_heads)
    plan = plan_attention(query, kv_cache, block_table, get_format(fmt), causal, None, sinks, backend="cuda_paged",
                          overrides={key: val for key, val in overrides.items() if val is not None})
    return run(plan, query, kv_cache, block_table, seq_lens, query_start_loc, sinks, scale, k_scale, 1.0)
