"""Triton split-KV paged attention over every cache format, with query tokens x GQA group as the M tile."""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ..formats import CacheFormat
from ..kv.triton_store_rows import _fwht_rows
from ..quant import lloyd_max, rotation_matrix, rotation_signs

_KEY_MODES = {"dense": 0, "fp8": 1, "mse": 2}
_VALUE_MODES = {"dense": 0, "fp8": 1, "uniform": 2}
_LOG2E = 1.4426950408889634


# ---- tile loads and in-register decoders ----------------------------------------------------------------
# Every decoded tile is [BLOCK_N, HEAD_DIM] in natural channel order: packed codes are unpacked per byte (4-bit) or
# per nibble word (3-bit) and interleaved back with tl.join + reshape (free in registers), so the query, the
# accumulator and the output all use contiguous, vectorized loads and stores, and each tile costs one dot for scores
# and one for values.


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
    if MODE == 0:
        ptr = cache_16 + (row // 2)[:, None] + tl.arange(0, HEAD_DIM)[None, :]
        raw = tl.load(ptr, mask=m2, other=0.0) if MASKED else tl.load(ptr)
    elif MODE == 1:
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
def _halfword(x):
    """16-bit cache elements -> their bits as int32 in 0 .. 65535."""
    return x.to(tl.uint16, bitcast=True).to(tl.int32)


@triton.jit
def _interleave(even, odd, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[BLOCK_N, HEAD_DIM // 2] tiles of the even and the odd channels -> [BLOCK_N, HEAD_DIM] in channel order."""
    return tl.reshape(tl.join(even, odd), (BLOCK_N, HEAD_DIM))


@triton.jit
def _code_halves(raw, BITS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Raw packed codes -> int32 codes of the even and of the odd channels, each [BLOCK_N, HEAD_DIM // 2]."""
    if BITS == 4:
        x = raw.to(tl.int32)
        even = x & 15
        odd = x >> 4
    else:
        # Code k of group g is channel 8g + k; nested joins order (k = 0, 2, 4, 6) and (1, 3, 5, 7) per group.
        even = tl.reshape(tl.join(tl.join(raw & 7, (raw >> 16) & 7), tl.join((raw >> 8) & 7, (raw >> 24) & 7)),
                          (BLOCK_N, HEAD_DIM // 2))
        odd = tl.reshape(tl.join(tl.join((raw >> 4) & 7, (raw >> 20) & 7), tl.join((raw >> 12) & 7, (raw >> 28) & 7)),
                         (BLOCK_N, HEAD_DIM // 2))
    return even, odd


@triton.jit
def _codes(raw, BITS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Raw packed codes -> int32 codes [BLOCK_N, HEAD_DIM] in channel order.

    One reshape of nested joins: the join's new (last) index varies fastest, so the outer join picks k & 1, the
    middle one (k >> 1) & 1 and the inner one k >> 2 (code k of group g is channel 8g + k). Interleaving already
    reshaped halves instead makes Triton 3.6 fail to build wgmma operands ("Illegal shared layout").
    """
    if BITS == 4:
        x = raw.to(tl.int32)
        return _interleave(x & 15, x >> 4, BLOCK_N, HEAD_DIM)
    else:
        even = tl.join(tl.join(raw & 7, (raw >> 16) & 7), tl.join((raw >> 8) & 7, (raw >> 24) & 7))
        odd = tl.join(tl.join((raw >> 4) & 7, (raw >> 20) & 7), tl.join((raw >> 12) & 7, (raw >> 28) & 7))
        return tl.reshape(tl.join(even, odd), (BLOCK_N, HEAD_DIM))


@triton.jit
def _centroid(code, cent_ptr, c0, c1, c2, c3, c4, c5, c6, c7, BITS: tl.constexpr, LUT_SELECT: tl.constexpr):
    """Lloyd-Max level of each code (float32): a table gather, or a select tree over the symmetric magnitudes."""
    if LUT_SELECT:
        half: tl.constexpr = 1 << (BITS - 1)
        neg = code < half
        mag = tl.where(neg, half - 1 - code, code - half)
        b0 = (mag & 1) != 0
        b1 = (mag & 2) != 0
        low = tl.where(b1, tl.where(b0, c3, c2), tl.where(b0, c1, c0))
        if BITS == 4:
            high = tl.where(b1, tl.where(b0, c7, c6), tl.where(b0, c5, c4))
            val = tl.where((mag & 4) != 0, high, low)
        else:
            val = low
        return tl.where(neg, -val, val)
    else:
        return tl.load(cent_ptr + code)


@triton.jit
def _fp16_bits(x):
    """The low 16 bits of int32 ``x`` as float16."""
    return x.to(tl.int16).to(tl.float16, bitcast=True)


def _level_tables(bits: int, levels: slice) -> str:
    """PTX moving the low bytes (a0, a1) and the high bytes (b0, b1) of 8 fp16 Lloyd-Max levels into registers:
    the 8-byte tables a ``prmt`` selects from with a 3-bit index."""
    half = lloyd_max(bits)[0][levels].to(torch.float16).view(torch.int16).tolist()
    word = lambda b: sum(v << (8 * i) for i, v in enumerate(b))
    lo, hi = [m & 0xFF for m in half], [(m >> 8) & 0xFF for m in half]
    return (f"mov.b32 a0, {word(lo[:4]):#x};\nmov.b32 a1, {word(lo[4:]):#x};\n"
            f"mov.b32 b0, {word(hi[:4]):#x};\nmov.b32 b1, {word(hi[4:]):#x};\n")


# Outputs $0..$3 from the 3-bit indices in the nibbles of m (codes 0-3) and m1 (codes 4-7): low and high level bytes,
# then each pair of codes joined into one word of two fp16. `_SIGNS` may set the sign bits of h0 / h1 in between.
_LOOKUP = "prmt.b32 l0, a0, a1, m;\nprmt.b32 h0, b0, b1, m;\nprmt.b32 l1, a0, a1, m1;\nprmt.b32 h1, b0, b1, m1;\n"
_ASSEMBLE = ("prmt.b32 $0, l0, h0, 0x5140;\nprmt.b32 $1, l0, h0, 0x7362;\n"
             "prmt.b32 $2, l1, h1, 0x5140;\nprmt.b32 $3, l1, h1, 0x7362;\n")
_LOOKUP_REGS = ".reg .b32 t, m, m1, l0, l1, h0, h1, a0, a1, b0, b1;\n"

# 4 bytes of 4-bit MSE codes -> 4 words of fp16 centroid pairs, no memory. The Lloyd-Max levels are symmetric: code
# c >= 8 is +mag[c - 8], code c < 8 is -mag[7 - c], so each code selects its magnitude's bytes by a 3-bit index
# and bit 3 sets the sign.
_PAIR4_ASM = tl.constexpr(
    "{\n" + _LOOKUP_REGS + ".reg .b32 u, w4, r0, r1;\n" + _level_tables(4, slice(8, None))
    + "and.b32 t, $4, 0x88888888;\nshr.u32 u, t, 3;\nsub.u32 u, t, u;\n"  # u: 7 in every nibble with bit 3
    + "xor.b32 m, $4, u;\nnot.b32 m, m;\nand.b32 m, m, 0x77777777;\nshr.u32 m1, m, 16;\n"  # magnitude indices
    + _LOOKUP
    # 0xFF where a code's bit 3 is set (positive level), from the sign-replicating permute mode
    + "shl.b32 w4, $4, 4;\nprmt.b32 r0, w4, $4, 0xD9C8;\nprmt.b32 r1, w4, $4, 0xFBEA;\n"
    + "not.b32 r0, r0;\nand.b32 r0, r0, 0x80808080;\nor.b32 h0, h0, r0;\n"
    + "not.b32 r1, r1;\nand.b32 r1, r1, 0x80808080;\nor.b32 h1, h1, r1;\n"
    + _ASSEMBLE + "}"
)
# One nibble word of eight 3-bit MSE codes (_load_side) -> 4 words of fp16 centroid pairs (channels 0-1, 2-3, 4-5, 6-7).
_PAIR3_ASM = tl.constexpr(
    "{\n" + _LOOKUP_REGS + _level_tables(3, slice(None))
    + "mov.b32 m, $4;\nshr.u32 m1, $4, 16;\n" + _LOOKUP + _ASSEMBLE + "}"
)


# Uniform value codes -> fp16 pairs (code of channel 2j, code of channel 2j + 1), one int32 word per pair: bits
# 0x6400 | c are the fp16 1024 + c, so a byte permute, a mask and an fp16x2 subtraction of 1024 per pair. 3-bit codes
# arrive as nibble words (_load_side), which decode like 4 bytes of 4-bit codes.


def _uniform_asm(src: str) -> str:
    """Word j: byte j of ``src`` in byte 0 and byte j of ``w4`` (``src >> 4``) in byte 2, masked to the nibbles."""
    return "".join(f"prmt.b32 t, {src}, w4, {sel:#x};\nand.b32 t, t, 0x000F000F;\nor.b32 t, t, k;\n"
                   f"sub.f16x2 ${j}, t, k;\n" for j, sel in enumerate((0x0400, 0x0501, 0x0602, 0x0703)))


# Also the 3-bit decoder: a nibble word of 3-bit codes is 4 bytes of 4-bit codes below 8.
_UNIFORM4_ASM = tl.constexpr("{\n.reg .b32 w4, k, t;\nmov.b32 k, 0x64006400;\nshr.u32 w4, $4, 4;\n"
                             + _uniform_asm("$4") + "}")


@triton.jit
def _permute_pairs(raw, KEYS: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   WORD_MAJOR: tl.constexpr = False):
    """Packed codes -> int32 words [BLOCK_N, HEAD_DIM // 2] of fp16 channel pairs, by the byte-permute PTX: centroids
    of MSE keys (KEYS) or uniform codes as numbers. 4-bit: one word per byte; 3-bit: four words per nibble word,
    in channel order, or with WORD_MAJOR in the order of ``_word_major``."""
    if BITS == 4:
        asm: tl.constexpr = _PAIR4_ASM if KEYS else _UNIFORM4_ASM
        pair = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r", [raw.to(tl.uint8)], dtype=tl.int32, is_pure=True,
                                         pack=4)
    else:
        asm3: tl.constexpr = _PAIR3_ASM if KEYS else _UNIFORM4_ASM
        p0, p1, p2, p3 = tl.inline_asm_elementwise(asm3, "=r,=r,=r,=r,r", [raw], dtype=(tl.int32,) * 4, is_pure=True,
                                                   pack=1)
        words = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [BLOCK_N, groups, 2, 2]: word 2j + i at [.., j, i]
        if WORD_MAJOR:
            words = tl.permute(words, (0, 2, 3, 1))
        pair = tl.reshape(words, (BLOCK_N, HEAD_DIM // 2))
    return pair


@triton.jit
def _word_major(x, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[ROWS, HEAD_DIM] in channel order -> channel 8g + 2w + e at column 2 (w * HEAD_DIM / 8 + g) + e: the 4 channel
    pairs (words) of each 8-channel group spread HEAD_DIM / 8 words apart."""
    return tl.reshape(tl.permute(tl.reshape(x, (ROWS, HEAD_DIM // 8, 4, 2)), (0, 2, 1, 3)), (ROWS, HEAD_DIM))


@triton.jit
def _pairs_operand(pair, OUT: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """int32 words of fp16 channel pairs [BLOCK_N, HEAD_DIM // 2] -> the [BLOCK_N, HEAD_DIM] operand in dtype OUT.

    The words are interleaved, then reinterpreted: interleaving the fp16 halves instead makes Triton 3.6 fail to build
    wgmma (M >= 64) operands ("Illegal shared layout").
    """
    return _fp16_bits(_interleave(pair, pair >> 16, BLOCK_N, HEAD_DIM)).to(OUT)


@triton.jit
def _decode_side(raw, MODE: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr, OUT: tl.constexpr,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, cent_ptr, pair_ptr, c0, c1, c2, c3, c4, c5, c6, c7,
                 LUT_SELECT: tl.constexpr, KEY_PAIRS: tl.constexpr, ASM: tl.constexpr = False,
                 WORD_MAJOR: tl.constexpr = False):
    """The raw tile of a dense, fp8 or MSE side -> the [BLOCK_N, HEAD_DIM] operand in dtype OUT, channels in order
    (with WORD_MAJOR, for 3-bit MSE keys: in the order of ``_word_major``).

    ASM (CUDA): MSE codes decode with byte permutes in inline PTX, no memory access. Otherwise KEY_PAIRS: a 4-bit
    MSE byte indexes a 256-entry table of fp16 centroid pairs, one gather for two channels.
    """
    if MODE == 0:
        x = raw.to(tl.float32).to(OUT)
    elif MODE == 1:
        x = raw.to(FP8, bitcast=True).to(OUT)
    elif ASM:
        x = _pairs_operand(_permute_pairs(raw, True, BITS, BLOCK_N, HEAD_DIM, WORD_MAJOR), OUT, BLOCK_N, HEAD_DIM)
    elif KEY_PAIRS and BITS == 4:
        x = _pairs_operand(tl.load(pair_ptr + raw.to(tl.int32)), OUT, BLOCK_N, HEAD_DIM)
    else:
        code = _codes(raw, BITS, BLOCK_N, HEAD_DIM)
        x = _centroid(code, cent_ptr, c0, c1, c2, c3, c4, c5, c6, c7, BITS, LUT_SELECT).to(OUT)
    if WORD_MAJOR and not ASM:
        x = _word_major(x, BLOCK_N, HEAD_DIM)
    return x


@triton.jit
def _uniform_values(raw, BITS: tl.constexpr, OUT: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                    ASM: tl.constexpr):
    """Raw uniform value codes -> their integer values [BLOCK_N, HEAD_DIM] in dtype OUT, channels in order: byte
    permutes in inline PTX (ASM, CUDA) or the fp16 bit trick of ``_uniform``."""
    if ASM:
        return _pairs_operand(_permute_pairs(raw, False, BITS, BLOCK_N, HEAD_DIM), OUT, BLOCK_N, HEAD_DIM)
    else:
        return _uniform(_codes(raw, BITS, BLOCK_N, HEAD_DIM), OUT)


@triton.jit
def _uniform(code, OUT: tl.constexpr):
    """Uniform value codes -> their integer values in dtype OUT.

    A code c decodes as the fp16 whose bits are 0x6400 | c (= 1024 + c) minus 1024, exact, which costs integer ops
    and an fp16 subtraction instead of two int -> float conversions.
    """
    return (_fp16_bits(code | 0x6400) - 1024.0).to(OUT)


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
def _block_rows(bt_row, start, s_end, kvh_off, num_blocks, max_blocks, STRIDE_CB: tl.constexpr,
                STRIDE_CS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Byte offsets [BLOCK_N] (int64) of the cache rows of keys start .. start + BLOCK_N, their mask (the key is
    before ``s_end`` and its block-table entry lies in [0, num_blocks)), and ``bad``: nonzero where an entry does not
    (a scalar when the tile sits in one block, else [BLOCK_N]).

    ``start`` is a multiple of BLOCK_N, so a row's block and its place in the block split into a scalar and a
    loop-invariant part: no per-row division, and one 64-bit multiply per distinct block.
    """
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
def _load_tile(cache_u8, cache_16, row, n_ok, KEY_MODE: tl.constexpr, KEY_BITS: tl.constexpr,
               VALUE_MODE: tl.constexpr, VALUE_BITS: tl.constexpr, HEAD_DIM: tl.constexpr, V_OFF: tl.constexpr,
               K_NORM_OFF: tl.constexpr, V_SCALE_OFF: tl.constexpr, MASKED: tl.constexpr,
               KEY_ROW_LOADS: tl.constexpr):
    """Issue every load of the key tile at cache rows ``row`` (``_block_rows``): K and V raw tiles, norm, scale and
    zero. MASKED=False: the tile is whole (every row is a key before ``s_end``), so no load needs a mask."""
    k_raw = _load_side(cache_u8, cache_16, row, n_ok, KEY_MODE, KEY_BITS, HEAD_DIM, False, KEY_ROW_LOADS)
    v_raw = _load_side(cache_u8, cache_16, row + V_OFF, n_ok, VALUE_MODE, VALUE_BITS, HEAD_DIM,
                       MASKED and VALUE_MODE != 2)
    kn = _load_aux(cache_16, row + K_NORM_OFF, n_ok, KEY_MODE == 2, MASKED)
    vs = _load_aux(cache_16, row + V_SCALE_OFF, n_ok, VALUE_MODE == 2, MASKED)
    vz = _load_aux(cache_16, row + V_SCALE_OFF + 2, n_ok, VALUE_MODE == 2, MASKED)
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
def _attend_tile_keys_as_m(q_t, q_lo_t, m_i, l_i, acc_t, z_part, start, n_ok, pos, k_raw, v_raw, kn, vs, vz,
                           qk_scale, window, cent_ptr, pair_ptr, c0, c1, c2, c3, c4, c5, c6, c7, MASKED: tl.constexpr,
                           CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
                           HEAD_DIM: tl.constexpr, KEY_MODE: tl.constexpr, KEY_BITS: tl.constexpr,
                           VALUE_MODE: tl.constexpr, VALUE_BITS: tl.constexpr, FP8: tl.constexpr,
                           QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr, LUT_SELECT: tl.constexpr,
                           KEY_PAIRS: tl.constexpr, SPLIT_Q: tl.constexpr, PAIR_ASM: tl.constexpr):
    """One key tile with keys as the MMA's M side: scores^T [BLOCK_N, BLOCK_M] = K @ q^T and out^T [HEAD_DIM,
    BLOCK_M] += V^T @ P^T, so at 32 query rows both dots are wgmma-sized (M = BLOCK_N, HEAD_DIM) with the query
    rows as N. ``q_t`` [HEAD_DIM, BLOCK_M], ``acc_t`` [HEAD_DIM, BLOCK_M]; ``l_i`` and ``z_part`` (the softmax
    denominator and the values' zero-point term) are per-thread partial sums over keys (``_key_partials``)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    # 3-bit MSE keys in word-major channel order (the query is permuted to match): the A-operand fragment gives a
    # thread channel pairs t, t + 4, t + 8, ... (t = lane % 4), which in that order are all 4 words of a few whole
    # 8-channel groups, and the chunk layout of _load_side puts both groups of a chunk in that same thread, so the
    # decoded keys reach the wgmma operand in registers; in channel order they would go through shared memory
    # (a round trip of stores, barriers and ldmatrix per tile). The query's permutation is paid once per program,
    # in the prologue (docs/tuning.md, "3-bit code layout").
    k = _decode_side(k_raw, KEY_MODE, KEY_BITS, FP8, QK_DTYPE, BLOCK_N, HEAD_DIM, cent_ptr, pair_ptr,
                     c0, c1, c2, c3, c4, c5, c6, c7, LUT_SELECT, KEY_PAIRS, PAIR_ASM, KEY_MODE == 2 and KEY_BITS == 3)
    s = tl.dot(k, q_t, out_dtype=tl.float32)
    if SPLIT_Q:
        s = tl.dot(k, q_lo_t, acc=s, out_dtype=tl.float32)
    if KEY_MODE == 2:
        s = s * (kn.to(tl.float32) * qk_scale)[:, None]
    else:
        s = s * qk_scale
    if MASKED:
        s = tl.where(_visible(offs_n[:, None], pos[None, :], n_ok[:, None], window, CAUSAL, HAS_WINDOW), s,
                     float("-inf"))

    # The keys span all 4 warps, so every sum over them is a cross-warp exchange (shuffles, shared memory, barriers).
    # Only the running max needs one per tile; the sums stay per-thread partials, rescaled like the accumulator and
    # added up once after the loop, which saves instructions and barriers per tile (docs/tuning.md, "Per-thread
    # partial sums").
    p, alpha, m_i = _online_softmax(s, m_i, 0)
    l_i = l_i * alpha[None, None, :] + _key_partials(p, BLOCK_N)
    acc_t = acc_t * alpha[None, :]

    if VALUE_MODE == 2:
        pv = (p * vs.to(tl.float32)[:, None]).to(PV_DTYPE)
        z_part = z_part * alpha[None, None, :] + _key_partials(p * vz.to(tl.float32)[:, None], BLOCK_N)
        v = _uniform_values(v_raw, VALUE_BITS, PV_DTYPE, BLOCK_N, HEAD_DIM, PAIR_ASM)
        acc_t = tl.dot(tl.trans(v), pv, acc=acc_t, out_dtype=tl.float32)
    else:
        v = _decode_side(v_raw, VALUE_MODE, VALUE_BITS, FP8, PV_DTYPE, BLOCK_N, HEAD_DIM, cent_ptr,
                         pair_ptr, c0, c1, c2, c3, c4, c5, c6, c7, LUT_SELECT, KEY_PAIRS)
        acc_t = tl.dot(tl.trans(v), p.to(PV_DTYPE), acc=acc_t, out_dtype=tl.float32)
    return m_i, l_i, acc_t, z_part


@triton.jit
def _attend_tile_rows(q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, k_raw, v_raw, kn, vs, vz,
                      qk_scale, window, cent_ptr, pair_ptr, c0, c1, c2, c3, c4, c5, c6, c7, MASKED: tl.constexpr,
                      CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HALVES: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, KEY_MODE: tl.constexpr, KEY_BITS: tl.constexpr,
                      VALUE_MODE: tl.constexpr, VALUE_BITS: tl.constexpr, FP8: tl.constexpr, QK_DTYPE: tl.constexpr,
                      PV_DTYPE: tl.constexpr, LUT_SELECT: tl.constexpr, KEY_PAIRS: tl.constexpr,
                      SPLIT_Q: tl.constexpr, PAIR_ASM: tl.constexpr):
    """One key tile with the query rows as the MMA's M side: scores [BLOCK_M, BLOCK_N] = q @ K^T and out
    [BLOCK_M, HEAD_DIM] += P @ V (``acc``, or even / odd channel halves in ``acc`` / ``acc_odd`` with HALVES)."""
    # ---- scores, in log2 units ----
    offs_n = start + tl.arange(0, BLOCK_N)
    k = _decode_side(k_raw, KEY_MODE, KEY_BITS, FP8, QK_DTYPE, BLOCK_N, HEAD_DIM, cent_ptr, pair_ptr,
                     c0, c1, c2, c3, c4, c5, c6, c7, LUT_SELECT, KEY_PAIRS, PAIR_ASM)
    s = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
    if SPLIT_Q:
        s = tl.dot(q_lo, tl.trans(k), acc=s, out_dtype=tl.float32)
    if KEY_MODE == 2:
        s = s * (kn.to(tl.float32) * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if MASKED:
        s = tl.where(_visible(offs_n[None, :], pos[:, None], n_ok[None, :], window, CAUSAL, HAS_WINDOW), s,
                     float("-inf"))

    # ---- online softmax ----
    p, alpha, m_i = _online_softmax(s, m_i, 1)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HALVES:
        acc_odd = acc_odd * alpha[:, None]

    # ---- values ----
    if VALUE_MODE == 2:
        # v = zero + code * scale: fold the scale into P; the zero point is a rank-1 term.
        pv = (p * vs.to(tl.float32)[None, :]).to(PV_DTYPE)
        zsum = tl.sum(p * vz.to(tl.float32)[None, :], 1)[:, None]
        if HALVES:
            even, odd = _code_halves(v_raw, VALUE_BITS, BLOCK_N, HEAD_DIM)
            acc = tl.dot(pv, _uniform(even, PV_DTYPE), acc=acc, out_dtype=tl.float32) + zsum
            acc_odd = tl.dot(pv, _uniform(odd, PV_DTYPE), acc=acc_odd, out_dtype=tl.float32) + zsum
        else:
            v = _uniform_values(v_raw, VALUE_BITS, PV_DTYPE, BLOCK_N, HEAD_DIM, PAIR_ASM)
            acc = tl.dot(pv, v, acc=acc, out_dtype=tl.float32) + zsum
    else:
        v = _decode_side(v_raw, VALUE_MODE, VALUE_BITS, FP8, PV_DTYPE, BLOCK_N, HEAD_DIM, cent_ptr,
                         pair_ptr, c0, c1, c2, c3, c4, c5, c6, c7, LUT_SELECT, KEY_PAIRS)
        acc = tl.dot(p.to(PV_DTYPE), v, acc=acc, out_dtype=tl.float32)

    return m_i, l_i, acc, acc_odd


@triton.jit
def _attend_tile(q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, k_raw, v_raw, kn, vs, vz, qk_scale, window,
                 cent_ptr, pair_ptr, c0, c1, c2, c3, c4, c5, c6, c7, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, HALVES: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 KEY_MODE: tl.constexpr, KEY_BITS: tl.constexpr, VALUE_MODE: tl.constexpr, VALUE_BITS: tl.constexpr,
                 FP8: tl.constexpr, QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr, LUT_SELECT: tl.constexpr,
                 KEY_PAIRS: tl.constexpr, SPLIT_Q: tl.constexpr, PAIR_ASM: tl.constexpr, KEYS_AS_M: tl.constexpr):
    """One key tile: scores, online softmax, values. MASKED=False: every row sees every key of the tile.
    KEYS_AS_M: ``q``, ``q_lo`` and ``acc`` are transposed ([HEAD_DIM, BLOCK_M]); ``l_i`` and ``acc_odd`` hold
    per-thread partial sums of the softmax denominator and of the values' zero-point term."""
    if KEYS_AS_M:
        m_i, l_i, acc, acc_odd = _attend_tile_keys_as_m(
            q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, k_raw, v_raw, kn, vs, vz, qk_scale, window,
            cent_ptr, pair_ptr, c0, c1, c2, c3, c4, c5, c6, c7, MASKED, CAUSAL, HAS_WINDOW, BLOCK_N, HEAD_DIM,
            KEY_MODE, KEY_BITS, VALUE_MODE, VALUE_BITS, FP8, QK_DTYPE, PV_DTYPE, LUT_SELECT, KEY_PAIRS, SPLIT_Q,
            PAIR_ASM)
    else:
        m_i, l_i, acc, acc_odd = _attend_tile_rows(
            q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, k_raw, v_raw, kn, vs, vz, qk_scale, window,
            cent_ptr, pair_ptr, c0, c1, c2, c3, c4, c5, c6, c7, MASKED, CAUSAL, HAS_WINDOW, HALVES, BLOCK_N,
            HEAD_DIM, KEY_MODE, KEY_BITS, VALUE_MODE, VALUE_BITS, FP8, QK_DTYPE, PV_DTYPE, LUT_SELECT, KEY_PAIRS,
            SPLIT_Q, PAIR_ASM)
    return m_i, l_i, acc, acc_odd


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
    c0, c1, c2, c3, c4, c5, c6, c7,
    # Cache strides in bytes, as constants: the compiler then knows each row's alignment and widens the loads.
    STRIDE_CB: tl.constexpr, STRIDE_CS: tl.constexpr, STRIDE_CH: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    KEY_MODE: tl.constexpr, KEY_BITS: tl.constexpr, VALUE_MODE: tl.constexpr, VALUE_BITS: tl.constexpr,
    K_NORM_OFF: tl.constexpr, V_OFF: tl.constexpr, V_SCALE_OFF: tl.constexpr,
    FP8: tl.constexpr, QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr, LUT_SELECT: tl.constexpr,
    KEY_PAIRS: tl.constexpr, PREFETCH: tl.constexpr,
    ROTATE_Q: tl.constexpr, SPLIT_Q: tl.constexpr,
    V_HALVES: tl.constexpr, PAIR_ASM: tl.constexpr, LOG2_D: tl.constexpr, KEYS_AS_M: tl.constexpr,
    IDS_AHEAD: tl.constexpr, PREFETCH_L2: tl.constexpr, ROW_LOADS: tl.constexpr,
):
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
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    qi = offs_m // GROUP_PAD
    hg = offs_m % GROUP_PAD
    q_local = q_tile + qi
    token = q_start + q_local
    row_ok = (qi < BLOCK_Q) & (q_local < q_len) & (hg < GROUP) & (token >= 0) & (token < num_tokens)
    head = kvh * GROUP + hg
    pos = ctx + q_local
    offs_d = tl.arange(0, HEAD_DIM)
    q_row = q_ptr + token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    if ROTATE_Q:
        # Scores of MSE keys live in the rotated space: q_rot = q @ R^T = (q * signs) @ H / sqrt(d), as a
        # Walsh-Hadamard butterfly in fp32 registers (signs_ptr: the +-1 signs), no d x d operand per program.
        LOG2_A: tl.constexpr = LOG2_D - 3
        q_s = tl.load(q_row + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        q_s = q_s * tl.load(signs_ptr + offs_d)[None, :]
        x = tl.permute(tl.reshape(q_s, (BLOCK_M, HEAD_DIM // 8, 8)), (1, 0, 2))
        x = _fwht_rows(x, HEAD_DIM // 8, BLOCK_M, 8, LOG2_A, 3)
        q32 = tl.reshape(tl.permute(x, (1, 0, 2)), (BLOCK_M, HEAD_DIM)) * (1.0 / tl.sqrt(HEAD_DIM * 1.0))
    else:
        q32 = tl.load(q_row + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q = q32.to(QK_DTYPE)
    if SPLIT_Q:
        # fp32 queries as a 16-bit head plus a 16-bit remainder: the scores keep ~fp32 precision instead of
        # jumping at 16-bit rounding boundaries (which made compiled and eager fp32 models drift apart).
        q_lo = (q32 - q.to(tl.float32)).to(QK_DTYPE)
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
    # V_HALVES: packed (uniform) values stay as even / odd channel halves with one accumulator each, interleaved
    # once after the loop; see _value_halves for when.
    # fp8-key formats keep the halves (faster there); MSE formats decode value pairs with byte permutes instead.
    HALVES: tl.constexpr = VALUE_MODE == 2 and V_HALVES and not (PAIR_ASM and KEY_MODE == 2) and not KEYS_AS_M
    ACC_W: tl.constexpr = HEAD_DIM // 2 if HALVES else HEAD_DIM
    KEY_ROW_LOADS: tl.constexpr = KEYS_AS_M and ROW_LOADS  # decode tiles are slower with them (_row_loads)
    if KEYS_AS_M:
        # The transposed query is the wgmma's B operand, in shared memory for the whole loop.
        if KEY_MODE == 2 and KEY_BITS == 3:
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
    kvh_off = kvh.to(tl.int64) * STRIDE_CH

    # Tiles every row sees whole (past the window start, before the causal diagonal, inside the split) skip the
    # masks: the score select, the causal and window compares, and the masked loads. The others, at most a few per
    # program, run masked in a second loop (docs/tuning.md, "Whole tiles without masks").
    n_tiles = tl.cdiv(s_end - s_begin, BLOCK_N)
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

    # Software pipeline in registers (PREFETCH): the loads of tile i+1 are in flight while tile i is computed, so
    # the block-table -> cache dependency and the DRAM latency overlap the dequantization and the dots. It costs
    # registers, hence occupancy; without it, other resident programs hide the latency. The tile loaded after the
    # last one is never used; its rows are clamped into the cache like every other row.
    # Whole tiles run unmasked, so out-of-range block-table entries (_block_rows' ``bad``) are only collected there,
    # an OR per tile; where any turn up, the partial result is discarded and every tile runs masked below.
    if BLOCK_N <= BLOCK_SIZE:
        dropped = tl.full([], 0, tl.int32)
    else:
        dropped = tl.zeros([BLOCK_N], dtype=tl.int32)
    if PREFETCH or IDS_AHEAD:
        row, n_ok, bad = _block_rows(bt_row, full_begin, s_end, kvh_off, num_blocks, max_blocks, STRIDE_CB, STRIDE_CS,
                                BLOCK_N, BLOCK_SIZE)
    if PREFETCH:
        k_raw, v_raw, kn, vs, vz = _load_tile(cache_u8, cache_16, row, n_ok, KEY_MODE, KEY_BITS, VALUE_MODE,
                                              VALUE_BITS, HEAD_DIM, V_OFF, K_NORM_OFF, V_SCALE_OFF, False,
                                              KEY_ROW_LOADS)
        for start in range(full_begin, full_end, BLOCK_N):
            next_row, next_ok, next_bad = _block_rows(bt_row, start + BLOCK_N, s_end, kvh_off, num_blocks, max_blocks,
                                            STRIDE_CB, STRIDE_CS, BLOCK_N, BLOCK_SIZE)
            nk_raw, nv_raw, nkn, nvs, nvz = _load_tile(cache_u8, cache_16, next_row, next_ok, KEY_MODE, KEY_BITS,
                                                       VALUE_MODE, VALUE_BITS, HEAD_DIM, V_OFF, K_NORM_OFF,
                                                       V_SCALE_OFF, False, KEY_ROW_LOADS)
            m_i, l_i, acc, acc_odd = _attend_tile(
                q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, k_raw, v_raw, kn, vs, vz, qk_scale, window,
                cent_ptr, pair_ptr, c0, c1, c2, c3, c4, c5, c6, c7, False, CAUSAL, HAS_WINDOW, HALVES, BLOCK_N,
                HEAD_DIM, KEY_MODE, KEY_BITS, VALUE_MODE, VALUE_BITS, FP8, QK_DTYPE, PV_DTYPE, LUT_SELECT, KEY_PAIRS,
                SPLIT_Q, PAIR_ASM, KEYS_AS_M)
            dropped = dropped | bad
            n_ok, bad, k_raw, kn = next_ok, next_bad, nk_raw, nkn
            v_raw, vs, vz = nv_raw, nvs, nvz
    else:
        # IDS_AHEAD: only the block ids of the next tile are loaded ahead, which takes their latency off each tile's
        # chain of dependent loads (block id -> codes) for two registers. It slows 64-row 4bit_nc tiles and
        # one-warp k8v4 decode tiles, so it is chosen per family and regime (_IDS_AHEAD).
        for start in range(full_begin, full_end, BLOCK_N):
            if IDS_AHEAD:
                next_row, next_ok, next_bad = _block_rows(bt_row, start + BLOCK_N, s_end, kvh_off, num_blocks, max_blocks,
                                                STRIDE_CB, STRIDE_CS, BLOCK_N, BLOCK_SIZE)
            else:
                row, n_ok, bad = _block_rows(bt_row, start, s_end, kvh_off, num_blocks, max_blocks, STRIDE_CB, STRIDE_CS,
                                        BLOCK_N, BLOCK_SIZE)
            k_raw, v_raw, kn, vs, vz = _load_tile(cache_u8, cache_16, row, n_ok, KEY_MODE, KEY_BITS, VALUE_MODE,
                                                  VALUE_BITS, HEAD_DIM, V_OFF, K_NORM_OFF, V_SCALE_OFF, False,
                                                  KEY_ROW_LOADS)
            if IDS_AHEAD and PREFETCH_L2:
                _prefetch_l2(cache_u8, next_row, STRIDE_CH)
            m_i, l_i, acc, acc_odd = _attend_tile(
                q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, k_raw, v_raw, kn, vs, vz, qk_scale, window,
                cent_ptr, pair_ptr, c0, c1, c2, c3, c4, c5, c6, c7, False, CAUSAL, HAS_WINDOW, HALVES, BLOCK_N,
                HEAD_DIM, KEY_MODE, KEY_BITS, VALUE_MODE, VALUE_BITS, FP8, QK_DTYPE, PV_DTYPE, LUT_SELECT, KEY_PAIRS,
                SPLIT_Q, PAIR_ASM, KEYS_AS_M)
            dropped = dropped | bad
            if IDS_AHEAD:
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
        row, n_ok, bad = _block_rows(bt_row, start, s_end, kvh_off, num_blocks, max_blocks, STRIDE_CB, STRIDE_CS, BLOCK_N,
                                BLOCK_SIZE)
        k_raw, v_raw, kn, vs, vz = _load_tile(cache_u8, cache_16, row, n_ok, KEY_MODE, KEY_BITS, VALUE_MODE,
                                              VALUE_BITS, HEAD_DIM, V_OFF, K_NORM_OFF, V_SCALE_OFF, True,
                                              KEY_ROW_LOADS)
        m_i, l_i, acc, acc_odd = _attend_tile(
            q, q_lo, m_i, l_i, acc, acc_odd, start, n_ok, pos, k_raw, v_raw, kn, vs, vz, qk_scale, window,
            cent_ptr, pair_ptr, c0, c1, c2, c3, c4, c5, c6, c7, True, CAUSAL, HAS_WINDOW, HALVES, BLOCK_N,
            HEAD_DIM, KEY_MODE, KEY_BITS, VALUE_MODE, VALUE_BITS, FP8, QK_DTYPE, PV_DTYPE, LUT_SELECT, KEY_PAIRS,
            SPLIT_Q, PAIR_ASM, KEYS_AS_M)

    if VALUE_MODE == 1:
        acc = acc * v_scale
    if HALVES:
        acc = _interleave(acc, acc_odd, BLOCK_M, HEAD_DIM)
    if KEYS_AS_M:
        acc = tl.trans(acc + tl.sum(tl.sum(acc_odd, 1), 0)[None, :])
        l_i = tl.sum(tl.sum(l_i, 1), 0)
    out_row = token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS == 1:
        if HAS_SINKS:
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


@triton.jit
def _combine_splits_kernel(
    part_ptr, ml_ptr, sinks_ptr, qsl_ptr, out_ptr, stride_ot, stride_oh,
    num_tokens, num_seqs,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
):
    """Merge the splits of one token x HEADS_PER_PROGRAM heads: [heads, splits, HEAD_DIM] partials -> output."""
    t = tl.program_id(0)
    h = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    sp = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    # Padding tokens past query_start_loc[-1] belong to no sequence: no split wrote them.
    valid = t < tl.load(qsl_ptr + num_seqs)
    h_ok = h < NUM_Q_HEADS
    base = (sp.to(tl.int64)[None, :] * num_tokens + t) * NUM_Q_HEADS + h[:, None]  # [heads, splits]
    # Comparisons, not `&` with a scalar: the interpreter needs bool tensors.
    ok = h_ok[:, None] & (sp[None, :] < tl.where(valid, NUM_SPLITS, 0))
    m = tl.load(ml_ptr + base * 2, mask=ok, other=-1.0e30)
    l = tl.load(ml_ptr + base * 2 + 1, mask=ok, other=0.0)
    acc = tl.load(part_ptr + base[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=ok[:, :, None], other=0.0)
    m_f = tl.max(m, 1)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h, mask=h_ok, other=0.0) * 1.4426950408889634
        m_f = tl.maximum(m_f, sink)
        w = tl.exp2(m - m_f[:, None])
        denom = tl.sum(w * l, 1) + tl.exp2(sink - m_f)
    else:
        w = tl.exp2(m - m_f[:, None])
        denom = tl.sum(w * l, 1)
    o = tl.sum(acc * w[:, :, None], 1)
    # Rows that saw no key have o = 0 and denom = 0, so they come out 0; a NaN denominator (a NaN the row attended
    # to) must stay NaN, which a `denom > 0` select would zero.
    o = tl.where(valid, o / tl.maximum(denom, 1e-30)[:, None], 0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


def _combine_heads_per_program(num_q_heads: int, num_splits: int, head_dim: int) -> int:
    """Up to 4 heads per combine program, at most 8K partial elements each: with one head per program the combiner
    spends most of its time on per-program latency (docs/tuning.md)."""
    heads = 4
    while heads > 1 and heads * num_splits * head_dim > 8192:
        heads //= 2
    return min(heads, triton.next_power_of_2(num_q_heads))


def combine_splits(part: torch.Tensor, ml: torch.Tensor, sinks: Optional[torch.Tensor],
                   query_start_loc: torch.Tensor, out: torch.Tensor, batch: int) -> None:
    """Merge split-KV partials into ``out`` [num_tokens, num_q_heads, head_dim] (written in place).

    ``part`` [splits, num_tokens, num_q_heads, head_dim] holds unnormalized fp32 outputs and ``ml`` [splits, num_tokens,
    num_q_heads, 2] each split's running max (log2 units) and softmax denominator."""
    num_splits, num_tokens, num_q_heads, head_dim = part.shape
    heads = _combine_heads_per_program(num_q_heads, num_splits, head_dim)
    _combine_splits_kernel[(num_tokens, triton.cdiv(num_q_heads, heads))](
        part, ml, sinks if sinks is not None else ml, query_start_loc, out, out.stride(0), out.stride(1),
        num_tokens, batch,
        NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, HAS_SINKS=sinks is not None,
        HEADS_PER_PROGRAM=heads, num_warps=4 if head_dim * heads >= 128 else 2,
    )


# ---- launch heuristics --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _centroids(bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Lloyd-Max levels in the score operand's dtype (fp16 on GPU), so a gather needs no conversion."""
    return lloyd_max(bits)[0].to(dtype).to(device)


@functools.lru_cache(maxsize=None)
def _rotation_signs(head_dim: int, device: torch.device) -> torch.Tensor:
    """float32 [head_dim] on ``device``: the +-1 signs the in-kernel query rotation multiplies by."""
    return rotation_signs(head_dim).to(torch.float32).to(device)


@functools.lru_cache(maxsize=None)
def _centroid_pairs(device: torch.device) -> torch.Tensor:
    """int32 [256]: entry b holds fp16 centroid[b & 15] in its low half and centroid[b >> 4] in its high half."""
    bits = lloyd_max(4)[0].to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    byte = torch.arange(256)
    return (bits[byte & 15] | (bits[byte >> 4] << 16)).to(torch.int32).to(device)


@functools.lru_cache(maxsize=None)
def _magnitudes(bits: int) -> tuple[float, ...]:
    """The non-negative Lloyd-Max levels, smallest first, padded to 8 (the select-tree lookup's scalars)."""
    c = lloyd_max(bits)[0].tolist()
    mags = c[len(c) // 2 :]
    return tuple(mags + [0.0] * (8 - len(mags)))


def _interpreting(device: torch.device) -> bool:
    return device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1"


# (BLOCK_N, num_warps, prefetch) per format family for decode-sized (M = 16) query tiles whose program scans >= 512
# keys (large batches, long contexts), for decode tiles with shorter splits (small batch, short context: the e2e
# decode step), and for block-sized (M >= 32) tiles. From sweeps on an H200 at 32 x 8K keys (32 q heads)
# and 1 x 8K keys (16 q heads, the e2e model), see docs/tuning.md. The TurboQuant kernels are latency-bound at 2 warps
# per scheduler (register-limited occupancy), so they drop the register prefetch, which frees registers.
# Long decode splits of quantized formats run one warp per program, with twice the splits: a warp owns all 16 rows
# and the whole key tile, so the softmax and the operand exchange need no barrier, and twice the programs hide the
# latency.
_TILES = {
    "dense": ((32, 2, True), (32, 2, True), (64, 4, True)),
    "fp8": ((64, 1, False), (128, 4, False), (128, 4, False)),
    "turboquant_k8v4": ((64, 1, False), (128, 4, False), (128, 4, False)),
    "mse4": ((32, 1, False), (128, 4, False), (128, 4, False)),
    "mse3": ((32, 1, False), (128, 4, False), (128, 4, False)),
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
    quantized formats in keys-as-M and decode tiles, except keys-as-M tiles of 3-bit values, which gain nothing alone
    and slow the e2e verify step. bf16 tiles keep the next tile in registers instead, and 64-row tiles are not
    measured (H200 figures in docs/tuning.md)."""
    if _family(fmt) == "dense":
        return False
    return regime < 2 or (keys_as_m and fmt.value_bits != 3)


def _row_loads(fmt: Optional[CacheFormat]) -> bool:
    """Whether 3-bit keys of keys-as-M tiles load one cache row per warp-wide load (``_load_side``): faster for
    k3v4_nc; slower beside 3-bit values (3bit_nc) and in decode tiles (H200 figures in docs/tuning.md)."""
    return fmt is not None and fmt.key_mode == "mse" and fmt.key_bits == 3 and fmt.value_bits != 3


def launch_config(num_tokens: int, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  block_size: int, max_blocks: int, num_sms: int, fmt: Optional[CacheFormat] = None,
                  block_q: Optional[int] = None) -> dict:
    """Tile sizes and split count from shapes only (never tensor values), so a CUDA graph can capture it.

    ``block_q`` (query tokens per M tile) overrides the choice from the average query length; everything that depends
    on the tile's rows follows it."""
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    avg_q = max(1, -(-num_tokens // max(batch, 1)))
    # M = 64 tiles (Hopper wgmma) at head_dim 64 hit an illegal address on an H200 (Triton 3.6), cause not yet
    # found; 32-row tiles there run the mma.sync path, which is correct.
    max_m = 64 if head_dim >= 128 else 32
    if block_q is None:
        block_q = max(1, min(triton.next_power_of_2(avg_q), max(1, max_m // group_pad)))
    block_m = max(16, block_q * group_pad)
    num_tiles = num_tokens if block_q == 1 else num_tokens // block_q + batch
    programs = max(1, num_tiles * num_kv_heads)
    # Enough programs to fill every SM a few times over, but no split shorter than ~256 keys.
    want = -(-4 * num_sms // programs)
    cap = max(1, (max_blocks * block_size) // 256)
    splits = 1
    while splits * 2 <= min(want, cap, 64):
        splits *= 2
    regime = 2 if block_m > 16 else (0 if max_blocks * block_size // splits >= 512 else 1)
    block_n, num_warps, prefetch = _TILES[_family(fmt)][regime]
    if block_m > 32 and _family(fmt) == "dense":
        # At 64-row tiles the prefetched fp16 tile spills, which costs more than the prefetch hides (docs/tuning.md).
        prefetch = False
    if head_dim > 128:
        block_n, num_warps = min(block_n, 32), 4  # keep the [BLOCK_N, head_dim] tiles in registers
    if num_warps == 1:
        splits = min(2 * splits, 128)  # regime 0 keeps >= 256 keys per split
    keys_as_m = _keys_as_m(block_m, head_dim, fmt)
    ids_ahead = keys_as_m or _IDS_AHEAD[_family(fmt)][regime]
    return dict(group_pad=group_pad, block_q=block_q, block_m=block_m, block_n=block_n, num_tiles=num_tiles,
                num_splits=splits, num_warps=num_warps, num_stages=1, lut_select=False, key_pairs=True, pair_asm=True,
                value_halves=_value_halves(block_m, fmt), prefetch=prefetch, keys_as_m=keys_as_m,
                ids_ahead=ids_ahead, prefetch_l2=ids_ahead and _prefetches_l2(fmt, keys_as_m, regime),
                row_loads=_row_loads(fmt))


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
    lut_select: Optional[bool] = None,
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
    # The kernels read int32 indices; int64 ones (torch.tensor's default) are narrowed here (a no-op for int32).
    block_table, seq_lens, query_start_loc = (t.to(torch.int32) for t in (block_table, seq_lens, query_start_loc))
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0 or batch == 0:
        return out
    device = query.device
    interp = _interpreting(device)
    num_sms = 132 if interp else _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    cfg = launch_config(num_tokens, batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_sms,
                        fmt, block_q)
    for key, val in (("num_splits", num_splits), ("block_n", block_n), ("num_warps", num_warps),
                     ("num_stages", num_stages), ("lut_select", lut_select), ("key_pairs", key_pairs),
                     ("prefetch", prefetch), ("value_halves", value_halves), ("pair_asm", pair_asm),
                     ("keys_as_m", keys_as_m), ("ids_ahead", ids_ahead), ("prefetch_l2", prefetch_l2),
                     ("row_loads", row_loads)):
        if val is not None:
            cfg[key] = val
    splits = cfg["num_splits"]

    key_mode, value_mode = _KEY_MODES[fmt.key_mode], _VALUE_MODES[fmt.value_mode]
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
    rotate_in_kernel = key_mode == 2 and head_dim <= 128 and rotate_query_in_kernel
    if key_mode == 2 and not rotate_in_kernel:
        q = query.float() @ rotation_matrix(head_dim, device)
    signs = _rotation_signs(head_dim, device) if rotate_in_kernel else None
    if split_query is None:
        split_query = query.dtype == torch.float32 and not interp
    if interp:
        # The interpreter's bf16 matmul is unreliable; fp32 keeps it exact enough to compare.
        qk_dtype = pv_dtype = tl.float32
    else:
        dense = tl.bfloat16 if fmt.dense_dtype == torch.bfloat16 else tl.float16
        qk_dtype = dense if key_mode == 0 else tl.float16  # fp8 and centroids are exact in fp16
        pv_dtype = dense if value_mode == 0 else tl.float16  # fp8 and small integer codes too
    fp8 = tl.float8e5 if fmt.fp8_dtype == torch.float8_e5m2 else tl.float8e4nv
    cache_16 = kv_cache.view(fmt.dense_dtype or torch.float16)
    cent = _centroids(fmt.key_bits if key_mode == 2 else 4, torch.float32 if interp else torch.float16, device)
    pairs = _centroid_pairs(device) if key_mode == 2 and fmt.key_bits == 4 else cent
    qk_scale = scale * _LOG2E * (k_scale if key_mode == 1 else 1.0)
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
        *_magnitudes(fmt.key_bits if key_mode == 2 else 4),
        STRIDE_CB=kv_cache.stride(0), STRIDE_CS=kv_cache.stride(1), STRIDE_CH=kv_cache.stride(2),
        GROUP=num_q_heads // num_kv_heads, GROUP_PAD=cfg["group_pad"], HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_Q=cfg["block_q"], BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], NUM_SPLITS=splits,
        CAUSAL=causal, HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
        KEY_MODE=key_mode, KEY_BITS=fmt.key_bits, VALUE_MODE=value_mode, VALUE_BITS=fmt.value_bits,
        K_NORM_OFF=fmt.key_norm_offset(head_dim), V_OFF=fmt.value_offset(head_dim),
        V_SCALE_OFF=fmt.value_scale_offset(head_dim),
        FP8=fp8, QK_DTYPE=qk_dtype, PV_DTYPE=pv_dtype, LUT_SELECT=cfg["lut_select"],
        KEY_PAIRS=cfg["key_pairs"], PREFETCH=cfg["prefetch"],
        SPLIT_Q=split_query, V_HALVES=cfg["value_halves"], PAIR_ASM=cfg["pair_asm"] and not interp,
        LOG2_D=head_dim.bit_length() - 1, ROTATE_Q=rotate_in_kernel, KEYS_AS_M=cfg["keys_as_m"],
        # The prefetch is inline PTX, which the interpreter cannot run; it changes no output bit (test_gpu.py).
        IDS_AHEAD=cfg["ids_ahead"], PREFETCH_L2=cfg["prefetch_l2"] and not interp, ROW_LOADS=cfg["row_loads"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **({} if maxnreg is None else dict(maxnreg=maxnreg)),
    )
    if splits > 1:
        combine_splits(target, ml, sinks, query_start_loc, out, batch)
    return out
