"""The split-KV paged attention kernel: one program per (query tile, kv head, split) over whole and masked key tiles."""
from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from ..kv.codecs import MODE_FP8, MODE_MSE, MODE_UNIFORM, fwht_rows
from ..pdl import pdl_launch_dependents, pdl_wait
from .decoders import _interleave, _word_major
from .tiles import _attend_tile, _block_rows, _key_partials, _load_tile, _prefetch_l2


class CacheLayout(NamedTuple):
    """Byte strides of the cache [num_blocks, block_size, num_kv_heads, slot_bytes] and its geometry. As constants,
    the compiler knows each row's alignment and widens the loads."""
    block_stride: int
    slot_stride: int
    head_stride: int
    block_size: int
    head_dim: int
    log2_head_dim: int


class Side(NamedTuple):
    """How one side (keys or values) of a slot is stored: mode (MODE_*), bits per code, and the byte offsets in the
    slot of its codes and of its fp16 extras (the MSE key norm; the value scale, then the zero point)."""
    mode: int
    bits: int
    offset: int
    aux_offset: int


class Tile(NamedTuple):
    """A program's work: BLOCK_Q query tokens x the GQA group (padded to a power of two) as BLOCK_M rows, keys in
    BLOCK_N tiles, the key range cut into NUM_SPLITS."""
    block_q: int
    block_m: int
    block_n: int
    group: int
    group_pad: int
    num_splits: int


class Visibility(NamedTuple):
    """Which keys a query sees: causal, a sliding window (the ``window`` argument), per-head sink logits."""
    causal: bool
    has_window: bool
    has_sinks: bool


class Operands(NamedTuple):
    """Dot operand dtypes (Triton dtypes) and how the query enters: rotated in the kernel for MSE keys (rotate_q),
    split into a 16-bit head and remainder for fp32 queries (split_q)."""
    fp8: object
    qk_dtype: object
    pv_dtype: object
    rotate_q: bool
    split_q: bool


class Switches(NamedTuple):
    """The tuning switches launch.launch_config picks per format and regime (docs/tuning.md has the evidence)."""
    key_pairs: bool
    pair_asm: bool
    value_halves: bool
    keys_as_m: bool
    prefetch: bool
    ids_ahead: bool
    prefetch_l2: bool
    row_loads: bool


@triton.jit
def _paged_attention_kernel(
    q_ptr, stride_qt, stride_qh,
    cache_u8, cache_16,
    bt_ptr, stride_bt,
    seq_lens_ptr, qsl_ptr, sinks_ptr, cent_ptr, pair_ptr, signs_ptr,
    out_ptr, stride_os, stride_ot, stride_oh,
    ml_ptr,
    qk_scale, v_scale, window,
    num_seqs, num_tokens, num_blocks, max_blocks,
    LAYOUT: tl.constexpr, KEYS: tl.constexpr, VALUES: tl.constexpr, TILE: tl.constexpr, SEES: tl.constexpr,
    OPERANDS: tl.constexpr, SWITCHES: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Attention of one query tile over one split of its keys, for one kv head; see the NamedTuples above for the
    constant groups (LAYOUT: CacheLayout, KEYS/VALUES: Side, TILE: Tile, SEES: Visibility, OPERANDS: Operands,
    SWITCHES: Switches)."""
    HEAD_DIM: tl.constexpr = LAYOUT.head_dim
    BLOCK_SIZE: tl.constexpr = LAYOUT.block_size
    BLOCK_Q: tl.constexpr = TILE.block_q
    BLOCK_M: tl.constexpr = TILE.block_m
    BLOCK_N: tl.constexpr = TILE.block_n
    GROUP_PAD: tl.constexpr = TILE.group_pad
    NUM_SPLITS: tl.constexpr = TILE.num_splits
    CAUSAL: tl.constexpr = SEES.causal
    HAS_WINDOW: tl.constexpr = SEES.has_window
    KEY_MODE: tl.constexpr = KEYS.mode
    KEY_BITS: tl.constexpr = KEYS.bits
    KEYS_AS_M: tl.constexpr = SWITCHES.keys_as_m
    pdl_wait(USE_PDL)  # USE_PDL: launched early after a one-row step's store (tqops.pdl)
    pdl_launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence b owns query tiles [start(b), start(b+1)) with start(b) = qsl[b] // BLOCK_Q + b: a static grid.
    # Tensors from the start: ints equal to 1 are specialized to constants, which cannot be loop-carried.
    lo = tl.full([], 0, tl.int32)
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if BLOCK_Q == 1:
            mid_start = tl.load(qsl_ptr + mid)
        else:
            mid_start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        ok = mid_start <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    b = lo
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if BLOCK_Q == 1:
        q_tile = pid - q_start
    else:
        q_tile = (pid - (q_start // BLOCK_Q + b)) * BLOCK_Q
    if q_tile >= q_len:
        if NUM_SPLITS == 1 and BLOCK_Q == 1:
            # One program per token, so the programs past the last sequence are the padding tokens' (pid >=
            # query_start_loc[-1]): they write those rows' zeros, and the output needs no fill beforehand.
            offs_z = tl.arange(0, BLOCK_M)
            zero_row = offs_z < TILE.group  # the grid has num_tokens tiles: pid is a token
            z_row = out_ptr + pid.to(tl.int64) * stride_ot + (kvh * TILE.group + offs_z)[:, None] * stride_oh
            tl.store(z_row + tl.arange(0, HEAD_DIM)[None, :],
                     tl.zeros([BLOCK_M, HEAD_DIM], dtype=out_ptr.dtype.element_ty), mask=zero_row[:, None])
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    qi = offs_m // GROUP_PAD
    hg = offs_m % GROUP_PAD
    q_local = q_tile + qi
    token = q_start + q_local
    row_ok = (qi < BLOCK_Q) & (q_local < q_len) & (hg < TILE.group) & (token >= 0) & (token < num_tokens)
    head = kvh * TILE.group + hg
    pos = ctx + q_local
    offs_d = tl.arange(0, HEAD_DIM)
    q_row = q_ptr + token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    if OPERANDS.rotate_q:
        # Scores of MSE keys live in the rotated space: q_rot = q @ R^T = (q * signs) @ H / sqrt(d), as a
        # Walsh-Hadamard butterfly in fp32 registers (signs_ptr: the +-1 signs), no d x d operand per program.
        LOG2_A: tl.constexpr = LAYOUT.log2_head_dim - 3
        q_s = tl.load(q_row + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        q_s = q_s * tl.load(signs_ptr + offs_d)[None, :]
        x = tl.permute(tl.reshape(q_s, (BLOCK_M, HEAD_DIM // 8, 8)), (1, 0, 2))
        x = fwht_rows(x, HEAD_DIM // 8, BLOCK_M, 8, LOG2_A, 3)
        q32 = tl.reshape(tl.permute(x, (1, 0, 2)), (BLOCK_M, HEAD_DIM)) * (1.0 / tl.sqrt(HEAD_DIM * 1.0))
    else:
        q32 = tl.load(q_row + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q = q32.to(OPERANDS.qk_dtype)
    if OPERANDS.split_q:
        # fp32 queries as a 16-bit head plus a 16-bit remainder: the scores keep ~fp32 precision instead of
        # jumping at 16-bit rounding boundaries (which made compiled and eager fp32 models drift apart).
        q_lo = (q32 - q.to(tl.float32)).to(OPERANDS.qk_dtype)
    else:
        q_lo = q

    # Keys this tile can see, then this split's share of them (whole BLOCK_N tiles).
    tile_last = tl.minimum(q_tile + BLOCK_Q, q_len) - 1
    kv_end = tl.minimum(seq_len, max_blocks * BLOCK_SIZE)
    if CAUSAL:
        kv_end = tl.minimum(kv_end, ctx + tile_last + 1)
    kv_begin = 0
    if HAS_WINDOW:
        kv_begin = tl.maximum(ctx + q_tile - window + 1, 0)
        if not CAUSAL:
            kv_end = tl.minimum(kv_end, ctx + tile_last + window)
    kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
    n_keys = tl.maximum(kv_end - kv_begin, 0)
    per_split = tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_begin = kv_begin + split * per_split
    s_end = tl.minimum(kv_end, s_begin + per_split)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    # value_halves: packed (uniform) values stay as even / odd channel halves with one accumulator each, interleaved
    # once after the loop; see _value_halves for when.
    # fp8-key formats keep the halves (faster there); MSE formats decode value pairs with byte permutes instead.
    HALVES: tl.constexpr = (VALUES.mode == MODE_UNIFORM and SWITCHES.value_halves
                            and not (SWITCHES.pair_asm and KEY_MODE == MODE_MSE) and not KEYS_AS_M)
    ACC_W: tl.constexpr = HEAD_DIM // 2 if HALVES else HEAD_DIM
    KEY_ROW_LOADS: tl.constexpr = KEYS_AS_M and SWITCHES.row_loads  # decode tiles are slower with them (_row_loads)
    if KEYS_AS_M:
        # The transposed query is the wgmma's B operand, in shared memory for the whole loop.
        if KEY_MODE == MODE_MSE and KEY_BITS == 3:
            q = _word_major(q, BLOCK_M, HEAD_DIM)  # the channel order of the decoded 3-bit keys
            q_lo = _word_major(q_lo, BLOCK_M, HEAD_DIM)
        q = tl.trans(q)
        q_lo = tl.trans(q_lo)
        acc = tl.zeros([HEAD_DIM, BLOCK_M], dtype=tl.float32)
        # The softmax denominator (l_i) and the values' zero-point term (acc_odd) are per-thread partial sums over
        # keys (_key_partials), added up once after the loop.
        l_i = _key_partials(tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), BLOCK_N)
        acc_odd = l_i
    else:
        acc = tl.zeros([BLOCK_M, ACC_W], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_odd = tl.zeros([BLOCK_M, ACC_W], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kvh_off = kvh.to(tl.int64) * LAYOUT.head_stride

    # Tiles every row sees whole (past the window start, before the causal diagonal, inside the split) skip the
    # masks: the score select, the causal and window compares, and the masked loads. The others, at most a few per
    # program, run masked in a second loop (docs/tuning.md, "Whole tiles without masks").
    # Never negative: a far-negative s_end (garbage seq_lens or query_start_loc) would otherwise put the first tile
    # before key 0, and its block-table read before the table.
    n_tiles = tl.maximum(tl.cdiv(s_end - s_begin, BLOCK_N), 0)
    full_hi = s_end
    if CAUSAL:
        full_hi = tl.minimum(full_hi, ctx + q_tile + 1)
    full_lo = s_begin
    if HAS_WINDOW:
        full_lo = tl.maximum(full_lo, ctx + tile_last - window + 1)
        if not CAUSAL:
            full_hi = tl.minimum(full_hi, ctx + q_tile + window)
    first_full = tl.minimum(tl.cdiv(tl.maximum(full_lo - s_begin, 0), BLOCK_N), n_tiles)
    end_full = tl.minimum(tl.maximum(tl.maximum(full_hi - s_begin, 0) // BLOCK_N, first_full), n_tiles)
    full_begin = s_begin + first_full * BLOCK_N
    full_end = s_begin + end_full * BLOCK_N

    # Software pipeline in registers (prefetch): the loads of tile i+1 are in flight while tile i is computed, so
    # the block-table -> cache dependency and the DRAM latency overlap the dequantization and the dots. It costs
    # registers, hence occupancy; without it, other resident programs hide the latency. The tile loaded after the
    # last one is never used; its rows are clamped into the cache like every other row.
    # Whole tiles run unmasked, so out-of-range block-table entries (_block_rows' ``bad``) are only collected there,
    # an OR per tile; where any turn up, the partial result is discarded and every tile runs masked below.
    if BLOCK_N <= BLOCK_SIZE:
        dropped = tl.full([], 0, tl.int32)
    else:
        dropped = tl.zeros([BLOCK_N], dtype=tl.int32)
    if SWITCHES.prefetch or SWITCHES.ids_ahead:
        row, n_ok, bad = _block_rows(bt_row, full_begin, s_end, kvh_off, num_blocks, max_blocks, LAYOUT, BLOCK_N)
    if SWITCHES.prefetch:
        tile = _load_tile(cache_u8, cache_16, row, n_ok, KEYS, VALUES, HEAD_DIM, False, KEY_ROW_LOADS)
        for start in range(full_begin, full_end, BLOCK_N):
            next_row, next_ok, next_bad = _block_rows(bt_row, start + BLOCK_N, s_end, kvh_off, num_blocks, max_blocks,
                                                      LAYOUT, BLOCK_N)
            next_tile = _load_tile(cache_u8, cache_16, next_row, next_ok, KEYS, VALUES, HEAD_DIM, False,
                                   KEY_ROW_LOADS)
            m_i, l_i, acc, acc_odd = _attend_tile(
                q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, tile, qk_scale, window, cent_ptr, pair_ptr,
                False, HALVES, BLOCK_N, HEAD_DIM, KEYS, VALUES, SEES, OPERANDS, SWITCHES)
            dropped = dropped | bad
            n_ok, bad, tile = next_ok, next_bad, next_tile
    else:
        # ids_ahead: only the block ids of the next tile are loaded ahead, which takes their latency off each tile's
        # chain of dependent loads (block id -> codes) for two registers. It slows 64-row 4bit_nc tiles and
        # one-warp k8v4 decode tiles, so it is chosen per family and regime (_IDS_AHEAD).
        for start in range(full_begin, full_end, BLOCK_N):
            if SWITCHES.ids_ahead:
                next_row, next_ok, next_bad = _block_rows(bt_row, start + BLOCK_N, s_end, kvh_off, num_blocks,
                                                          max_blocks, LAYOUT, BLOCK_N)
            else:
                row, n_ok, bad = _block_rows(bt_row, start, s_end, kvh_off, num_blocks, max_blocks, LAYOUT, BLOCK_N)
            tile = _load_tile(cache_u8, cache_16, row, n_ok, KEYS, VALUES, HEAD_DIM, False, KEY_ROW_LOADS)
            if SWITCHES.ids_ahead and SWITCHES.prefetch_l2:
                _prefetch_l2(cache_u8, next_row, LAYOUT.head_stride)
            m_i, l_i, acc, acc_odd = _attend_tile(
                q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, tile, qk_scale, window, cent_ptr, pair_ptr,
                False, HALVES, BLOCK_N, HEAD_DIM, KEYS, VALUES, SEES, OPERANDS, SWITCHES)
            dropped = dropped | bad
            if SWITCHES.ids_ahead:
                row, n_ok, bad = next_row, next_ok, next_bad
    if BLOCK_N <= BLOCK_SIZE:
        redo = dropped != 0
    else:
        redo = tl.max((dropped != 0).to(tl.int32), 0) != 0
    m_i = tl.where(redo, -1.0e30, m_i)
    l_i = tl.where(redo, 0.0, l_i)
    acc = tl.where(redo, 0.0, acc)
    acc_odd = tl.where(redo, 0.0, acc_odd)
    first_full = tl.where(redo, n_tiles, first_full)
    end_full = tl.where(redo, n_tiles, end_full)
    for t in range(0, n_tiles - end_full + first_full):
        start = s_begin + tl.where(t < first_full, t, t - first_full + end_full) * BLOCK_N
        row, n_ok, bad = _block_rows(bt_row, start, s_end, kvh_off, num_blocks, max_blocks, LAYOUT, BLOCK_N)
        tile = _load_tile(cache_u8, cache_16, row, n_ok, KEYS, VALUES, HEAD_DIM, True, KEY_ROW_LOADS)
        m_i, l_i, acc, acc_odd = _attend_tile(
            q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, tile, qk_scale, window, cent_ptr, pair_ptr,
            True, HALVES, BLOCK_N, HEAD_DIM, KEYS, VALUES, SEES, OPERANDS, SWITCHES)

    if VALUES.mode == MODE_FP8:
        acc = acc * v_scale
    if HALVES:
        acc = _interleave(acc, acc_odd, BLOCK_M, HEAD_DIM)
    if KEYS_AS_M:
        acc = tl.trans(acc + tl.sum(tl.sum(acc_odd, 1), 0)[None, :])
        l_i = tl.sum(tl.sum(l_i, 1), 0)
    out_row = token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS == 1:
        if SEES.has_sinks:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            corr = tl.exp2(m_i - m_f)
            l_i = l_i * corr + tl.exp2(sink - m_f)
            acc = acc * corr[:, None]
        inv = tl.where(l_i > 0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)[:, None]
        tl.store(out_ptr + out_row, (acc * inv).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(out_ptr + split * stride_os + out_row, acc, mask=row_ok[:, None])
        ml_off = ((split * num_tokens + token.to(tl.int64)) * (stride_ot // HEAD_DIM) + head) * 2
        tl.store(ml_ptr + ml_off, m_i, mask=row_ok)
        tl.store(ml_ptr + ml_off + 1, l_i, mask=row_ok)
