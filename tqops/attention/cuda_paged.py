"""The CUDA split-KV kernel for the TurboQuant caches (turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc,
turboquant_k8v4) at head_dim 128 (cuda/turboquant_attention.cu), built with NVRTC."""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Optional

import torch

from ..formats import CacheFormat
from . import constants as dc
from .combine import combine_splits
from .launch import query_tiles, split_count, wave_splits

_SOURCE = Path(__file__).with_name("cuda") / "turboquant_attention.cu"
logger = logging.getLogger(__name__)
# The formats it reads: their (key, value) code bits; 8-bit keys are fp8 e4m3.
FORMATS = {"turboquant_4bit_nc": (4, 4), "turboquant_k3v4_nc": (3, 4), "turboquant_3bit_nc": (3, 3),
           "turboquant_k8v4": (8, 4)}
# fp8 keys take the CUDA kernel from this many keys over the block table (batch x max_blocks x block_size): their
# Triton decode is cheap per key, and at one 8K sequence the CUDA kernel made the captured 0.6B decode step slower
# (docs/tuning.md).
FP8_KEYS_MIN_TABLE_KEYS = 32768
MAX_ROWS = 16  # query rows (tokens x GQA group) per program: two MMA N tiles of 8
# All-heads programs (one warp per kv head, whole slots staged: every head's rows of a block read as one contiguous
# range, on sm_90 one bulk copy per M tile) at these kv-head counts (Qwen3's 8, and 4 a rank under 2-way tensor
# parallelism), from this many query tiles and keys over the block table: fewer tiles leave too few programs, and at
# 8 x 8K the captured 0.6B batch-8 decode step measured slower with them (docs/tuning.md).
ALL_HEADS_KV_HEADS = (4, 8)
ALL_HEADS_MIN_TILES = 8
ALL_HEADS_MIN_TABLE_KEYS = 131072
ALL_HEADS_MAX_SMEM = 116 * 1024  # shared memory of two programs per SM
ALL_HEADS_PER_SM = 2


def stage_row_bytes(key_bits: int) -> int:
    """The kernel's staged row (``Row::STAGE``): 224 bytes for fp8 keys, else 160."""
    return 224 if key_bits == 8 else 160


def _smem_bytes(num_warps: int, key_bits: int) -> int:
    """Dynamic shared memory: the warps' stage buffers, 64 keys in flight per warp at ``stage_row_bytes``. The 32 KB
    key table and the stage mbarriers are static."""
    return num_warps * 64 * stage_row_bytes(key_bits)


def _all_heads_smem_bytes(slot_stride: int) -> int:
    """Dynamic shared memory of an all-heads program: 64 staged slots of every head, plus 16 bytes for the funnel
    shift's read past the last head's row."""
    return 64 * slot_stride + 16


def all_heads_fit(n_tiles: int, num_kv_heads: int, slot_stride: int, key_bits: int) -> bool:
    """Whether all-heads programs can run a call: one query tile of rows (n_tiles 1), kv heads of
    ``ALL_HEADS_KV_HEADS`` (a warp each), a slot stride of whole 4-byte words (the fragments' shared-memory reads;
    a tile's 16 slots are whole 16-byte copies at any even stride), and 64 staged slots (plus the code keys' 32 KB
    table) within ``ALL_HEADS_MAX_SMEM``."""
    table = 0 if key_bits == 8 else 32768
    return (n_tiles == 1 and num_kv_heads in ALL_HEADS_KV_HEADS and slot_stride % 4 == 0
            and _all_heads_smem_bytes(slot_stride) + table <= ALL_HEADS_MAX_SMEM)


def all_heads_applies(n_tiles: int, num_tiles: int, num_kv_heads: int, slot_stride: int, key_bits: int,
                      table_keys: int) -> bool:
    """Whether a call runs all-heads programs by default: they fit (``all_heads_fit``), and there are at least
    ``ALL_HEADS_MIN_TILES`` query tiles and ``ALL_HEADS_MIN_TABLE_KEYS`` keys over the block table, on every GPU: with
    their tiles staged by bulk copies they measured faster than per-head programs from 8 tiles for every format on an
    H100 and an H200 alike (docs/tuning.md)."""
    return (num_tiles >= ALL_HEADS_MIN_TILES and table_keys >= ALL_HEADS_MIN_TABLE_KEYS
            and all_heads_fit(n_tiles, num_kv_heads, slot_stride, key_bits))


def all_heads_splits(num_tokens: int, block_q: int, max_keys: int, num_sms: int) -> int:
    """Splits of all-heads programs: the fewest that fill one wave of ``ALL_HEADS_PER_SM`` per SM over the query tiles
    that have rows (``wave_splits``). About three programs per SM, as the per-head programs take, left a partial
    second wave, which measured slower wherever it was not the same count (H100 sweep in docs/tuning.md)."""
    return wave_splits(-(-num_tokens // block_q), max_keys, num_sms, 128, ALL_HEADS_PER_SM)


@functools.lru_cache(maxsize=None)
def _kernel(n_tiles: int, num_warps: int, key_tiles: int, q_bf16: bool, bits: tuple, device_index: int,
            all_heads: bool, copy_piece: int):
    """turboquant_attention<n_tiles, num_warps, key_tiles, q_bf16, key bits, value bits, all_heads, copy_piece>
    built for ``device_index`` (NVRTC, about a second). No defaults: the lru_cache keys a call by the arguments
    given, so the builds of ``device_constants`` and the launch's lookups must pass the same ones."""
    return build_kernel(
        _SOURCE, f"turboquant_attention<{n_tiles}, {num_warps}, {key_tiles}, {'true' if q_bf16 else 'false'}, "
                 f"{bits[0]}, {bits[1]}, {'true' if all_heads else 'false'}, {copy_piece}>",
        ALL_HEADS_MAX_SMEM if all_heads else _smem_bytes(num_warps, bits[0]),  # the most a launch asks
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


def enabled() -> bool:
    """``TQOPS_CUDA_ATTENTION=0`` sends every call to the Triton kernel (for A/B runs and tests)."""
    return os.environ.get("TQOPS_CUDA_ATTENTION", "1") != "0"


def _min_capability(fmt_name: str) -> tuple:
    """fp8 keys convert with sm_89's cvt.f16x2.e4m3x2; the code formats need sm_80's MMAs and cp.async."""
    return (8, 9) if FORMATS[fmt_name][0] == 8 else (8, 0)


def copy_bytes(slot_stride: int) -> int:
    """The kernel's copy piece: 16 bytes where a slot is a multiple of 16 (a multiple of 8 kv heads of any format),
    else 8 (a multiple of 4 kv heads of the code formats, of 2 of turboquant_k8v4); 0 where neither divides it (the
    Triton kernel runs)."""
    return 16 if slot_stride % 16 == 0 else 8 if slot_stride % 8 == 0 else 0


def eligible(fmt_name: str, head_dim: int, query_dtype: torch.dtype, group: int, sliding_window: Optional[int],
             cache_ptr: int, block_stride: int, slot_stride: int, capability: tuple, avg_q_len: int,
             table_keys: int) -> bool:
    """Whether the CUDA kernel takes a call: a format of ``FORMATS`` at head_dim 128, 16-bit queries, a GQA group of at
    most 16, no sliding window, decode-sized queries (<= 4 tokens per sequence on average: one program's 16 rows
    hold every query token of a sequence at the Qwen3 group of 4; longer queries would re-read and re-decode the
    keys once per 16 rows, which measured slower than the Triton kernel's 64-row tiles at 16), a 16-byte aligned
    cache whose block stride is a multiple of 16 and slot stride of 8 (``copy_bytes``), ``_min_capability``; fp8
    keys also at least ``FP8_KEYS_MIN_TABLE_KEYS`` keys over the block table."""
    if fmt_name not in FORMATS:
        return False
    fp8_keys = FORMATS[fmt_name][0] == 8
    return (head_dim == 128 and query_dtype in (torch.bfloat16, torch.float16)
            and group <= MAX_ROWS and sliding_window is None and avg_q_len <= 4 and cache_ptr % 16 == 0
            and block_stride % 16 == 0 and copy_bytes(slot_stride) > 0
            and tuple(capability) >= _min_capability(fmt_name)
            and (not fp8_keys or table_keys >= FP8_KEYS_MIN_TABLE_KEYS))


def applies(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, fmt: CacheFormat,
            sliding_window: Optional[int]) -> bool:
    num_tokens, num_q_heads, head_dim = query.shape
    batch = block_table.shape[0]
    return (enabled() and query.is_cuda and hasattr(torch.cuda, "_compile_kernel")  # NVRTC builds: torch >= 2.8
            and eligible(fmt.name, head_dim, query.dtype, num_q_heads // kv_cache.shape[2], sliding_window,
                         kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1),
                         torch.cuda.get_device_capability(query.device), -(-num_tokens // max(batch, 1)),
                         block_table.numel() * kv_cache.shape[1]))


def launch_shape(num_tokens: int, batch: int, group: int, num_kv_heads: int, max_keys: int, num_sms: int,
                 block_q: Optional[int] = None) -> tuple[int, int, int, int]:
    """(block_q, query tiles, splits, warps) from shapes only: as many query tokens per program as fit 16 rows;
    splits for about three programs per SM (``split_count``); 8 warps
    where a program's rows fit one MMA N tile and its split is long (>= 2048 keys: more warps per SM hide more
    latency), else 4 (H200 sweep in docs/tuning.md)."""
    if block_q is None:
        avg_q = max(1, -(-num_tokens // max(batch, 1)))
        block_q = max(1, min(avg_q, MAX_ROWS // group))
    num_tiles = query_tiles(num_tokens, batch, block_q)
    splits = split_count(num_tiles * num_kv_heads, max_keys, num_sms, 3, 128)
    num_warps = 8 if block_q * group <= 8 and max_keys // splits >= 2048 else 4
    return block_q, num_tiles, splits, num_warps


def _key_tiles(n_tiles: int, key_bits: int, override: Optional[int] = None) -> int:
    """16-key tiles per warp iteration. Two share the per-tile work (block ids, copy addresses, row-max shuffles); they
    fit 128 registers only with one query tile and table-decoded keys (fp8 keys' 32 code bytes per row and lane
    spill)."""
    return (override or 2) if n_tiles == 1 and key_bits != 8 else 1


def device_constants(fmt: CacheFormat, head_dim: int, device: torch.device,
                     num_kv_heads: Optional[int] = None) -> None:
    """Build the kernels before any launch, so none is first built inside a captured step: the 16-byte copy
    variants, and the 8-byte ones too where ``num_kv_heads`` rows make a slot that needs them (``copy_bytes``); the
    all-heads programs for ``num_kv_heads`` (all of ``ALL_HEADS_KV_HEADS`` where it is not given)."""
    if fmt.name in FORMATS and head_dim == 128 and enabled() \
            and torch.cuda.get_device_capability(device) >= _min_capability(fmt.name):

        bits = FORMATS[fmt.name]
        dc.rotation_signs(head_dim, device)
        if bits[0] != 8:
            dc.centroid_pairs(bits[0], device)
        copies = {16}
        if num_kv_heads is not None:
            copies = (copies | {copy_bytes(num_kv_heads * fmt.slot_bytes(head_dim))}) - {0}
        for n_tiles, num_warps in ((1, 4), (1, 8), (2, 4)):
            for q_bf16 in (True, False):
                for cp in copies:
                    _kernel(n_tiles, num_warps, _key_tiles(n_tiles, bits[0]), q_bf16, bits, device.index, False, cp)
        heads = ALL_HEADS_KV_HEADS if num_kv_heads is None else {num_kv_heads} & set(ALL_HEADS_KV_HEADS)
        for warps in heads:
            for q_bf16 in (True, False):
                _kernel(1, warps, _key_tiles(1, bits[0]), q_bf16, bits, device.index, True, 16)


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
    wherever its programs may stage by TMA (16-byte copy pieces on sm_90 or later), else ``NO_TENSOR_MAP``. Which
    programs read it is the kernel's choice (its ``TMA``), so the host does not repeat it."""
    if copy_piece != 16 or tuple(capability) < (9, 0):
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


def paged_attention_cuda(query, kv_cache, block_table, seq_lens, query_start_loc, fmt, causal: bool,
                         sinks: Optional[torch.Tensor], scale: float, *, num_splits: Optional[int] = None,
                         num_warps: Optional[int] = None, block_q: Optional[int] = None,
                         key_tiles: Optional[int] = None, k_scale: float = 1.0,
                         all_heads: Optional[bool] = None) -> torch.Tensor:
    """Same contract as ``paged_attention_naive`` for the calls ``eligible`` accepts (``k_scale`` multiplies fp8
    keys). All-heads programs run where ``all_heads_applies``; the keyword overrides are for tests and tuning
    (``num_splits`` a power of two; ``num_warps`` or ``block_q`` select the per-head programs unless ``all_heads``
    is True, which raises ValueError where all-heads programs cannot run)."""
    from .triton_paged import int32_indices

    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = kv_cache.shape
    batch, max_blocks = block_table.shape
    # int32 indices, narrowed as the Triton path narrows them (no wrapping; a no-op for int32)
    block_table, seq_lens, query_start_loc = int32_indices(block_table, seq_lens, query_start_loc)
    group = num_q_heads // num_kv_heads
    if num_tokens == 0 or batch == 0:
        return torch.zeros_like(query, memory_format=torch.contiguous_format)
    if query.stride(2) != 1:
        query = query.contiguous()
    device = query.device
    device_index = dc.device_index(device)
    bits = FORMATS[fmt if isinstance(fmt, str) else fmt.name]
    signs, num_sms = dc.rotation_signs(head_dim, device), dc.sm_count(device_index)
    pairs = signs if bits[0] == 8 else dc.centroid_pairs(bits[0], device)  # fp8 keys read neither
    block_q_override = block_q
    block_q, num_tiles, splits, warps = launch_shape(num_tokens, batch, group, num_kv_heads, max_blocks * block_size,
                                                     num_sms, block_q)
    n_tiles = 1 if block_q * group <= 8 else 2  # query rows in MMA N tiles of 8
    slot_stride = kv_cache.stride(1)
    cp = copy_bytes(slot_stride)
    if not cp or kv_cache.stride(0) % 16 or kv_cache.data_ptr() % 16:
        raise ValueError(f"kv_cache: the CUDA kernel needs a 16-byte aligned cache, a block stride that is a multiple "
                         f"of 16 and a slot stride that is a multiple of 8 (see eligible); got slot stride "
                         f"{slot_stride}")
    if all_heads and not all_heads_fit(n_tiles, num_kv_heads, slot_stride, bits[0]):
        raise ValueError(f"all_heads: needs one query tile of at most 8 rows, kv heads of {ALL_HEADS_KV_HEADS}, a slot "
                         f"stride of whole 4-byte words and 64 slots in shared memory; got {num_kv_heads} kv heads, "
                         f"slot stride {slot_stride}, {block_q * group} rows a tile")
    if all_heads is None:  # a warp or tile override asks for the per-head programs
        all_heads = (num_warps is None and block_q_override is None
                     and all_heads_applies(n_tiles, num_tiles, num_kv_heads, slot_stride, bits[0],
                                           block_table.numel() * block_size))
    if all_heads:  # one program per (query tile, split) serves every kv head, a warp each
        warps, splits = num_kv_heads, all_heads_splits(num_tokens, block_q, max_blocks * block_size, num_sms)
        if num_warps not in (None, num_kv_heads):
            raise ValueError(f"num_warps: all-heads programs run one warp per kv head ({num_kv_heads}), got {num_warps}")
    splits, num_warps = num_splits or splits, num_warps or warps
    key_tiles = _key_tiles(n_tiles, bits[0], key_tiles)
    # all-heads programs copy whole 16-slot tiles in 16-byte pieces at any even slot stride
    kernel = _kernel(n_tiles, num_warps, key_tiles, query.dtype == torch.bfloat16, bits, device_index,
                     bool(all_heads), 16 if all_heads else cp)
    qk_scale = scale * dc.LOG2E * (k_scale if bits[0] == 8 else 1.0)
    cache_map = decode_tensor_map(kv_cache, bits[0], cp, torch.cuda.get_device_capability(device))
    return launch_split_kv(
        kernel, (num_tiles, 1 if all_heads else num_kv_heads, splits), 32 * num_warps,
        _all_heads_smem_bytes(slot_stride) if all_heads else _smem_bytes(num_warps, bits[0]), query, kv_cache,
        block_table, seq_lens, query_start_loc, signs, pairs, qk_scale, block_q, splits, causal, sinks, (cache_map,))
