"""The inline-PTX code decoders of the CUDA kernel, run by a tiny PTX interpreter, against the format's tables."""
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqops.attention import decoders
from tqops.quant import lloyd_max

MASK32 = 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte sel[i] & 7 of (b:a), or its sign if sel[i] & 8."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _sub_f16x2(a: int, b: int) -> int:
    halves = lambda w: np.array([w & 0xFFFF, w >> 16], dtype=np.uint16).view(np.float16)
    diff = (halves(a) - halves(b)).astype(np.float16).view(np.uint16)
    return int(diff[0]) | (int(diff[1]) << 16)


_OPS = {
    "mov.b32": lambda v: v[0], "and.b32": lambda v: v[0] & v[1], "or.b32": lambda v: v[0] | v[1],
    "xor.b32": lambda v: v[0] ^ v[1], "not.b32": lambda v: ~v[0], "shl.b32": lambda v: v[0] << v[1],
    "shr.u32": lambda v: v[0] >> v[1], "sub.u32": lambda v: v[0] - v[1], "prmt.b32": lambda v: _prmt(*v),
    "sub.f16x2": lambda v: _sub_f16x2(*v),
}


def run_ptx(asm: str, word: int) -> list[int]:
    """Execute the straight-line PTX block on input register $4; returns outputs $0..$3."""
    regs = {"$4": word}
    for line in asm.strip("{}\n").split("\n"):
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *srcs = [x.strip() for x in args.split(",")]
        regs[dst] = _OPS[op]([regs[x] if x in regs else int(x, 0) for x in srcs]) & MASK32
    return [regs[f"${j}"] for j in range(4)]


def _f16_bits(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.float16).view(torch.int16)) & 0xFFFF


def _pair(lo: float, hi: float) -> int:
    return _f16_bits(lo) | (_f16_bits(hi) << 16)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, MASK32))
def test_4bit_key_and_value_decoders(word):
    levels = lloyd_max(4)[0].tolist()
    keys = run_ptx(decoders._PAIR4_ASM.value, word)
    values = run_ptx(decoders._UNIFORM4_ASM.value, word)
    for j in range(4):
        byte = (word >> (8 * j)) & 0xFF
        assert keys[j] == _pair(levels[byte & 15], levels[byte >> 4])
        assert values[j] == _pair(byte & 15, byte >> 4)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=8, max_size=8))
def test_3bit_key_and_value_decoders(codes):
    levels = lloyd_max(3)[0].tolist()
    word = sum(c << (4 * k) for k, c in enumerate(codes))  # the nibble word _load_side builds: channel k in nibble k
    keys = run_ptx(decoders._PAIR3_ASM.value, word)
    values = run_ptx(decoders._UNIFORM4_ASM.value, word)
    for j in range(4):
        assert keys[j] == _pair(levels[codes[2 * j]], levels[codes[2 * j + 1]])
        assert values[j] == _pair(codes[2 * j], codes[2 * j + 1])


def test_every_4bit_byte():
    levels = lloyd_max(4)[0].tolist()
    for word in range(0, 1 << 16, 257):  # bytes 0..255 in every position
        word |= word << 16
        keys = run_ptx(decoders._PAIR4_ASM.value, word)
        for j in range(4):
            byte = (word >> (8 * j)) & 0xFF
            assert keys[j] == _pair(levels[byte & 15], levels[byte >> 4])
