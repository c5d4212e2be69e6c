"""Triton split-KV paged attention over every cache format, with query tokens x GQA group as the M tile."""
from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl

from ..checks import INT32_MAX, narrow_int32
from ..formats import CacheFormat
from ..kv.codecs import KEY_MODES, VALUE_MODES
from ..quant import rotation_matrix
from ..pdl import pdl_launch_args
from . import constants as dc
from .combine import combine_splits
from .kernel import CacheLayout, Operands, Side, Switches, Tile, Visibility, _paged_attention_kernel
from .launch import launch_config


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


def _interpreted() -> bool:
    # Decided when the kernel was decorated (TRITON_INTERPRET at import), as for the store kernels.
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_paged_attention_kernel, InterpretedFunction)


def int32_indices(block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels read int32 indices; int64 ones (torch.tensor's default) are narrowed here without wrapping (a plain
    cast reads 2**32 + 1 as 1), so a value past int32 is out of range as the CPU op treats it: a block entry becomes
    -1 (its keys are dropped), seq_lens are clamped to [0, 2**31 - 1] (past every block table; a negative one sees no
    key, as 0 does) and query_start_loc saturates at the int32 bounds (past every token). A no-op for int32; no host
    sync, so it runs inside captured graphs."""
    seq_lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.clamp(0, INT32_MAX).to(torch.int32)
    return narrow_int32(block_table, out_of_range=-1), seq_lens, narrow_int32(query_start_loc)


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    fmt: CacheFormat,
    causal: bool,
    sliding_window: Optional[int],
    sinks: Optional[torch.Tensor],
    scale: float,
    k_scale: float,
    v_scale: float,
    *,
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    block_q: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    key_pairs: Optional[bool] = None,
    prefetch: Optional[bool] = None,
    rotate_query_in_kernel: Optional[bool] = None,
    split_query: Optional[bool] = None,
    value_halves: Optional[bool] = None,
    pair_asm: Optional[bool] = None,
    maxnreg: Optional[int] = None,
    keys_as_m: Optional[bool] = None,
    ids_ahead: Optional[bool] = None,
    prefetch_l2: Optional[bool] = None,
    row_loads: Optional[bool] = None,
) -> torch.Tensor:
    """Launch the split-KV kernel (plus the split combiner); same contract as ``paged_attention_naive``.

    Also runs on CPU tensors under ``TRITON_INTERPRET=1``. The keyword overrides are for tests and tuning.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    batch, max_blocks = block_table.shape
    block_table, seq_lens, query_start_loc = int32_indices(block_table, seq_lens, query_start_loc)
    if num_tokens == 0 or batch == 0:
        return torch.zeros_like(query, memory_format=torch.contiguous_format)
    device = query.device
    interp = _interpreted()
    num_sms = 132 if interp else dc.sm_count(dc.device_index(device))
    cfg = launch_config(num_tokens, batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_sms,
                        fmt, block_q)
    for key, val in (("num_splits", num_splits), ("block_n", block_n), ("num_warps", num_warps),
                     ("num_stages", num_stages), ("key_pairs", key_pairs),
                     ("prefetch", prefetch), ("value_halves", value_halves), ("pair_asm", pair_asm),
                     ("keys_as_m", keys_as_m), ("ids_ahead", ids_ahead), ("prefetch_l2", prefetch_l2),
                     ("row_loads", row_loads)):
        if val is not None:
            cfg[key] = val
    splits = cfg["num_splits"]
    # Rows of tokens past query_start_loc[-1] (padding) are 0. The split combiner writes every row, and so do
    # one-token tiles without splits (the spare programs are the padding tokens'); only multi-token tiles without
    # splits leave them unwritten, and they get the fill.
    writes_every_row = splits > 1 or cfg["block_q"] == 1
    out = (torch.empty_like if writes_every_row else torch.zeros_like)(query, memory_format=torch.contiguous_format)

    key_mode, value_mode = KEY_MODES[fmt.key_mode], VALUE_MODES[fmt.value_mode]
    q = query
    # MSE keys: the query is rotated inside the kernel (d <= 128, a Walsh-Hadamard butterfly per program), or here
    # for larger head_dims. The host-side fp32 matmul is a cast plus a cuBLAS FFMA kernel; in-kernel it costs each
    # program a short prologue. Up to 4,096 query rows x heads the kernel wins; at 16,384 the two are even and the
    # host keeps it (H200 figures in docs/tuning.md).
    # fp32 queries on CUDA keep the host matmul: an in-kernel rotation without SPLIT_Q let a float32 model's compiled
    # and eager logits drift apart; SPLIT_Q removes the likely cause (16-bit rounding of the rotated query), which is
    # not measured yet (docs/tuning.md).
    if rotate_query_in_kernel is None:
        rotate_query_in_kernel = num_tokens * num_q_heads <= 4096 and (interp or query.dtype != torch.float32)
    rotate_in_kernel = fmt.key_mode == "mse" and head_dim <= 128 and rotate_query_in_kernel
    if fmt.key_mode == "mse" and not rotate_in_kernel:
        q = query.float() @ rotation_matrix(head_dim, device)
    signs = dc.rotation_signs(head_dim, device) if rotate_in_kernel else None
    if split_query is None:
        split_query = query.dtype == torch.float32 and not interp
    if interp:
        # The interpreter's bf16 matmul is unreliable; fp32 keeps it exact enough to compare.
        qk_dtype = pv_dtype = tl.float32
    else:
        dense = tl.bfloat16 if fmt.dense_dtype == torch.bfloat16 else tl.float16
        qk_dtype = dense if fmt.key_mode == "dense" else tl.float16  # fp8 and centroids are exact in fp16
        pv_dtype = dense if fmt.value_mode == "dense" else tl.float16  # fp8 and small integer codes too
    fp8 = tl.float8e5 if fmt.fp8_dtype == torch.float8_e5m2 else tl.float8e4nv
    cache_16 = kv_cache.view(fmt.dense_dtype or torch.float16)
    cent = dc.centroids(fmt.key_bits if fmt.key_mode == "mse" else 4, torch.float32 if interp else torch.float16,
                      device)
    pairs = dc.centroid_pairs(4, device) if fmt.key_mode == "mse" and fmt.key_bits == 4 else cent
    qk_scale = scale * dc.LOG2E * (k_scale if fmt.key_mode == "fp8" else 1.0)
    sinks_arg = sinks if sinks is not None else cent  # never read without HAS_SINKS

    if splits == 1:
        target, ml = out, cent
        stride_os = 0
    else:
        target = torch.empty((splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=device)
        ml = torch.empty((splits, num_tokens, num_q_heads, 2), dtype=torch.float32, device=device)
        stride_os = target.stride(0)
    grid = (cfg["num_tiles"], num_kv_heads, splits)
    _paged_attention_kernel[grid](
        q, q.stride(0), q.stride(1),
        kv_cache, cache_16,
        block_table, block_table.stride(0),
        seq_lens, query_start_loc, sinks_arg, cent, pairs, signs if signs is not None else cent,
        target, stride_os, num_q_heads * head_dim, head_dim,
        ml,
        qk_scale, v_scale, sliding_window or 0,
        batch, num_tokens, num_blocks, max_blocks,
        LAYOUT=CacheLayout(kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_size, head_dim,
                           head_dim.bit_length() - 1),
        KEYS=Side(key_mode, fmt.key_bits, 0, fmt.key_norm_offset(head_dim)),
        VALUES=Side(value_mode, fmt.value_bits, fmt.value_offset(head_dim), fmt.value_scale_offset(head_dim)),
        TILE=Tile(cfg["block_q"], cfg["block_m"], cfg["block_n"], num_q_heads // num_kv_heads, cfg["group_pad"],
                  splits),
        SEES=Visibility(causal, sliding_window is not None, sinks is not None),
        OPERANDS=Operands(fp8, qk_dtype, pv_dtype, rotate_in_kernel, split_query),
        # The PTX paths (byte-permute decoders, L2 prefetch) are inline assembly, which the interpreter cannot run;
        # the prefetch changes no output bit (test_gpu.py).
        SWITCHES=Switches(cfg["key_pairs"], cfg["pair_asm"] and not interp, cfg["value_halves"], cfg["keys_as_m"],
                          cfg["prefetch"], cfg["ids_ahead"], cfg["prefetch_l2"] and not interp, cfg["row_loads"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch_args(device, num_tokens == 1),
        **({} if maxnreg is None else dict(maxnreg=maxnreg)),
    )
    if splits > 1:
        combine_splits(target, ml, sinks, query_start_loc, out, batch)
    return out
