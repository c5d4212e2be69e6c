"""paged_attention's stated semantics, identical on the CPU reference and the Triton kernel (interpreter here, CUDA
with -m gpu): NaN propagation, int64 indices, and out-of-range metadata through the raw op."""
import dataclasses

import pytest
import torch

import tqops
from tqops.attention.naive import paged_attention_naive

from .cases import dense_oracle, make_case
from .interp import paged_attention_interpreted

FORMATS = ["bf16", "fp8_e4m3", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc"]
IMPLS = {
    "naive": paged_attention_naive,
    "triton": lambda *a: paged_attention_interpreted(*a, num_splits=2, block_n=16),
    "cuda": lambda *a: torch.ops.tqops.paged_attention(*(x.cuda() if isinstance(x, torch.Tensor) else
                                                          (x.name if isinstance(x, tqops.CacheFormat) else x)
                                                          for x in a)).cpu(),
}
IMPL_PARAMS = ["naive", pytest.param("triton", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter variant runs on CPU-only machines")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.smoke])]


def _args(case, block_table=None, seq_lens=None, query=None):
    return (case.query if query is None else query, case.cache,
            case.block_table if block_table is None else block_table,
            case.seq_lens if seq_lens is None else seq_lens, case.query_start_loc, case.fmt,
            case.causal, case.sliding_window, case.sinks, 0.125, case.k_scale, case.v_scale)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_query_makes_only_its_row_nan(fmt, impl):
    case = make_case(fmt, q_lens=[3, 2], seq_lens=[20, 37], group=2, causal=True, dtype=torch.float16, seed=3)
    query = case.query.clone()
    query[1, 0, 5] = float("nan")  # sequence 0, query 1, head 0
    out = IMPLS[impl](*_args(case, query=query)).float()
    assert out[1, 0].isnan().all()
    rest = torch.ones(out.shape[:2], dtype=torch.bool)
    rest[1, 0] = False
    assert out[rest].isfinite().all()


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("side", ["key", "value"])
def test_nan_in_an_attended_key_or_value_makes_the_rows_nan(side, impl):
    # A dense bf16 cache, so one NaN element can be planted directly in the slot bytes of one key.
    case = make_case("bf16", q_lens=[1, 1], seq_lens=[20, 37], num_kv_heads=2, group=2, causal=True,
                     dtype=torch.float16, seed=4)
    cache = case.cache.clone()
    slot = int(case.block_table[1, 0]) * cache.shape[1] + 3  # key 3 of sequence 1, kv head 1
    view = cache.view(-1, cache.shape[2], cache.shape[3]).view(torch.bfloat16)
    view[slot, 1, 7 if side == "key" else 64 + 7] = float("nan")
    case = case.__class__(**{**case.__dict__, "cache": cache})
    out = IMPLS[impl](*_args(case)).float()
    assert out[1, 2:4].isnan().any(-1).all()  # both query heads of kv head 1 attend to key 3
    assert out[0].isfinite().all() and out[1, :2].isfinite().all()


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_int64_indices_equal_int32(fmt, impl):
    case = make_case(fmt, q_lens=[4, 1], seq_lens=[24, 40], group=2, causal=False, dtype=torch.float16, seed=5)
    want = IMPLS[impl](*_args(case))
    args = list(_args(case, block_table=case.block_table.long(), seq_lens=case.seq_lens.long()))
    args[4] = case.query_start_loc.long()
    assert torch.equal(IMPLS[impl](*args), want)


BIG = 2**32  # a value past int32, which a plain narrowing to int32 would wrap (BIG + 1 -> 1)


def _past_int32(case, where):
    """int64 block_table, seq_lens, query_start_loc of ``case`` with one value past int32 at ``where``."""
    table, lens, starts = case.block_table.long(), case.seq_lens.long(), case.query_start_loc.long()
    if where == "block-entry":
        table[0, 1] = BIG + 1  # sequence 0's keys 16-19: dropped, where a wrapped 1 reads block 1
    elif where == "seq-len":
        lens[1] = BIG + 16  # sees every key of its table (32 written keys), where a wrapped 16 reads 16
    elif where == "negative-seq-len":
        lens[1] = -BIG + 32  # sees no key, where a wrapped 32 reads 32
    else:
        starts[-1] = BIG + int(starts[-1])  # its queries sit before every key, where a wrapped entry is its own
    return table, lens, starts


@pytest.mark.parametrize("impl", [p for p in IMPL_PARAMS if getattr(p, "values", [p])[0] != "naive"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("where", ["block-entry", "seq-len", "negative-seq-len", "query-start-loc"])
def test_indices_past_int32_are_out_of_range_as_on_cpu(where, causal, impl):
    """The raw op on int64 values past int32: the kernels narrow them without wrapping (block entries to -1,
    dropped; seq_lens and query_start_loc saturated), so they give the CPU op's result; the wrapper rejects them."""
    case = make_case("turboquant_4bit_nc", q_lens=[3, 2, 2], seq_lens=[20, 32, 40], group=2, causal=causal,
                     dtype=torch.float16, seed=7, pad_entry=-1)
    table, lens, starts = _past_int32(case, where)
    args = list(_args(case, block_table=table, seq_lens=lens))
    args[4] = starts
    want = paged_attention_naive(*args).double()
    out = IMPLS[impl](*args).double()
    if impl == "cuda":  # 16-bit dot operands on the GPU
        assert float((out - want).norm() / want.norm()) < 1.5e-2
    else:
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
    name = {"block-entry": "block_table", "query-start-loc": "query_start_loc"}.get(where, "seq_lens")
    with pytest.raises(IndexError, match=rf"{name}\[\d(, \d)?\] = -?\d+ does not fit int32"):
        tqops.paged_attention(case.query, case.cache, table, lens, starts, case.fmt, causal=causal)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e5m2", "turboquant_k3v4_nc"])
def test_raw_op_drops_keys_of_out_of_range_blocks(fmt, impl):
    # Entries 8 and -7 in a table of 8-block cache, and a sequence longer than its table: the raw op (no value
    # checks) leaves those keys out on every device instead of clamping them into other blocks.
    case = make_case(fmt, q_lens=[3, 2], seq_lens=[40, 32], group=2, causal=True, dtype=torch.float16, seed=6,
                     extra_blocks=0)
    num_blocks = case.cache.shape[0]
    table = case.block_table.clone()
    table[0, 1] = num_blocks
    table[1, 0] = -7
    table[1, 2] = -1
    seq_lens = case.seq_lens.clone()
    seq_lens[1] = table.shape[1] * case.cache.shape[1] + 5  # past the table: the last 5 keys have no block
    out = IMPLS[impl](*_args(case, block_table=table, seq_lens=seq_lens)).double()
    want = dense_oracle(dataclasses.replace(case, block_table=table, seq_lens=seq_lens), 0.125)
    if impl == "cuda":  # 16-bit dot operands on the GPU
        assert float((out - want).norm() / want.norm()) < 1.5e-2
    else:
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
    with pytest.raises(IndexError, match=r"block_table\[0, 1\]"):
        tqops.paged_attention(case.query, case.cache, table, case.seq_lens, case.query_start_loc, fmt)


def test_raw_op_rejects_bad_shapes_before_running():
    case = make_case("turboquant_4bit_nc", q_lens=[2, 1], seq_lens=[20, 3], num_kv_heads=2, group=2, seed=0)
    base = list(_args(case))
    base[5] = case.fmt.name
    for i, bad, exc, msg in [
        (0, case.query.to(torch.int32), TypeError, "query has dtype int32"),
        (0, case.query[:, :3], ValueError, "not a multiple"),
        (2, case.block_table.float(), TypeError, "block_table has dtype float32"),
        (4, case.query_start_loc[:2], ValueError, "batch \\+ 1"),
        (8, torch.zeros(3), ValueError, "one per query head"),
    ]:
        args = list(base)
        args[i] = bad
        with pytest.raises(exc, match=msg):
            torch.ops.tqops.paged_attention(*args)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_rows_no_sequence_covers_are_zero(impl):
    case = make_case("turboquant_4bit_nc", q_lens=[2, 1], seq_lens=[20, 3], num_kv_heads=2, group=2, seed=0)
    query = torch.cat([case.query, torch.randn(2, *case.query.shape[1:])])  # 2 padding rows past qsl[-1]
    out = IMPLS[impl](*_args(case, query=query))
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    torch.testing.assert_close(out[:3].double(), dense_oracle(case, 0.125), rtol=4e-3, atol=4e-3)
