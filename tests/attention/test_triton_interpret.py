"""The Triton kernel under TRITON_INTERPRET=1 on tiny shapes, against the torch reference."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tqops
from tqops.attention.naive import paged_attention_naive

from .cases import make_case
from .interp import paged_attention_interpreted


def _run(case, scale=0.125, **overrides):
    args = (case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc, case.fmt,
            case.causal, case.sliding_window, case.sinks, scale, case.k_scale, case.v_scale)
    out = paged_attention_interpreted(*args, **overrides)
    ref = paged_attention_naive(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(out).any()
    tol = 2e-3 if case.query.dtype == torch.float32 else 4e-3 if case.query.dtype == torch.float16 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    return out


@pytest.mark.parametrize("fmt", tqops.FORMATS)
def test_formats(fmt):
    i = tqops.FORMATS.index(fmt)
    case = make_case(fmt, q_lens=[1, 5], seq_lens=[20, 37], group=2, causal=bool(i % 2), with_sinks=i % 3 == 0,
                     dtype=torch.float16, seed=i, k_scale=0.5 if i in (2, 3, 4) else 1.0, v_scale=2.0)
    _run(case, num_splits=1 + i % 2, block_n=16)


@pytest.mark.parametrize("causal", [True, False])
def test_window_query_tiles_and_wide_key_tiles(causal):
    # block_q=4 puts several tokens x the GQA group in one M tile; block_n=32 > block_size spans cache blocks.
    case = make_case("turboquant_4bit_nc", q_lens=[6, 0, 3], seq_lens=[40, 9, 3], num_kv_heads=2, group=2,
                     causal=causal, sliding_window=7, with_sinks=True, pad_entry=-3, seed=7)
    _run(case, num_splits=2, block_n=32, block_q=4)


@pytest.mark.parametrize("keys_as_m", [False, True], ids=["rows-as-m", "keys-as-m"])
def test_three_bit_head_dim_128_bf16_queries(keys_as_m):
    # keys-as-m: the 3-bit keys and the query in word-major channel order (_word_major), at head_dim 128.
    case = make_case("turboquant_3bit_nc", q_lens=[2], seq_lens=[33], head_dim=128, group=4, causal=False,
                     dtype=torch.bfloat16, seed=11)
    _run(case, num_splits=2, block_n=16, keys_as_m=keys_as_m)


@pytest.mark.parametrize("block_n", [32, 64, 128])
@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4",
                                 "fp8_e5m2"])
def test_keys_as_m_wide_tiles(fmt, block_n):
    # Keys as M: tiles of 64 / 128 keys keep per-thread partial sums over 32 key groups (_key_partials), 32-key
    # tiles one; whole tiles, causal boundary tiles, sinks, and a split that ends inside a tile.
    case = make_case(fmt, q_lens=[3, 16], seq_lens=[150, 201], group=2, causal=True, with_sinks=True,
                     dtype=torch.float16, seed=block_n)
    _run(case, num_splits=2, block_n=block_n, block_q=16, keys_as_m=True)


@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("variant", [dict(prefetch=False), dict(key_pairs=False),
                                     dict(key_pairs=True, prefetch=True),
                                     dict(rotate_query_in_kernel=False), dict(split_query=True),
                                     dict(value_halves=True), dict(value_halves=False),
                                     dict(keys_as_m=True), dict(keys_as_m=True, split_query=True),
                                     dict(keys_as_m=True, row_loads=False), dict(keys_as_m=True, row_loads=True),
                                     dict(prefetch=False, ids_ahead=False)],
                         ids=["no-prefetch", "centroid-gather", "pairs-prefetch", "host-rotation", "split-query",
                              "value-halves", "value-interleaved", "keys-as-m", "keys-as-m-split-query",
                              "keys-as-m-no-row-loads", "keys-as-m-row-loads", "no-prefetch-no-ids-ahead"])
def test_kernel_variants(fmt, variant):
    case = make_case(fmt, q_lens=[1, 4], seq_lens=[35, 50], group=4, causal=True, dtype=torch.float32, seed=5)
    _run(case, num_splits=2, block_n=16, **variant)


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(["bf16", "fp8_e4m3", "turboquant_4bit_nc", "turboquant_k3v4_nc"]),
       q_len=st.integers(1, 6), context=st.integers(0, 90), window=st.one_of(st.none(), st.integers(1, 70)),
       causal=st.booleans(), splits=st.sampled_from([1, 2, 4]), prefetch=st.booleans(), keys_as_m=st.booleans(),
       ids_ahead=st.booleans(), seed=st.integers(0, 99))
# The window of the tile's first row starts 3 keys before a tile boundary, the last row's 3 keys after it: the tile
# is whole for the first row only (random draws rarely hit this alignment); causal without prefetch, and non-causal
# through the prefetching loop.
@example(fmt="turboquant_4bit_nc", q_len=4, context=60, window=29, causal=True, splits=1, prefetch=False,
         keys_as_m=False, ids_ahead=True, seed=1)
@example(fmt="turboquant_4bit_nc", q_len=4, context=60, window=29, causal=True, splits=1, prefetch=False,
         keys_as_m=False, ids_ahead=False, seed=1)
@example(fmt="bf16", q_len=4, context=60, window=29, causal=False, splits=1, prefetch=True, keys_as_m=True,
         ids_ahead=True, seed=1)
def test_whole_and_boundary_key_tiles(fmt, q_len, context, window, causal, splits, prefetch, keys_as_m, ids_ahead,
                                      seed):
    # 16-key tiles over up to 96 keys: a program sees masked tiles at the window start, whole tiles (run without
    # masks) in the middle, and masked tiles at the diagonal and at the end of its split, in every combination.
    case = make_case(fmt, q_lens=[q_len, 2], seq_lens=[q_len + context, 2 + context // 2], group=2, causal=causal,
                     sliding_window=window, dtype=torch.float16, seed=seed)
    _run(case, num_splits=splits, block_n=16, block_q=4, prefetch=prefetch, keys_as_m=keys_as_m, ids_ahead=ids_ahead)


def test_decode_default_config():
    case = make_case("turboquant_k3v4_nc", q_lens=[1, 1, 1], seq_lens=[1, 17, 48], group=4, seed=2)
    _run(case)


@pytest.mark.parametrize("block_q", [None, 1], ids=["block_q_auto", "block_q_1"])
@pytest.mark.parametrize("splits", [1, 2], ids=["one_split", "two_splits"])
def test_padding_tokens_are_zero(splits, block_q):
    # Each way of writing the padding rows: the host fill (multi-token tiles, one split), the spare programs
    # (one-token tiles, one split), the split combiner. The output comes from torch.empty (NaN under the poisoning
    # conftest) wherever the kernels are meant to write every row.
    case = make_case("fp8_e5m2", q_lens=[2, 3], seq_lens=[18, 30], num_kv_heads=2, group=3, causal=False, seed=4)
    padded = torch.cat([case.query, torch.full_like(case.query[:3], float("nan"))])
    args = (padded, case.cache, case.block_table, case.seq_lens, case.query_start_loc, case.fmt,
            False, None, None, 0.125, 1.0, 1.0)
    out = paged_attention_interpreted(*args, num_splits=splits, block_n=16, block_q=block_q)
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))
    ref = paged_attention_naive(case.query, *args[1:])
    torch.testing.assert_close(out[:5].float(), ref.float(), rtol=2e-3, atol=2e-3)


@settings(max_examples=25, deadline=None)
@given(num_kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 5]), splits=st.sampled_from([2, 4, 8]),
       with_sinks=st.booleans(), q_len=st.integers(1, 4), seed=st.integers(0, 99))
def test_split_combiner_head_blocks(num_kv_heads, group, splits, with_sinks, q_len, seed):
    # The combiner merges several heads per program; head counts that are not a multiple of that (3, 5, 15 heads)
    # exercise the masked last head block, sinks the per-head correction.
    case = make_case("bf16", q_lens=[q_len, 1], seq_lens=[q_len + 40, 25], num_kv_heads=num_kv_heads, group=group,
                     with_sinks=with_sinks, dtype=torch.float16, seed=seed)
    _run(case, num_splits=splits, block_n=16)


@given(num_q_heads=st.integers(1, 64), splits=st.sampled_from([2, 4, 8, 16, 32, 64]),
       head_dim=st.sampled_from([32, 64, 128, 256]))
def test_combiner_heads_per_program_caps_partials(num_q_heads, splits, head_dim):
    from tqops.attention.combine import _combine_heads_per_program

    heads = _combine_heads_per_program(num_q_heads, splits, head_dim)
    assert heads in (1, 2, 4) and heads <= max(1, 2 * num_q_heads - 1)  # a power of two, not past next_pow2(H)
    assert heads == 1 or heads * splits * head_dim <= 8192  # partials per program stay in registers
    if num_q_heads >= 4 and 4 * splits * head_dim <= 8192:
        assert heads == 4
