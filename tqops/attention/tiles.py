"""One key tile of paged attention: block-table rows, tile loads, visibility masks and the online-softmax step."""
from __future__ import annotations

import triton
import triton.language as tl

from ..kv.codecs import MODE_DENSE, MODE_FP8, MODE_MSE, MODE_UNIFORM
from .decoders import _code_halves, _decode_side, _halfword, _uniform, _uniform_values


@triton.jit
def _load_side(cache_u8, cache_16, row, n_ok, MODE: tl.constexpr, BITS: tl.constexpr, HEAD_DIM: tl.constexpr,
               MASKED: tl.constexpr, ROW_PER_LOAD: tl.constexpr = False):
    """Issue the loads of one side (K or V) of a tile at byte offsets ``row`` [BLOCK_N]; consumes nothing.

    Returns the raw tile: dense/fp8 -> elements [N, D]; 4-bit -> bytes [N, D/2]; 3-bit -> int32 nibble words [N, D/8],
    one per 8-channel group (channel 8g + k in bits 4k .. 4k + 2, bit 4k + 3 clear).
    Unmasked (MASKED=False) is safe wherever garbage cannot reach the output: every row address is inside the cache
    (block ids are clamped), keys of masked rows only make scores that are replaced by -inf, and packed value codes
    decode to finite numbers that get zero probability, scale and zero point. Dense and fp8 values stay masked: a
    NaN times probability 0 is still NaN.
    """
    m2 = n_ok[:, None]
    if MODE == MODE_DENSE:
        ptr = cache_16 + (row // 2)[:, None] + tl.arange(0, HEAD_DIM)[None, :]
        raw = tl.load(ptr, mask=m2, other=0.0) if MASKED else tl.load(ptr)
    elif MODE == MODE_FP8:
        ptr = cache_u8 + row[:, None] + tl.arange(0, HEAD_DIM)[None, :]
        raw = tl.load(ptr, mask=m2, other=0) if MASKED else tl.load(ptr)
    elif BITS == 4:
        raw = tl.load(cache_u8 + row[:, None] + tl.arange(0, HEAD_DIM // 2)[None, :])
    else:
        # Chunk c is 3 halfwords holding groups c and c + HEAD_DIM / 16 (naive.pack_codes): the codes of halfword q
        # sit in the low 3 bits of its nibbles, and the bit 3s of all three make the chunk's last 4 codes. So the
        # nibble words the decoders take are a few masks away, and the two groups of a chunk are HEAD_DIM / 16
        # apart, which in the word-major key operand is the same thread: the decoded keys stay in registers instead
        # of going through shared memory (docs/tuning.md, "3-bit code layout").
        # Rows are 2-byte aligned. Offsets of stride 3 have no contiguity, so Triton lays the pointer tile out with
        # its first axis fastest: as [chunks, rows] a warp's loads cover a few whole rows; as [rows, chunks] every
        # load would touch 32 rows.
        if ROW_PER_LOAD:
            # Each chunk as 4 halfwords, the 4th being the next chunk's first or, after the last chunk, the field
            # that follows the codes in the slot (norm or scale), so no mask is needed. With the halfword axis
            # fastest, a warp's load reads one row (2 sectors); over [chunks, rows] each load reads 2 sectors of
            # 4 rows, and the 3 loads of a chunk read each sector 3 times. The halfwords then reach one thread per
            # chunk through shared memory. Used for the keys of keys-as-M tiles (_row_loads); 3-bit values loaded
            # this way cost far more loop instructions than they save (docs/tuning.md).
            ptr = (cache_16 + (row // 2)[None, None, :] + 3 * tl.arange(0, HEAD_DIM // 16)[:, None, None]
                   + tl.arange(0, 4)[None, :, None])
            hw = tl.permute(tl.load(ptr), (2, 0, 1))
            ha, hb = tl.split(tl.reshape(hw, (row.shape[0], HEAD_DIM // 16, 2, 2)))
            h0, h2 = tl.split(ha)
            h1, _ = tl.split(hb)
            h0 = _halfword(h0)
            h1 = _halfword(h1)
            h2 = _halfword(h2)
        else:
            ptr = cache_16 + (row // 2)[None, :] + 3 * tl.arange(0, HEAD_DIM // 16)[:, None]
            h0 = tl.trans(_halfword(tl.load(ptr)))
            h1 = tl.trans(_halfword(tl.load(ptr + 1)))
            h2 = tl.trans(_halfword(tl.load(ptr + 2)))
        top = ((h0 >> 3) & 0x1111) | ((h1 >> 2) & 0x2222) | ((h2 >> 1) & 0x4444)
        low = ((h1 << 16) | h0) & 0x77777777
        high = ((top << 16) | h2) & 0x77777777
        raw = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (row.shape[0], HEAD_DIM // 8))
    return raw


@triton.jit
def _load_aux(cache_16, byte_off, n_ok, ENABLED: tl.constexpr, MASKED: tl.constexpr):
    """One fp16 per row (MSE norm, value scale or zero point) at byte offsets [BLOCK_N]; zeros when unused."""
    if ENABLED and MASKED:
        return tl.load(cache_16 + byte_off // 2, mask=n_ok, other=0.0)
    elif ENABLED:
        return tl.load(cache_16 + byte_off // 2)
    else:
        return tl.zeros(byte_off.shape, cache_16.dtype.element_ty)


@triton.jit
def _block_rows(bt_row, start, s_end, kvh_off, num_blocks, max_blocks, LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Byte offsets [BLOCK_N] (int64) of the cache rows of keys start .. start + BLOCK_N, their mask (the key is
    before ``s_end`` and its block-table entry lies in [0, num_blocks)), and ``bad``: nonzero where an entry does not
    (a scalar when the tile sits in one block, else [BLOCK_N]).

    ``start`` is a multiple of BLOCK_N, so a row's block and its place in the block split into a scalar and a
    loop-invariant part: no per-row division, and one 64-bit multiply per distinct block.
    """
    BLOCK_SIZE: tl.constexpr = LAYOUT.block_size
    STRIDE_CB: tl.constexpr = LAYOUT.block_stride
    STRIDE_CS: tl.constexpr = LAYOUT.slot_stride
    j = tl.arange(0, BLOCK_N)
    # Clamp block ids: garbage table entries must never address outside the cache; the mask drops their keys.
    if BLOCK_N <= BLOCK_SIZE:
        blk = tl.load(bt_row + tl.minimum(start // BLOCK_SIZE, max_blocks - 1))
        safe = tl.minimum(tl.maximum(blk, 0), num_blocks - 1)
        n_ok = j < tl.where(blk == safe, s_end - start, 0)
        base = safe.to(tl.int64) * STRIDE_CB + kvh_off + (start % BLOCK_SIZE) * STRIDE_CS
        row = base + j * STRIDE_CS
    else:
        blk = tl.load(bt_row + tl.minimum(start // BLOCK_SIZE + j // BLOCK_SIZE, max_blocks - 1))
        safe = tl.minimum(tl.maximum(blk, 0), num_blocks - 1)
        n_ok = (j < s_end - start) & (blk == safe)
        row = safe.to(tl.int64) * STRIDE_CB + (kvh_off + (j % BLOCK_SIZE) * STRIDE_CS)
    return row, n_ok, blk ^ safe


_PREFETCH_L2_ASM = tl.constexpr("prefetch.global.L2 [$1];\nmov.u32 $0, 0;")


@triton.jit
def _prefetch_l2(cache_u8, row, SLOT_BYTES: tl.constexpr):
    """Ask L2 for the cache slots at byte offsets ``row`` [BLOCK_N] (every 128-byte line of each), holding no
    registers: the next tile's codes then arrive from L2 instead of DRAM. Returns nothing the caller uses."""
    for off in tl.static_range(0, SLOT_BYTES - 1, 128):
        tl.inline_asm_elementwise(_PREFETCH_L2_ASM, "=r,l", [cache_u8 + row + off], dtype=tl.int32, is_pure=False,
                                  pack=1)
    tl.inline_asm_elementwise(_PREFETCH_L2_ASM, "=r,l", [cache_u8 + row + (SLOT_BYTES - 1)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _load_tile(cache_u8, cache_16, row, n_ok, KEYS: tl.constexpr, VALUES: tl.constexpr, HEAD_DIM: tl.constexpr,
               MASKED: tl.constexpr, KEY_ROW_LOADS: tl.constexpr):
    """Issue every load of the key tile at cache rows ``row`` (``_block_rows``) -> (K raw tile, V raw tile, key norm,
    value scale, value zero point). MASKED=False: the tile is whole (every row is a key before ``s_end``), so no load
    needs a mask. KEYS, VALUES: kernel.Side."""
    k_raw = _load_side(cache_u8, cache_16, row + KEYS.offset, n_ok, KEYS.mode, KEYS.bits, HEAD_DIM, False,
                       KEY_ROW_LOADS)
    v_raw = _load_side(cache_u8, cache_16, row + VALUES.offset, n_ok, VALUES.mode, VALUES.bits, HEAD_DIM,
                       MASKED and VALUES.mode != MODE_UNIFORM)
    kn = _load_aux(cache_16, row + KEYS.aux_offset, n_ok, KEYS.mode == MODE_MSE, MASKED)
    vs = _load_aux(cache_16, row + VALUES.aux_offset, n_ok, VALUES.mode == MODE_UNIFORM, MASKED)
    vz = _load_aux(cache_16, row + VALUES.aux_offset + 2, n_ok, VALUES.mode == MODE_UNIFORM, MASKED)
    return k_raw, v_raw, kn, vs, vz


@triton.jit
def _visible(key_pos, q_pos, key_ok, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Which (query, key) pairs attend, from broadcastable key positions, query positions and key-row mask, in
    whichever orientation the scores have ([rows, keys] or [keys, rows])."""
    vis = key_ok
    if CAUSAL:
        vis = vis & (key_pos <= q_pos)
    if HAS_WINDOW:
        vis = vis & (q_pos - key_pos < window)
        if not CAUSAL:
            vis = vis & (key_pos - q_pos < window)
    return vis


@triton.jit
def _online_softmax(s, m_i, KEY_AXIS: tl.constexpr):
    """Scores in log2 units with the keys along KEY_AXIS -> (p, the rescale of earlier tiles, running max). The
    caller sums p its own way (a row sum, or per-thread partials with keys as M)."""
    m_new = tl.maximum(m_i, tl.max(s, KEY_AXIS))
    return tl.exp2(s - tl.expand_dims(m_new, KEY_AXIS)), tl.exp2(m_i - m_new), m_new


@triton.jit
def _key_partials(x, BLOCK_N: tl.constexpr):
    """Partial sums over the keys of ``x`` [BLOCK_N, BLOCK_M] -> [4, 8, BLOCK_M] (BLOCK_N % 64 == 0, else
    [1, 1, BLOCK_M]): only the keys one thread holds in the wgmma accumulator layout (key = rep * 64 + warp * 16 +
    half * 8 + lane // 4) are added, so no shuffle or cross-warp exchange; the sum over the partials runs once after
    the loop."""
    if BLOCK_N % 64 == 0:
        return tl.sum(tl.sum(tl.reshape(x, (BLOCK_N // 64, 4, 2, 8, x.shape[1])), 2), 0)
    else:
        return tl.sum(x, 0)[None, None, :]


@triton.jit
def _attend_tile_keys_as_m(q_t, q_lo_t, m_i, l_i, acc_t, z_part, start, n_ok, pos, tile, qk_scale, window, cent_ptr,
                           pair_ptr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                           KEYS: tl.constexpr, VALUES: tl.constexpr, SEES: tl.constexpr, OPERANDS: tl.constexpr,
                           SWITCHES: tl.constexpr):
    """One key tile with keys as the MMA's M side: scores^T [BLOCK_N, BLOCK_M] = K @ q^T and out^T [HEAD_DIM,
    BLOCK_M] += V^T @ P^T, so at 32 query rows both dots are wgmma-sized (M = BLOCK_N, HEAD_DIM) with the query
    rows as N. ``q_t`` [HEAD_DIM, BLOCK_M], ``acc_t`` [HEAD_DIM, BLOCK_M]; ``l_i`` and ``z_part`` (the softmax
    denominator and the values' zero-point term) are per-thread partial sums over keys (``_key_partials``)."""
    k_raw, v_raw, kn, vs, vz = tile
    offs_n = start + tl.arange(0, BLOCK_N)
    # 3-bit MSE keys in word-major channel order (the query is permuted to match): the A-operand fragment gives a
    # thread channel pairs t, t + 4, t + 8, ... (t = lane % 4), which in that order are all 4 words of a few whole
    # 8-channel groups, and the chunk layout of _load_side puts both groups of a chunk in that same thread, so the
    # decoded keys reach the wgmma operand in registers; in channel order they would go through shared memory
    # (a round trip of stores, barriers and ldmatrix per tile). The query's permutation is paid once per program,
    # in the prologue (docs/tuning.md, "3-bit code layout").
    k = _decode_side(k_raw, KEYS.mode, KEYS.bits, OPERANDS.fp8, OPERANDS.qk_dtype, BLOCK_N, HEAD_DIM, cent_ptr,
                     pair_ptr, SWITCHES.key_pairs, SWITCHES.pair_asm, KEYS.mode == MODE_MSE and KEYS.bits == 3)
    s = tl.dot(k, q_t, out_dtype=tl.float32)
    if OPERANDS.split_q:
        s = tl.dot(k, q_lo_t, acc=s, out_dtype=tl.float32)
    if KEYS.mode == MODE_MSE:
        s = s * (kn.to(tl.float32) * qk_scale)[:, None]
    else:
        s = s * qk_scale
    if MASKED:
        s = tl.where(_visible(offs_n[:, None], pos[None, :], n_ok[:, None], window, SEES.causal, SEES.has_window),
                     s, float("-inf"))

    # The keys span all 4 warps, so every sum over them is a cross-warp exchange (shuffles, shared memory, barriers).
    # Only the running max needs one per tile; the sums stay per-thread partials, rescaled like the accumulator and
    # added up once after the loop, which saves instructions and barriers per tile (docs/tuning.md, "Per-thread
    # partial sums").
    p, alpha, m_i = _online_softmax(s, m_i, 0)
    l_i = l_i * alpha[None, None, :] + _key_partials(p, BLOCK_N)
    acc_t = acc_t * alpha[None, :]

    PV_DTYPE: tl.constexpr = OPERANDS.pv_dtype
    if VALUES.mode == MODE_UNIFORM:
        pv = (p * vs.to(tl.float32)[:, None]).to(PV_DTYPE)
        z_part = z_part * alpha[None, None, :] + _key_partials(p * vz.to(tl.float32)[:, None], BLOCK_N)
        v = _uniform_values(v_raw, VALUES.bits, PV_DTYPE, BLOCK_N, HEAD_DIM, SWITCHES.pair_asm)
        acc_t = tl.dot(tl.trans(v), pv, acc=acc_t, out_dtype=tl.float32)
    else:
        v = _decode_side(v_raw, VALUES.mode, VALUES.bits, OPERANDS.fp8, PV_DTYPE, BLOCK_N, HEAD_DIM, cent_ptr,
                         pair_ptr, SWITCHES.key_pairs)
        acc_t = tl.dot(tl.trans(v), p.to(PV_DTYPE), acc=acc_t, out_dtype=tl.float32)
    return m_i, l_i, acc_t, z_part


@triton.jit
def _attend_tile_rows(q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, tile, qk_scale, window, cent_ptr, pair_ptr,
                      MASKED: tl.constexpr, HALVES: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                      KEYS: tl.constexpr, VALUES: tl.constexpr, SEES: tl.constexpr, OPERANDS: tl.constexpr,
                      SWITCHES: tl.constexpr):
    """One key tile with the query rows as the MMA's M side: scores [BLOCK_M, BLOCK_N] = q @ K^T and out
    [BLOCK_M, HEAD_DIM] += P @ V (``acc``, or even / odd channel halves in ``acc`` / ``acc_odd`` with HALVES)."""
    k_raw, v_raw, kn, vs, vz = tile
    # ---- scores, in log2 units ----
    offs_n = start + tl.arange(0, BLOCK_N)
    k = _decode_side(k_raw, KEYS.mode, KEYS.bits, OPERANDS.fp8, OPERANDS.qk_dtype, BLOCK_N, HEAD_DIM, cent_ptr,
                     pair_ptr, SWITCHES.key_pairs, SWITCHES.pair_asm)
    s = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
    if OPERANDS.split_q:
        s = tl.dot(q_lo, tl.trans(k), acc=s, out_dtype=tl.float32)
    if KEYS.mode == MODE_MSE:
        s = s * (kn.to(tl.float32) * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if MASKED:
        s = tl.where(_visible(offs_n[None, :], pos[:, None], n_ok[None, :], window, SEES.causal, SEES.has_window),
                     s, float("-inf"))

    # ---- online softmax ----
    p, alpha, m_i = _online_softmax(s, m_i, 1)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HALVES:
        acc_odd = acc_odd * alpha[:, None]

    # ---- values ----
    PV_DTYPE: tl.constexpr = OPERANDS.pv_dtype
    VALUE_BITS: tl.constexpr = VALUES.bits
    if VALUES.mode == MODE_UNIFORM:
        # v = zero + code * scale: fold the scale into P; the zero point is a rank-1 term.
        pv = (p * vs.to(tl.float32)[None, :]).to(PV_DTYPE)
        zsum = tl.sum(p * vz.to(tl.float32)[None, :], 1)[:, None]
        if HALVES:
            even, odd = _code_halves(v_raw, VALUE_BITS, BLOCK_N, HEAD_DIM)
            acc = tl.dot(pv, _uniform(even, PV_DTYPE), acc=acc, out_dtype=tl.float32) + zsum
            acc_odd = tl.dot(pv, _uniform(odd, PV_DTYPE), acc=acc_odd, out_dtype=tl.float32) + zsum
        else:
            v = _uniform_values(v_raw, VALUE_BITS, PV_DTYPE, BLOCK_N, HEAD_DIM, SWITCHES.pair_asm)
            acc = tl.dot(pv, v, acc=acc, out_dtype=tl.float32) + zsum
    else:
        v = _decode_side(v_raw, VALUES.mode, VALUE_BITS, OPERANDS.fp8, PV_DTYPE, BLOCK_N, HEAD_DIM, cent_ptr,
                         pair_ptr, SWITCHES.key_pairs)
        acc = tl.dot(p.to(PV_DTYPE), v, acc=acc, out_dtype=tl.float32)

    return m_i, l_i, acc, acc_odd


@triton.jit
def _attend_tile(q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, tile, qk_scale, window, cent_ptr, pair_ptr,
                 MASKED: tl.constexpr, HALVES: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 KEYS: tl.constexpr, VALUES: tl.constexpr, SEES: tl.constexpr, OPERANDS: tl.constexpr,
                 SWITCHES: tl.constexpr):
    """One key tile (``tile``: ``_load_tile``'s loads): scores, online softmax, values. MASKED=False: every row sees
    every key of the tile. With keys as M (SWITCHES.keys_as_m): ``q``, ``q_lo`` and ``acc`` are transposed
    ([HEAD_DIM, BLOCK_M]); ``l_i`` and ``acc_odd`` hold per-thread partial sums of the softmax denominator and of the
    values' zero-point term. KEYS, VALUES, SEES, OPERANDS, SWITCHES: the kernel's constant groups (kernel.py)."""
    if SWITCHES.keys_as_m:
        m_i, l_i, acc, acc_odd = _attend_tile_keys_as_m(
            q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, tile, qk_scale, window, cent_ptr, pair_ptr, MASKED,
            BLOCK_N, HEAD_DIM, KEYS, VALUES, SEES, OPERANDS, SWITCHES)
    else:
        m_i, l_i, acc, acc_odd = _attend_tile_rows(
            q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, tile, qk_scale, window, cent_ptr, pair_ptr, MASKED,
            HALVES, BLOCK_N, HEAD_DIM, KEYS, VALUES, SEES, OPERANDS, SWITCHES)
    return m_i, l_i, acc, acc_odd
