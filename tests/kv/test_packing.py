"""naive.pack_codes / unpack_codes: round trips, and the 3-bit bit layout that the attention kernel decodes."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqops.kv.naive import pack_codes, unpack_codes


def _spec_bit(head_dim: int, channel: int, bit: int) -> int:
    """Bit index in the packed row of bit ``bit`` of ``channel``'s 3-bit code, written out from the layout: chunk n
    (6 bytes) holds channels 8n + j and d/2 + 8n + j as x_j and x_(8 + j); x_i (i < 12) is nibble i % 4 of halfword
    i // 4, bits 0-2; bit q of x_(12 + k) is bit 3 of nibble k of halfword q."""
    half, j = divmod(channel, head_dim // 2)
    n, j = divmod(j, 8)
    i = 8 * half + j
    if i < 12:
        return 48 * n + 16 * (i // 4) + 4 * (i % 4) + bit
    return 48 * n + 16 * bit + 4 * (i - 12) + 3


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_3bit_layout_matches_the_spec(head_dim):
    codes = torch.randint(0, 8, (3, head_dim), generator=torch.Generator().manual_seed(head_dim))
    packed = pack_codes(codes, 3)
    assert packed.shape == (3, head_dim * 3 // 8) and packed.dtype == torch.uint8
    bits = ((packed.long()[..., None] >> torch.arange(8)) & 1).flatten(-2)  # little-endian bit stream per row
    for c in range(head_dim):
        for b in range(3):
            assert torch.equal(bits[:, _spec_bit(head_dim, c, b)], (codes[:, c] >> b) & 1), (c, b)


@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([3, 4]), head_dim=st.sampled_from([64, 128, 256]), rows=st.integers(1, 5),
       seed=st.integers(0, 2**31 - 1))
def test_round_trip(bits, head_dim, rows, seed):
    codes = torch.randint(0, 1 << bits, (rows, 2, head_dim), generator=torch.Generator().manual_seed(seed))
    packed = pack_codes(codes, bits)
    assert packed.shape == (rows, 2, head_dim * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
