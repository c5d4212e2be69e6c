"""paged_attention as a custom op: opcheck, torch.compile(fullgraph=True) with the store, and bad inputs."""
import pytest
import torch

import tqops

from .cases import make_case


@pytest.mark.parametrize("fmt,sinks,window", [("turboquant_4bit_nc", True, None), ("fp8_e4m3", False, 9),
                                              ("bf16", False, None)])
def test_opcheck(fmt, sinks, window):
    case = make_case(fmt, q_lens=[3, 1], seq_lens=[21, 40], num_kv_heads=2, group=2, causal=window is None,
                     sliding_window=window, with_sinks=sinks, seed=9)
    torch.library.opcheck(
        torch.ops.tqops.paged_attention.default,
        (case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc, case.fmt.name,
         case.causal, case.sliding_window, case.sinks, 0.125, 1.0, 1.0),
    )


@pytest.mark.parametrize("fmt", ["turboquant_k3v4_nc", "fp8_e5m2"])
def test_compiled_store_then_attention_matches_eager(fmt):
    case = make_case(fmt, q_lens=[4, 16], seq_lens=[30, 16], num_kv_heads=2, group=4, causal=False, seed=4)
    new_k = torch.randn(20, 2, 64)
    new_v = torch.randn(20, 2, 64)
    # This step's tokens go to the last positions of each sequence (rewritten with fresh K/V).
    slots = []
    bs = case.cache.shape[1]
    for b, (q_len, seq_len) in enumerate(zip([4, 16], [30, 16])):
        for j in range(seq_len - q_len, seq_len):
            slots.append(int(case.block_table[b, j // bs]) * bs + j % bs)
    slot_mapping = torch.tensor(slots)

    def step(query, cache, k, v):
        tqops.kv_store(k, v, cache, slot_mapping, fmt)
        return tqops.paged_attention(query, cache, case.block_table, case.seq_lens, case.query_start_loc, fmt,
                                     causal=False, sinks=None)

    eager_cache, compiled_cache = case.cache.clone(), case.cache.clone()
    want = step(case.query, eager_cache, new_k, new_v)
    got = torch.compile(step, fullgraph=True)(case.query, compiled_cache, new_k, new_v)
    assert torch.equal(compiled_cache, eager_cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _base():
    case = make_case("turboquant_4bit_nc", q_lens=[2, 3], seq_lens=[20, 3], num_kv_heads=2, group=2, seed=0)
    return dict(query=case.query, kv_cache=case.cache, block_table=case.block_table, seq_lens=case.seq_lens,
                query_start_loc=case.query_start_loc, fmt="turboquant_4bit_nc")


def _i32(*v):
    return torch.tensor(v, dtype=torch.int32)


BAD = {
    "query_dtype": (dict(query=lambda a: a["query"].to(torch.int32)), TypeError, "query has dtype int32"),
    "query_rank": (dict(query=lambda a: a["query"][0]), ValueError, "query must have 3 dims"),
    "head_dim": (dict(query=lambda a: a["query"][..., :32]), ValueError, "head_dim=32"),
    "heads": (dict(query=lambda a: a["query"][:, :3]), ValueError, "not a multiple"),
    "format": (dict(fmt=lambda a: "int4"), ValueError, "unknown cache format"),
    "slot_bytes": (dict(fmt=lambda a: "fp8_e4m3"), ValueError, "bytes per slot"),
    "cache_dtype": (dict(kv_cache=lambda a: a["kv_cache"].float()), TypeError, "kv_cache has dtype float32"),
    "device": (dict(query=lambda a: a["query"].to("meta")), ValueError, "query is on meta"),
    "bt_dtype": (dict(block_table=lambda a: a["block_table"].short()), TypeError, "block_table has dtype int16"),
    "bt_rows": (dict(block_table=lambda a: a["block_table"][:1]), ValueError, "block_table has 1 rows"),
    "seq_lens_dtype": (dict(seq_lens=lambda a: a["seq_lens"].float()), TypeError, "seq_lens has dtype float32"),
    "qsl_len": (dict(query_start_loc=lambda a: a["query_start_loc"][:2]), ValueError, "batch \\+ 1"),
    "qsl_last": (dict(query_start_loc=lambda a: _i32(0, 2, 4)), ValueError, "end at num_tokens=5"),
    "qsl_monotone": (dict(query_start_loc=lambda a: _i32(0, 6, 5), seq_lens=lambda a: _i32(20, 20)), ValueError,
                     "non-decreasing"),
    "q_len_gt_seq": (dict(seq_lens=lambda a: _i32(20, 2)), ValueError, "q_len=3"),
    "seq_too_long": (dict(seq_lens=lambda a: _i32(20, 999)), ValueError, "seq_lens\\[1\\] = 999"),
    "block_range": (dict(block_table=lambda a: a["block_table"].clone().fill_(99)), IndexError, "block_table\\[0, 0\\]"),
    "block_negative": (dict(block_table=lambda a: a["block_table"].clone().fill_(-1)), IndexError, "out of range"),
}


@pytest.mark.parametrize("name", BAD, ids=list(BAD))
def test_bad_inputs(name):
    changes, exc, msg = BAD[name]
    args = _base()
    for k, f in changes.items():
        args[k] = f(args)
    with pytest.raises(exc, match=msg):
        tqops.paged_attention(**args)


BAD_KW = {
    "scale": (dict(scale=-1.0), ValueError, "scale must be a positive"),
    "scale_type": (dict(scale="big"), TypeError, "scale must be a Python float"),
    "k_scale": (dict(k_scale=0.0), ValueError, "k_scale"),
    "window": (dict(sliding_window=0), ValueError, "sliding_window must be positive"),
    "window_type": (dict(sliding_window=2.5), TypeError, "sliding_window must be an int"),
    "causal": (dict(causal=1), TypeError, "causal must be a bool"),
    "sinks_dtype": (dict(sinks=torch.zeros(4, dtype=torch.float16)), TypeError, "sinks has dtype float16"),
    "sinks_len": (dict(sinks=torch.zeros(3)), ValueError, "one per query head"),
}


@pytest.mark.parametrize("name", BAD_KW, ids=list(BAD_KW))
def test_bad_keywords(name):
    kw, exc, msg = BAD_KW[name]
    with pytest.raises(exc, match=msg):
        tqops.paged_attention(**_base(), **kw)


def test_value_checks_skipped_while_compiling(monkeypatch):
    # Under torch.compile the checks that need a host sync are skipped; the op then drops the keys of out-of-range
    # block entries, so with every entry out of range no key is visible and every row is 0.
    args = _base()
    args["block_table"] = args["block_table"].clone().fill_(99)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = tqops.paged_attention(**args)
    assert torch.equal(out, torch.zeros_like(out))
