"""In-register decoders of cache tiles: packed codes to fp16/bf16 operands, by byte-permute PTX or table gathers."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv.codecs import MODE_DENSE, MODE_FP8
from ..quant import lloyd_max

# Every decoded tile is [BLOCK_N, HEAD_DIM] in natural channel order: packed codes are unpacked per byte (4-bit) or
# per nibble word (3-bit) and interleaved back with tl.join + reshape (free in registers), so the query, the
# accumulator and the output all use contiguous, vectorized loads and stores, and each tile costs one dot for scores
# and one for values.


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
def _centroid(code, cent_ptr):
    """Lloyd-Max level of each code: a gather from the table (in the operand's dtype)."""
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
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, cent_ptr, pair_ptr, KEY_PAIRS: tl.constexpr,
                 ASM: tl.constexpr = False,
                 WORD_MAJOR: tl.constexpr = False):
    """The raw tile of a dense, fp8 or MSE side -> the [BLOCK_N, HEAD_DIM] operand in dtype OUT, channels in order
    (with WORD_MAJOR, for 3-bit MSE keys: in the order of ``_word_major``).

    ASM (CUDA): MSE codes decode with byte permutes in inline PTX, no memory access. Otherwise KEY_PAIRS: a 4-bit
    MSE byte indexes a 256-entry table of fp16 centroid pairs, one gather for two channels.
    """
    if MODE == MODE_DENSE:
        x = raw.to(tl.float32).to(OUT)
    elif MODE == MODE_FP8:
        x = raw.to(FP8, bitcast=True).to(OUT)
    elif ASM:
        x = _pairs_operand(_permute_pairs(raw, True, BITS, BLOCK_N, HEAD_DIM, WORD_MAJOR), OUT, BLOCK_N, HEAD_DIM)
    elif KEY_PAIRS and BITS == 4:
        x = _pairs_operand(tl.load(pair_ptr + raw.to(tl.int32)), OUT, BLOCK_N, HEAD_DIM)
    else:
        code = _codes(raw, BITS, BLOCK_N, HEAD_DIM)
        x = _centroid(code, cent_ptr).to(OUT)
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
