"""Launch rules of the paged attention kernel: tile sizes, splits and per-format switches, from shapes only."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from ..formats import CacheFormat


# (BLOCK_N, num_warps, prefetch, num_stages) per format family for decode-sized (M = 16) query tiles whose program
# scans >= 512 keys (large batches, long contexts), for decode tiles with shorter splits (small batch, short
# context: the e2e decode step), and for block-sized (M >= 32) tiles. From sweeps on an H200 at 32 x 8K keys (32 q
# heads) and 1 x 8K keys (16 q heads, the e2e model), see docs/tuning.md. The TurboQuant kernels are latency-bound at
# 2 warps per scheduler (register-limited occupancy), so they drop the register prefetch, which frees registers.
# Long decode splits of quantized formats run one warp per program, with twice the splits: a warp owns all 16 rows
# and the whole key tile, so the softmax and the operand exchange need no barrier, and twice the programs hide the
# latency. Dense tiles go to Triton's software pipeliner instead (3 stages: the tile loads become asynchronous
# copies into shared memory, two tiles ahead), which beat the register prefetch at every measured shape; decoded
# formats gain nothing from it, or lose (their operands are made in registers, not loaded).
_TILES = {
    "dense": ((32, 2, False, 3), (32, 2, False, 3), (64, 4, False, 3)),
    "fp8": ((64, 1, False, 1), (128, 4, False, 1), (128, 4, False, 1)),
    "turboquant_k8v4": ((64, 1, False, 1), (128, 4, False, 1), (128, 4, False, 1)),
    "mse4": ((32, 1, False, 1), (128, 4, False, 1), (128, 4, False, 1)),
    "mse3": ((32, 1, False, 1), (128, 4, False, 1), (128, 4, False, 1)),
}


# Whether the whole-tile loop without register prefetch loads the next tile's block ids ahead, per family for
# regimes 0, 1, 2 as in _TILES; keys-as-M tiles always do. It slows 4bit_nc 64-row tiles and k8v4 one-warp decode
# tiles, and speeds up fp8 and keys-as-M tiles (H200 A/B in docs/tuning.md).
_IDS_AHEAD = {
    "dense": (True, True, True),
    "fp8": (True, True, True),
    "turboquant_k8v4": (False, False, True),
    "mse4": (True, True, False),
    "mse3": (True, True, True),
}


def _family(fmt: Optional[CacheFormat]) -> str:
    if fmt is None or fmt.key_mode == "dense":
        return "dense"
    if fmt.key_mode == "fp8":
        return "fp8" if fmt.value_mode == "fp8" else "turboquant_k8v4"
    return "mse4" if fmt.key_bits == 4 else "mse3"


def _value_halves(block_m: int, fmt: Optional[CacheFormat]) -> bool:
    """Packed values as even/odd halves: at decode sizes, and up to M = 32 for fp8 keys (fewer live registers than
    MSE keys); larger tiles spill with two accumulators (docs/tuning.md)."""
    return block_m <= 16 or (block_m <= 32 and fmt is not None and fmt.key_mode == "fp8")


def _keys_as_m(block_m: int, head_dim: int, fmt: Optional[CacheFormat]) -> bool:
    """Keys as the MMA's M side (wgmma at 32 query rows): faster for 32-row tiles of quantized formats at head_dim 128;
    slower at 16 and 64 rows and for bf16 (H200 figures in docs/tuning.md)."""
    return block_m == 32 and head_dim == 128 and _family(fmt) != "dense"


def _prefetches_l2(fmt: Optional[CacheFormat], keys_as_m: bool, regime: int) -> bool:
    """Whether the tile loop asks L2 for the next tile's slots (no registers held; needs the block ids ahead): for
    quantized formats in keys-as-M and decode tiles, and fp8 everywhere; not for keys-as-M tiles of 3-bit values,
    which gain nothing alone and slow the e2e verify step, nor for 64-row tiles of the other quantized formats
    (turboquant_k8v4 slower, the MSE formats even). bf16 tiles are pipelined instead (H200 figures in
    docs/tuning.md)."""
    if _family(fmt) == "dense":
        return False
    return regime < 2 or _family(fmt) == "fp8" or (keys_as_m and fmt.value_bits != 3)


def _row_loads(fmt: Optional[CacheFormat]) -> bool:
    """Whether 3-bit keys of keys-as-M tiles load one cache row per warp-wide load (``_load_side``): faster for
    k3v4_nc; slower beside 3-bit values (3bit_nc) and in decode tiles (H200 figures in docs/tuning.md)."""
    return fmt is not None and fmt.key_mode == "mse" and fmt.key_bits == 3 and fmt.value_bits != 3


def mean_query_len(num_tokens: int, batch: int) -> int:
    """Query tokens per sequence, rounded up (0 for no tokens): what the tile rules of every kernel read."""
    return -(-num_tokens // max(batch, 1))


def query_tiles(num_tokens: int, batch: int, block_q: int) -> int:
    """Grid size over query tiles of ``block_q`` tokens: sequence b owns tiles [qsl[b] // block_q + b, ...), so the
    grid needs no tensor values (programs past a sequence's tiles exit)."""
    return num_tokens if block_q == 1 else num_tokens // block_q + batch


def split_count(programs: int, max_keys: int, num_sms: int, per_sm: int, limit: int) -> int:
    """KV splits: enough programs for about ``per_sm`` per SM, no split shorter than ~256 keys, at most ``limit``,
    a power of two (the combiner's)."""
    want = -(-per_sm * num_sms // max(1, programs))
    cap = max(1, max_keys // 256)
    splits = 1
    while splits * 2 <= min(want, cap, limit):
        splits *= 2
    return splits


# Programs of one multi-token (M >= 32) tile that fit an SM at once (registers), and the share of that wave which
# counts as full: from the split sweeps at q_len 16 in docs/tuning.md.
TILES_PER_SM = 2
FULL_WAVE = 0.9


def wave_splits(programs: int, max_keys: int, num_sms: int, limit: int, per_sm: int = TILES_PER_SM) -> int:
    """KV splits for programs of which only ``per_sm`` fit an SM at once (multi-token tiles, the CUDA kernel's
    all-heads programs): the fewest (a power of two) that fill one wave of them, no split shorter than ~256 keys, at
    most ``limit``. A second wave hides no more latency than the first, and each split costs a query prologue per
    program and a share of the combiner's partials."""
    cap = max(1, min(limit, max_keys // 256))
    splits = 1
    while splits * 2 <= cap and programs * splits < FULL_WAVE * per_sm * num_sms:
        splits *= 2
    return splits


def launch_config(num_tokens: int, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  block_size: int, max_blocks: int, num_sms: int, fmt: Optional[CacheFormat] = None,
                  block_q: Optional[int] = None) -> dict:
    """Tile sizes and split count from shapes only (never tensor values), so a CUDA graph can capture it.

    ``block_q`` (query tokens per M tile) overrides the choice from the average query length; everything that depends
    on the tile's rows follows it."""
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    avg_q = max(1, mean_query_len(num_tokens, batch))
    # M = 64 tiles (Hopper wgmma) at head_dim 64 hit an illegal address on an H200 (Triton 3.6), cause not yet
    # found; 32-row tiles there run the mma.sync path, which is correct.
    max_m = 64 if head_dim >= 128 else 32
    if block_q is None:
        block_q = max(1, min(triton.next_power_of_2(avg_q), max(1, max_m // group_pad)))
    block_m = max(16, block_q * group_pad)
    num_tiles = query_tiles(num_tokens, batch, block_q)
    if block_m > 16:
        # The grid's spare tiles (one per sequence, for unaligned starts) exit at once; count the tiles with rows.
        splits = wave_splits(-(-num_tokens // block_q) * num_kv_heads, max_blocks * block_size, num_sms, 64)
    else:
        splits = split_count(num_tiles * num_kv_heads, max_blocks * block_size, num_sms, 4, 64)
    regime = 2 if block_m > 16 else (0 if max_blocks * block_size // splits >= 512 else 1)
    block_n, num_warps, prefetch, num_stages = _TILES[_family(fmt)][regime]
    wide_verify = head_dim > 128 and block_m > 32
    if head_dim > 128:
        # Keep the [BLOCK_N, head_dim] tiles in registers. 4-bit MSE decode tiles run 2 warps (1 warp spills at
        # head_dim 256; 4 measured slower); 4-bit MSE 64-row tiles take 16 keys, which spill least (docs/tuning.md
        # "Head_dim 256").
        block_n = min(block_n, 16 if wide_verify and _family(fmt) == "mse4" else 32)
        num_warps = 2 if _family(fmt) == "mse4" and block_m <= 16 else 4
        if num_stages > 1:
            # Dense tiles: up to 32 rows keep the register prefetch; 64-row tiles, where the prefetched tile
            # spills, pipeline 2 stages (3 spill).
            prefetch, num_stages = block_m <= 32, 1 if block_m <= 32 else 2
    if num_warps < 4 and regime == 0 and _family(fmt) != "dense":
        # Quantized decode programs of fewer warps on long splits take twice the splits, to hide their latency
        # (regime 0 keeps >= 256 keys per split).
        splits = min(2 * splits, 128)
    keys_as_m = _keys_as_m(block_m, head_dim, fmt)
    ids_ahead = keys_as_m or wide_verify or _IDS_AHEAD[_family(fmt)][regime]
    return dict(group_pad=group_pad, block_q=block_q, block_m=block_m, block_n=block_n, num_tiles=num_tiles,
                num_splits=splits, num_warps=num_warps, num_stages=num_stages, key_pairs=True, pair_asm=True,
                value_halves=_value_halves(block_m, fmt), prefetch=prefetch, keys_as_m=keys_as_m,
                ids_ahead=ids_ahead, prefetch_l2=ids_ahead and _prefetches_l2(fmt, keys_as_m, regime),
                row_loads=_row_loads(fmt))


# launch_config's choices a call may override (tests, tools/attention_sweep.py), as keywords of the same names.
OVERRIDES = ("num_splits", "block_n", "num_warps", "num_stages", "key_pairs", "prefetch", "value_halves", "pair_asm",
             "keys_as_m", "ids_ahead", "prefetch_l2", "row_loads")


@dataclasses.dataclass(frozen=True)
class TritonLaunch:
    """A launch of the split-KV kernel: ``launch_config``'s tiles, splits and switches (the PTX-only switches off
    where the interpreter runs it), how the query enters (rotated in the kernel or on the host for MSE keys, split
    for fp32 queries), the dot operand dtypes, and ``maxnreg`` where a caller caps the registers."""
    group_pad: int
    block_q: int
    block_m: int
    block_n: int
    num_tiles: int
    num_splits: int
    num_warps: int
    num_stages: int
    key_pairs: bool
    pair_asm: bool
    value_halves: bool
    prefetch: bool
    keys_as_m: bool
    ids_ahead: bool
    prefetch_l2: bool
    row_loads: bool
    rotate_in_kernel: bool
    host_rotation: bool
    split_query: bool
    fp8: object
    qk_dtype: object
    pv_dtype: object
    interpreted: bool
    maxnreg: Optional[int] = None

    @property
    def writes_every_row(self) -> bool:
        """Whether the kernels write every output row: the split combiner does, and so do one-token tiles without
        splits (the spare programs are the padding tokens'); multi-token tiles without splits leave the rows of
        padding tokens (past query_start_loc[-1]) to a zero fill."""
        return self.num_splits > 1 or self.block_q == 1


def triton_launch(num_tokens: int, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  max_blocks: int, num_sms: int, fmt: CacheFormat, query_dtype: torch.dtype, interpreted: bool, *,
                  block_q: Optional[int] = None, rotate_query_in_kernel: Optional[bool] = None,
                  split_query: Optional[bool] = None, maxnreg: Optional[int] = None, **overrides) -> TritonLaunch:
    """The kernel's launch for a call: ``launch_config`` with ``overrides`` (``OVERRIDES``; None keeps the rule's)
    applied, and the host's choices for the query. ``interpreted``: the kernel runs under ``TRITON_INTERPRET=1``."""
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise TypeError(f"unknown launch overrides {unknown}; expected some of {', '.join(OVERRIDES)}")
    cfg = launch_config(num_tokens, batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_sms, fmt,
                        block_q)
    cfg.update((key, val) for key, val in overrides.items() if val is not None)
    # MSE keys: the query is rotated inside the kernel (d <= 128, a Walsh-Hadamard butterfly per program), or on the
    # host for larger head_dims. The host-side fp32 matmul is a cast plus a cuBLAS FFMA kernel; in-kernel it costs
    # each program a short prologue. Up to 4,096 query rows x heads the kernel wins; at 16,384 the two are even and
    # the host keeps it (H200 figures in docs/tuning.md).
    # fp32 queries on CUDA keep the host matmul: an in-kernel rotation without SPLIT_Q let a float32 model's compiled
    # and eager logits drift apart; SPLIT_Q removes the likely cause (16-bit rounding of the rotated query), which is
    # not measured yet (docs/tuning.md).
    if rotate_query_in_kernel is None:
        rotate_query_in_kernel = num_tokens * num_q_heads <= 4096 and (interpreted or query_dtype != torch.float32)
    rotate_in_kernel = fmt.key_mode == "mse" and head_dim <= 128 and rotate_query_in_kernel
    if split_query is None:
        split_query = query_dtype == torch.float32 and not interpreted
    if interpreted:
        # The interpreter's bf16 matmul is unreliable; fp32 keeps it exact enough to compare.
        qk_dtype = pv_dtype = tl.float32
    else:
        dense = tl.bfloat16 if fmt.dense_dtype == torch.bfloat16 else tl.float16
        qk_dtype = dense if fmt.key_mode == "dense" else tl.float16  # fp8 and centroids are exact in fp16
        pv_dtype = dense if fmt.value_mode == "dense" else tl.float16  # fp8 and small integer codes too
    # The PTX paths (byte-permute decoders, L2 prefetch) are inline assembly, which the interpreter cannot run; the
    # prefetch changes no output bit (test_gpu.py).
    cfg.update(pair_asm=cfg["pair_asm"] and not interpreted, prefetch_l2=cfg["prefetch_l2"] and not interpreted)
    return TritonLaunch(**cfg, rotate_in_kernel=rotate_in_kernel,
                        host_rotation=fmt.key_mode == "mse" and not rotate_in_kernel, split_query=split_query,
                        fp8=tl.float8e5 if fmt.fp8_dtype == torch.float8_e5m2 else tl.float8e4nv, qk_dtype=qk_dtype,
                        pv_dtype=pv_dtype, interpreted=interpreted, maxnreg=maxnreg)
