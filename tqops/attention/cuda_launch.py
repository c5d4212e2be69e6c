"""Launch rules of the two CUDA kernels (cuda_paged's decode kernel, cuda_verify's sm_90 verify kernel): which calls
each takes, and its grid, splits, warps and variant, from shapes, strides, the format and the device only.

Plain Python, like ``launch.py`` for the Triton kernel; ``plan.plan_attention`` reads them, the kernels' modules
build and launch what they pick.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from ..formats import CacheFormat, get_format
from .launch import mean_query_len, query_tiles, split_count, wave_splits

# ---- the decode kernel (cuda_paged, cuda/turboquant_attention.cu) ---------------------------------------------------

# The formats it reads, in the order the benchmarks report them; the kernel specializes on their (key, value) code
# bits, and 8-bit keys are fp8 e4m3.
PAGED_FORMATS = tuple(get_format(name) for name in ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
                                                    "turboquant_k8v4"))
FORMATS = {fmt.name: (fmt.key_bits, fmt.value_bits) for fmt in PAGED_FORMATS}
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


def kernel_bits(fmt: CacheFormat) -> tuple[int, int]:
    """The (key, value) code bits the CUDA kernels specialize on."""
    return fmt.key_bits, fmt.value_bits


def enabled() -> bool:
    """``TQOPS_CUDA_ATTENTION=0`` sends every call to the Triton kernel (for A/B runs and tests)."""
    return os.environ.get("TQOPS_CUDA_ATTENTION", "1") != "0"


def min_capability(fmt: CacheFormat) -> tuple:
    """fp8 keys convert with sm_89's cvt.f16x2.e4m3x2; the code formats need sm_80's MMAs and cp.async."""
    return (8, 9) if fmt.key_bits == 8 else (8, 0)


def stage_row_bytes(key_bits: int) -> int:
    """The kernel's staged row (``Row::STAGE``): 224 bytes for fp8 keys, else 160."""
    return 224 if key_bits == 8 else 160


def smem_bytes(num_warps: int, key_bits: int) -> int:
    """Dynamic shared memory: the warps' stage buffers, 64 keys in flight per warp at ``stage_row_bytes``. The 32 KB
    key table and the stage mbarriers are static."""
    return num_warps * 64 * stage_row_bytes(key_bits)


def all_heads_smem_bytes(slot_stride: int) -> int:
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
            and all_heads_smem_bytes(slot_stride) + table <= ALL_HEADS_MAX_SMEM)


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


def copy_bytes(slot_stride: int) -> int:
    """The kernel's copy piece: 16 bytes where a slot is a multiple of 16 (a multiple of 8 kv heads of any format),
    else 8 (a multiple of 4 kv heads of the code formats, of 2 of turboquant_k8v4); 0 where neither divides it (the
    Triton kernel runs)."""
    return 16 if slot_stride % 16 == 0 else 8 if slot_stride % 8 == 0 else 0


def paged_cache_fits(cache_ptr: int, block_stride: int, slot_stride: int) -> bool:
    """A 16-byte aligned cache whose block stride is a multiple of 16 and slot stride of 8 (``copy_bytes``): the
    copies the kernel stages rows with."""
    return cache_ptr % 16 == 0 and block_stride % 16 == 0 and copy_bytes(slot_stride) > 0


def paged_eligible(fmt: CacheFormat, head_dim: int, query_dtype: torch.dtype, group: int,
                   sliding_window: Optional[int], cache_ptr: int, block_stride: int, slot_stride: int,
                   capability: tuple, avg_q_len: int, table_keys: int) -> bool:
    """Whether the decode kernel takes a call: a format of ``PAGED_FORMATS`` at head_dim 128, 16-bit queries, a GQA
    group of at most 16, no sliding window, decode-sized queries (<= 4 tokens per sequence on average: one program's
    16 rows hold every query token of a sequence at the Qwen3 group of 4; longer queries would re-read and re-decode
    the keys once per 16 rows, which measured slower than the Triton kernel's 64-row tiles at 16), a cache the kernel
    can stage (``paged_cache_fits``), ``min_capability``; fp8 keys also at least ``FP8_KEYS_MIN_TABLE_KEYS`` keys over
    the block table."""
    if fmt not in PAGED_FORMATS:
        return False
    return (head_dim == 128 and query_dtype in (torch.bfloat16, torch.float16)
            and group <= MAX_ROWS and sliding_window is None and avg_q_len <= 4
            and paged_cache_fits(cache_ptr, block_stride, slot_stride)
            and tuple(capability) >= min_capability(fmt)
            and (fmt.key_bits != 8 or table_keys >= FP8_KEYS_MIN_TABLE_KEYS))


def paged_launch_shape(num_tokens: int, batch: int, group: int, num_kv_heads: int, max_keys: int, num_sms: int,
                       block_q: Optional[int] = None) -> tuple[int, int, int, int]:
    """(block_q, query tiles, splits, warps) from shapes only: as many query tokens per program as fit 16 rows;
    splits for about three programs per SM (``split_count``); 8 warps
    where a program's rows fit one MMA N tile and its split is long (>= 2048 keys: more warps per SM hide more
    latency), else 4 (H200 sweep in docs/tuning.md)."""
    if block_q is None:
        block_q = max(1, min(max(1, mean_query_len(num_tokens, batch)), MAX_ROWS // group))
    num_tiles = query_tiles(num_tokens, batch, block_q)
    splits = split_count(num_tiles * num_kv_heads, max_keys, num_sms, 3, 128)
    num_warps = 8 if block_q * group <= 8 and max_keys // splits >= 2048 else 4
    return block_q, num_tiles, splits, num_warps


def paged_key_tiles(n_tiles: int, key_bits: int, override: Optional[int] = None) -> int:
    """16-key tiles per warp iteration. Two share the per-tile work (block ids, copy addresses, row-max shuffles); they
    fit 128 registers only with one query tile and table-decoded keys (fp8 keys' 32 code bytes per row and lane
    spill)."""
    return (override or 2) if n_tiles == 1 and key_bits != 8 else 1


def decode_tma(copy_piece: int, capability: tuple) -> bool:
    """Whether the decode kernel's programs may stage by TMA, and so get a tensor map: 16-byte copy pieces on sm_90 or
    later (which programs read it is the kernel's choice, so the host does not repeat it)."""
    return copy_piece == 16 and tuple(capability) >= (9, 0)


@dataclasses.dataclass(frozen=True)
class PagedLaunch:
    """A decode-kernel launch: the variant (``turboquant_attention<n_tiles, num_warps, key_tiles, q_bf16, key bits,
    value bits, all_heads, copy_piece>`` built for ``device_index``), its grid and shared memory, and whether it gets
    a tensor map (``decode_tma``)."""
    block_q: int
    splits: int
    num_warps: int
    n_tiles: int
    key_tiles: int
    q_bf16: bool
    bits: tuple
    device_index: int
    all_heads: bool
    copy_piece: int
    grid: tuple
    shared_mem: int
    tma: bool

    @property
    def kernel_key(self) -> tuple:
        """``cuda_paged._kernel``'s arguments for this variant, as ``device_constants`` builds it."""
        return (self.n_tiles, self.num_warps, self.key_tiles, self.q_bf16, self.bits, self.device_index,
                self.all_heads, self.copy_piece)


def paged_launch(num_tokens: int, batch: int, num_q_heads: int, num_kv_heads: int, block_size: int, max_blocks: int,
                 cache_ptr: int, block_stride: int, slot_stride: int, fmt: CacheFormat, query_dtype: torch.dtype,
                 num_sms: int, capability: tuple, device_index: int, *, num_splits: Optional[int] = None,
                 num_warps: Optional[int] = None, block_q: Optional[int] = None, key_tiles: Optional[int] = None,
                 all_heads: Optional[bool] = None) -> PagedLaunch:
    """The decode kernel's launch for a call. All-heads programs run where ``all_heads_applies``; the keyword
    overrides are for tests and tuning (``num_splits`` a power of two; ``num_warps`` or ``block_q`` select the
    per-head programs unless ``all_heads`` is True, which raises ValueError where all-heads programs cannot run)."""
    if fmt not in PAGED_FORMATS:
        raise ValueError(f"the CUDA kernel reads {', '.join(FORMATS)} caches; got {fmt.name}")
    if not paged_cache_fits(cache_ptr, block_stride, slot_stride):
        raise ValueError(f"kv_cache: the CUDA kernel needs a 16-byte aligned cache, a block stride that is a multiple "
                         f"of 16 and a slot stride that is a multiple of 8 (see paged_eligible); got slot stride "
                         f"{slot_stride}")
    group, bits, max_keys = num_q_heads // num_kv_heads, kernel_bits(fmt), max_blocks * block_size
    block_q_override = block_q
    block_q, num_tiles, splits, warps = paged_launch_shape(num_tokens, batch, group, num_kv_heads, max_keys, num_sms,
                                                           block_q)
    n_tiles = 1 if block_q * group <= 8 else 2  # query rows in MMA N tiles of 8
    if all_heads and not all_heads_fit(n_tiles, num_kv_heads, slot_stride, bits[0]):
        raise ValueError(f"all_heads: needs one query tile of at most 8 rows, kv heads of {ALL_HEADS_KV_HEADS}, a slot "
                         f"stride of whole 4-byte words and 64 slots in shared memory; got {num_kv_heads} kv heads, "
                         f"slot stride {slot_stride}, {block_q * group} rows a tile")
    if all_heads is None:  # a warp or tile override asks for the per-head programs
        all_heads = (num_warps is None and block_q_override is None
                     and all_heads_applies(n_tiles, num_tiles, num_kv_heads, slot_stride, bits[0],
                                           batch * max_blocks * block_size))
    if all_heads:  # one program per (query tile, split) serves every kv head, a warp each
        warps, splits = num_kv_heads, all_heads_splits(num_tokens, block_q, max_keys, num_sms)
        if num_warps not in (None, num_kv_heads):
            raise ValueError(f"num_warps: all-heads programs run one warp per kv head ({num_kv_heads}), got "
                             f"{num_warps}")
    splits, num_warps, copy_piece = num_splits or splits, num_warps or warps, copy_bytes(slot_stride)
    return PagedLaunch(
        block_q=block_q, splits=splits, num_warps=num_warps, n_tiles=n_tiles,
        key_tiles=paged_key_tiles(n_tiles, bits[0], key_tiles), q_bf16=query_dtype == torch.bfloat16,
        bits=bits, device_index=device_index, all_heads=bool(all_heads),
        # all-heads programs copy whole 16-slot tiles in 16-byte pieces at any even slot stride
        copy_piece=16 if all_heads else copy_piece,
        grid=(num_tiles, 1 if all_heads else num_kv_heads, splits),
        shared_mem=all_heads_smem_bytes(slot_stride) if all_heads else smem_bytes(num_warps, bits[0]),
        tma=decode_tma(copy_piece, capability))


# ---- the sm_90 verify kernel (cuda_verify, cuda/turboquant_verify.cu) ----------------------------------------------

VERIFY_FORMAT = get_format("turboquant_4bit_nc")
VERIFY_ROWS = 64  # query rows (tokens x GQA group) per program: the N of the kernel's MMAs
VERIFY_THREADS = 128  # one warpgroup
VERIFY_PROGRAMS_PER_SM = 2
# Keys over the block table below which the Triton kernel runs: each program's query prologue costs about as much as
# a few dozen key tiles, and one 8K sequence measured slower (docs/tuning.md).
VERIFY_MIN_TABLE_KEYS = 32768
VERIFY_STAGE_ROW = 176  # bytes of a row's TMA box (the kernel's STAGE_ROW): the row and the 15 bytes before it at most
# Dynamic shared memory (the kernel's Smem::TOTAL): the replicated centroid-pair table, Q^T, P'^T, row maxima, four
# 64-key stages of VERIFY_STAGE_ROW-byte rows, their mbarriers and block flags; two programs fit an SM.
VERIFY_SMEM_BYTES = 32768 + 16384 + 8192 + 1024 + 4 * 64 * VERIFY_STAGE_ROW + 4 * 8 + 4 * 64
# Blocks of fewer slots make segments whose boxes do not land on 128-byte boundaries of shared memory.
VERIFY_MIN_BLOCK_SIZE = 8


def verify_cache_fits(cache_ptr: int, block_stride: int, slot_stride: int, block_size: int) -> bool:
    """A 16-byte aligned cache whose block and slot strides are multiples of 16 and blocks of at least
    ``VERIFY_MIN_BLOCK_SIZE`` slots: the TMA boxes that stage it."""
    return (cache_ptr % 16 == 0 and block_stride % 16 == 0 and slot_stride % 16 == 0
            and block_size >= VERIFY_MIN_BLOCK_SIZE)


def verify_eligible(fmt: CacheFormat, head_dim: int, query_dtype: torch.dtype, group: int,
                    sliding_window: Optional[int], cache_ptr: int, block_stride: int, slot_stride: int,
                    capability: tuple, avg_q_len: int, table_keys: int, block_size: int) -> bool:
    """Whether the verify kernel takes a call: a ``VERIFY_FORMAT`` cache at head_dim 128, 16-bit queries, no sliding
    window, query rows (tokens x GQA group) of a sequence that fill one program's ``VERIFY_ROWS`` (16 tokens at
    Qwen3's group of 4: a DFlash verify; with fewer rows, or more tiles per sequence, the Triton kernel measured as
    fast or faster), a cache the kernel can stage (``verify_cache_fits``), an sm_90 GPU (wgmma), and at least
    ``VERIFY_MIN_TABLE_KEYS`` keys over the block table."""
    return (fmt == VERIFY_FORMAT and head_dim == 128 and query_dtype in (torch.bfloat16, torch.float16)
            and sliding_window is None and VERIFY_ROWS - group < avg_q_len * group <= VERIFY_ROWS
            and verify_cache_fits(cache_ptr, block_stride, slot_stride, block_size)
            and tuple(capability) == (9, 0) and table_keys >= VERIFY_MIN_TABLE_KEYS)


def verify_launch_shape(num_tokens: int, batch: int, group: int, num_kv_heads: int, max_keys: int,
                        num_sms: int) -> tuple[int, int, int]:
    """(block_q, query tiles, splits): as many query tokens per program as fit ``VERIFY_ROWS`` rows, up to the average
    query length; the fewest splits that fill one wave of ``VERIFY_PROGRAMS_PER_SM`` programs per SM
    (``wave_splits``), counting the tiles that hold tokens (the grid's others exit at once)."""
    block_q = max(1, min(max(1, mean_query_len(num_tokens, batch)), VERIFY_ROWS // group))
    programs = -(-num_tokens // block_q) * num_kv_heads
    return (block_q, query_tiles(num_tokens, batch, block_q),
            wave_splits(programs, max_keys, num_sms, 128, VERIFY_PROGRAMS_PER_SM))


@dataclasses.dataclass(frozen=True)
class VerifyLaunch:
    """A verify-kernel launch: ``turboquant_verify<q_bf16>`` built for ``device_index``, its grid and splits."""
    block_q: int
    splits: int
    q_bf16: bool
    device_index: int
    grid: tuple


def verify_launch(num_tokens: int, batch: int, num_q_heads: int, num_kv_heads: int, block_size: int, max_blocks: int,
                  cache_ptr: int, block_stride: int, slot_stride: int, fmt: CacheFormat, query_dtype: torch.dtype,
                  num_sms: int, device_index: int, *, num_splits: Optional[int] = None) -> VerifyLaunch:
    """The verify kernel's launch for a call; ``num_splits`` (a power of two) overrides the rule's. Raises ValueError
    for a cache it cannot read or stage (``verify_cache_fits``)."""
    if fmt != VERIFY_FORMAT:
        raise ValueError(f"the verify kernel reads {VERIFY_FORMAT.name} caches; got {fmt.name}")
    if slot_stride % 16 or block_stride % 16 or cache_ptr % 16:
        raise ValueError(f"kv_cache: the verify kernel needs a 16-byte aligned cache whose block and slot strides are "
                         f"multiples of 16 (see verify_eligible); got slot stride {slot_stride}")
    if not verify_cache_fits(cache_ptr, block_stride, slot_stride, block_size):
        raise ValueError(f"kv_cache: the verify kernel needs blocks of at least {VERIFY_MIN_BLOCK_SIZE} slots (see "
                         f"verify_eligible); got {block_size}")
    block_q, num_tiles, splits = verify_launch_shape(num_tokens, batch, num_q_heads // num_kv_heads, num_kv_heads,
                                                     max_blocks * block_size, num_sms)
    splits = num_splits or splits
    return VerifyLaunch(block_q=block_q, splits=splits, q_bf16=query_dtype == torch.bfloat16,
                        device_index=device_index, grid=(num_tiles, num_kv_heads, splits))
