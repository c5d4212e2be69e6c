"""gated_delta_rule and causal_conv1d on CPU: the ops against their per-sequence references, the references against
transformers' Qwen3.5 functions, calls split in two, the rollback helpers, opcheck, torch.compile and bad inputs."""
import inspect
import itertools
import logging
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tqops.deltanet import causal_conv1d, conv_state_after, gated_delta_rule, keep_mask
from tqops.deltanet import ops as dn_ops
from tqops.deltanet.naive import (causal_conv1d_naive, conv_state_after_naive, gated_delta_rule_naive,
                                  keep_mask_naive)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEADS = {"mha": (2, 2), "gqa2": (1, 2), "gqa2x2": (2, 4)}  # (Hk, Hv)


def hf(name: str):
    """transformers' own torch function (unwrapped: with fla installed its decorator would dispatch to fla)."""
    module = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    return inspect.unwrap(getattr(module, name))


def starts(lens, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=dtype)


def delta_inputs(gen, lens, pad, hk, hv, dk, dv, dtype, index_dtype=torch.int64):
    """Packed q, k, v, g, beta, state, query_start_loc for sequences of ``lens`` tokens and ``pad`` padding rows."""
    n = sum(lens) + pad
    return dict(q=torch.randn(n, hk, dk, generator=gen).to(dtype), k=torch.randn(n, hk, dk, generator=gen).to(dtype),
                v=torch.randn(n, hv, dv, generator=gen).to(dtype), g=-2 * torch.rand(n, hv, generator=gen),
                beta=torch.rand(n, hv, generator=gen), state=torch.randn(len(lens), hv, dk, dv, generator=gen),
                query_start_loc=starts(lens, index_dtype))


def conv_inputs(gen, lens, pad, c, width, dtype, weight_fp32=False, index_dtype=torch.int64):
    n = sum(lens) + pad
    return dict(x=torch.randn(n, c, generator=gen).to(dtype),
                weight=torch.randn(c, width, generator=gen).to(torch.float32 if weight_fp32 else dtype),
                conv_state=torch.randn(len(lens), c, width - 1, generator=gen).to(dtype),
                query_start_loc=starts(lens, index_dtype))


def padded(x: torch.Tensor, lens) -> torch.Tensor:
    """Packed ``[n, ...]`` -> right-padded ``[batch, max(lens), ...]`` with zeros (for g and beta: identity tokens)."""
    out = x.new_zeros(len(lens), max(lens), *x.shape[1:])
    for b, (lo, length) in enumerate(zip(starts(lens).tolist(), lens)):
        out[b, :length] = x[lo:lo + length]
    return out


def packed(x: torch.Tensor, lens, n: int) -> torch.Tensor:
    """The inverse of ``padded``, rows past sum(lens) up to ``n`` as 0."""
    out = x.new_zeros(n, *x.shape[2:])
    for b, (lo, length) in enumerate(zip(starts(lens).tolist(), lens)):
        out[lo:lo + length] = x[b, :length]
    return out


@st.composite
def varlen(draw, max_batch=4, max_len=9):
    """Sequence lengths (empty sequences and batch 0 included), padding rows and the index dtype."""
    lens = draw(st.lists(st.integers(0, max_len), max_size=max_batch))
    return lens, draw(st.sampled_from((0, 3))), draw(st.sampled_from((torch.int32, torch.int64)))


@st.composite
def delta_cases(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lens, pad, index_dtype = draw(varlen())
    hk, hv = HEADS[draw(st.sampled_from(sorted(HEADS)))]
    dk, dv = draw(st.sampled_from(((16, 32), (32, 16), (8, 8))))
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    kwargs = dict(scale=draw(st.sampled_from((None, 0.3))), use_qk_l2norm=draw(st.booleans()))
    return lens, delta_inputs(gen, lens, pad, hk, hv, dk, dv, dtype, index_dtype), kwargs


@st.composite
def conv_cases(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lens, pad, index_dtype = draw(varlen())
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    args = conv_inputs(gen, lens, pad, draw(st.sampled_from((1, 5, 24))), draw(st.integers(2, 4)), dtype,
                       weight_fp32=draw(st.booleans()), index_dtype=index_dtype)
    return lens, args, draw(st.sampled_from(("silu", None)))


def ulps(dtype: torch.dtype, n: float = 2.0) -> dict:
    eps = torch.finfo(dtype).eps
    return dict(rtol=n * eps, atol=n * eps)


# ---- the ops against their references --------------------------------------------------------------------------------

@given(delta_cases())
def test_gated_delta_rule_matches_reference(case):
    lens, args, kwargs = case
    before = {name: t.clone() for name, t in args.items()}
    o, final = gated_delta_rule(**args, **kwargs)
    want_o, want_final = gated_delta_rule_naive(*args.values(), **kwargs)
    assert o.dtype == args["v"].dtype and o.shape == args["v"].shape and final.dtype == torch.float32
    torch.testing.assert_close(o, want_o, rtol=0, atol=0)  # on CPU the op is the reference
    torch.testing.assert_close(final, want_final, rtol=0, atol=0)
    assert not o[sum(lens):].any()  # padding rows
    for b, length in enumerate(lens):
        if length == 0:
            assert torch.equal(final[b], args["state"][b])
    for name, t in args.items():
        assert torch.equal(t, before[name]), f"{name} was mutated"


@given(conv_cases())
def test_causal_conv1d_matches_reference(case):
    lens, args, activation = case
    before = {name: t.clone() for name, t in args.items()}
    y, state = causal_conv1d(**args, activation=activation)
    want_y, want_state = causal_conv1d_naive(*args.values(), activation=activation)
    assert y.dtype == args["x"].dtype and state.shape == args["conv_state"].shape and state.is_contiguous()
    # fp32 taps summed in another order than F.conv1d's, then one rounding to the dtype
    torch.testing.assert_close(y, want_y, **ulps(y.dtype, 4 if y.dtype == torch.float32 else 1))
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)  # copies of inputs
    assert not y[sum(lens):].any()
    for name, t in args.items():
        assert torch.equal(t, before[name]), f"{name} was mutated"


# ---- the references against transformers -----------------------------------------------------------------------------

HF_CASES = {"decode": [1, 1, 1], "verify": [5, 1, 3], "prefill": [70, 9]}  # 70 crosses transformers' 64-token chunk


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("lens", sorted(HF_CASES))
def test_gated_delta_rule_reference_is_transformers(lens, heads, dtype):
    """Right-padded with g = beta = 0 (identity tokens), transformers' per-token loop gives our outputs and final
    states bit for bit (the same fp32 ops in the same order); its chunked form agrees to fp32 rounding. Key heads are
    repeated to the value heads here, as the model did before transformers' functions took GQA (5.17 did not)."""
    lens, (hk, hv) = HF_CASES[lens], HEADS[heads]
    args = delta_inputs(torch.Generator().manual_seed(3), lens, 2, hk, hv, 32, 16, DTYPES[dtype])
    o, final = gated_delta_rule_naive(*args.values())
    q, k, v, g, beta = (padded(args[name], lens) for name in ("q", "k", "v", "g", "beta"))
    q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))  # key head j serves value heads j * hv / hk ...
    hf_args = dict(initial_state=args["state"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_o, want_final = hf("torch_recurrent_gated_delta_rule")(q, k, v, g, beta, **hf_args)
    torch.testing.assert_close(o, packed(want_o, lens, o.shape[0]), rtol=0, atol=0)
    torch.testing.assert_close(final, want_final, rtol=0, atol=0)
    chunk_o, chunk_final = hf("torch_chunk_gated_delta_rule")(q, k, v, g, beta, **hf_args)
    torch.testing.assert_close(packed(chunk_o, lens, o.shape[0]).float(), o.float(),
                               **(ulps(torch.bfloat16, 2) if dtype == "bf16" else dict(rtol=1e-4, atol=1e-4)))
    torch.testing.assert_close(chunk_final, final, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weight", ["weight_fp32", "weight_in_dtype"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("lens", sorted(HF_CASES))
def test_causal_conv1d_reference_is_transformers(lens, width, dtype, weight):
    """transformers' causal_conv1d_fn (new sequences: zero conv states) and causal_conv1d_update (from conv states),
    right-padded; the new conv states of the sequences of full length."""
    lens, dt = HF_CASES[lens], DTYPES[dtype]
    args = conv_inputs(torch.Generator().manual_seed(4), lens, 1, 7, width, dt, weight_fp32=weight == "weight_fp32")
    x, w, conv_state, qsl = args.values()
    hidden = padded(x, lens).transpose(1, 2)  # [batch, C, T]
    # transformers computes in the weight's dtype (then one rounding), the op in fp32; F.conv1d's zero padding and
    # our explicit zero state take different kernel paths (an fp32 ulp apart)
    tol = ulps(dt, 2 if w.dtype == torch.float32 else 4)
    y, _ = causal_conv1d_naive(x, w, torch.zeros_like(conv_state), qsl)
    want = hf("causal_conv1d_fn")(hidden, w, activation="silu")
    torch.testing.assert_close(y, packed(want.transpose(1, 2), lens, x.shape[0]), **tol)
    y, state = causal_conv1d_naive(x, w, conv_state, qsl)
    hf_state = conv_state.clone()  # causal_conv1d_update writes the new state into its argument
    want = hf("causal_conv1d_update")(hidden, hf_state, w, activation="silu")
    torch.testing.assert_close(y, packed(want.transpose(1, 2), lens, x.shape[0]), **tol)
    full = [b for b, length in enumerate(lens) if length == max(lens)]
    torch.testing.assert_close(state[full], hf_state[full], rtol=0, atol=0)


# ---- continuing from the returned states -----------------------------------------------------------------------------

@st.composite
def split_cases(draw):
    """A case and, per sequence, where its tokens are split between two calls."""
    lens, args, kwargs = draw(delta_cases())
    cuts = [draw(st.integers(0, length)) for length in lens]
    return lens, cuts, args, kwargs


def split(args_rows: dict, lens, cuts):
    """The rows of the first ``cuts[b]`` tokens of each sequence, and of the rest: two packed batches."""
    lo = starts(lens).tolist()
    first = torch.tensor([i for b, c in enumerate(cuts) for i in range(lo[b], lo[b] + c)], dtype=torch.long)
    second = torch.tensor([i for b, c in enumerate(cuts) for i in range(lo[b] + c, lo[b + 1])], dtype=torch.long)
    return ({name: t[first] for name, t in args_rows.items()}, {name: t[second] for name, t in args_rows.items()},
            first, second)


@given(split_cases())
def test_gated_delta_rule_in_two_calls_equals_one(case):
    """Exactly: each token runs the same fp32 ops from the same state, whichever call it is in."""
    lens, cuts, args, kwargs = case
    rows = {name: args[name] for name in ("q", "k", "v", "g", "beta")}
    a, b, first, second = split(rows, lens, cuts)
    o, final = gated_delta_rule(**args, **kwargs)
    qsl = args["query_start_loc"]
    o1, mid = gated_delta_rule(**a, state=args["state"], query_start_loc=starts(cuts, qsl.dtype), **kwargs)
    rest = [length - c for length, c in zip(lens, cuts)]
    o2, end = gated_delta_rule(**b, state=mid, query_start_loc=starts(rest, qsl.dtype), **kwargs)
    assert torch.equal(end, final)
    assert torch.equal(o1, o[first]) and torch.equal(o2, o[second])


@given(conv_cases(), st.data())
def test_causal_conv1d_in_two_calls_equals_one(case, data):
    lens, args, activation = case
    cuts = [data.draw(st.integers(0, length)) for length in lens]
    a, b, first, second = split({"x": args["x"]}, lens, cuts)
    y, state = causal_conv1d(**args, activation=activation)
    qsl, w = args["query_start_loc"], args["weight"]
    y1, mid = causal_conv1d(a["x"], w, args["conv_state"], starts(cuts, qsl.dtype), activation=activation)
    rest = [length - c for length, c in zip(lens, cuts)]
    y2, end = causal_conv1d(b["x"], w, mid, starts(rest, qsl.dtype), activation=activation)
    assert torch.equal(end, state)
    assert torch.equal(y1, y[first]) and torch.equal(y2, y[second])


# ---- rollback after a verify pass ------------------------------------------------------------------------------------

@given(split_cases(), st.integers(0, 2))
def test_rollback_keeps_exactly_the_accepted_tokens(case, over):
    """keep[b] accepted tokens (some keep values past the sequence's length: clamped). The masked recurrent state
    equals running the kept tokens alone exactly: a token with g = beta = 0 multiplies the state by exp(0) = 1 and
    adds outer(k, 0) = 0, and the kept tokens run the same ops as alone."""
    lens, cuts, args, kwargs = case
    keep = torch.tensor([c + over * (c == length) for c, length in zip(cuts, lens)], dtype=torch.int64)
    qsl, n = args["query_start_loc"], args["q"].shape[0]
    mask = keep_mask(qsl, keep, n)
    assert torch.equal(mask, keep_mask_naive(qsl, keep, n))
    m = mask[:, None]
    _, masked = gated_delta_rule(**{**args, "g": args["g"] * m, "beta": args["beta"] * m}, **kwargs)
    a, _, _, _ = split({name: args[name] for name in ("q", "k", "v", "g", "beta")}, lens, cuts)
    _, kept = gated_delta_rule(**a, state=args["state"], query_start_loc=starts(cuts, qsl.dtype), **kwargs)
    assert torch.equal(masked, kept)

    conv = conv_inputs(torch.Generator().manual_seed(5), lens, n - sum(lens), 6, 4, args["v"].dtype)
    want = conv_state_after_naive(conv["x"], conv["conv_state"], qsl, keep)
    assert torch.equal(conv_state_after(conv["x"], conv["conv_state"], qsl, keep), want)
    _, alone = causal_conv1d(conv["x"][mask], conv["weight"], conv["conv_state"], starts(cuts, qsl.dtype))
    assert torch.equal(want, alone)


# ---- opcheck, compile, fallback --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_opcheck(dtype):
    gen = torch.Generator().manual_seed(6)
    args = delta_inputs(gen, [3, 0, 2], 2, 1, 2, 16, 8, DTYPES[dtype], torch.int32)
    torch.library.opcheck(torch.ops.tqops.gated_delta_rule.default, (*args.values(), None, True))
    torch.library.opcheck(torch.ops.tqops.gated_delta_rule.default, (*args.values(), 0.5, False))
    conv = conv_inputs(gen, [3, 0, 2], 2, 5, 4, DTYPES[dtype], weight_fp32=True, index_dtype=torch.int32)
    torch.library.opcheck(torch.ops.tqops.causal_conv1d.default, (*conv.values(), "silu"))
    torch.library.opcheck(torch.ops.tqops.causal_conv1d.default, (*conv.values(), None))


def test_compiles_fullgraph_with_a_dynamic_token_dim():
    """A layer's linear-attention step: conv, the delta rule on its output, then the rollback to the accepted
    tokens, compiled as one graph."""
    def step(x, weight, conv_state, g, beta, state, qsl, keep):
        y, new_conv = causal_conv1d(x, weight, conv_state, qsl)
        q, k, v = y.unflatten(1, (-1, 16)).split((1, 1, 2), dim=1)
        o, new_state = gated_delta_rule(q, k, v, g, beta, state, qsl)
        m = keep_mask(qsl, keep, x.shape[0])[:, None]
        _, kept_state = gated_delta_rule(q, k, v, g * m, beta * m, state, qsl)
        return o, new_conv, new_state, kept_state, conv_state_after(x, conv_state, qsl, keep)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(7)
    for lens, pad in (([3, 1], 1), ([2, 0, 4], 2)):
        conv = conv_inputs(gen, lens, pad, 64, 4, torch.float32)
        delta = delta_inputs(gen, lens, pad, 1, 2, 16, 16, torch.float32)
        args = (conv["x"], conv["weight"], conv["conv_state"], delta["g"], delta["beta"], delta["state"],
                conv["query_start_loc"], torch.tensor([1] * len(lens)))
        for got, want in zip(compiled(*args), step(*args)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fla_fused_recurrent_in_the_triton_interpreter():
    """The CUDA path (FLA's fused recurrent kernel: padding rows, an empty sequence, GQA) on CPU tensors under
    TRITON_INTERPRET=1, where FLA is installed and its kernel interprets; skipped otherwise."""
    pytest.importorskip("fla")
    args = delta_inputs(torch.Generator().manual_seed(10), [3, 0, 2], 2, 1, 2, 16, 8, torch.float32)
    try:
        o, final = dn_ops._gated_delta_rule_cuda(*args.values(), None, True)
    except Exception as e:  # noqa: BLE001 - whatever the interpreter cannot run
        pytest.skip(f"FLA's kernel does not run in the Triton interpreter here: {e!r}")
    want_o, want_final = gated_delta_rule_naive(*args.values())
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)  # FLA divides by the norm where we multiply by rsqrt
    torch.testing.assert_close(final, want_final, rtol=1e-5, atol=1e-5)
    assert not o[5:].any() and torch.equal(final[1], args["state"][1])


def test_missing_fla_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla...` now raises ImportError
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    dn_ops._fla_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tqops.deltanet.ops"):
            assert dn_ops._fla_kernels() is None and dn_ops._fla_kernels() is None
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "flash-linear-attention is not installed" in caplog.records[0].message
    finally:
        dn_ops._fla_kernels.cache_clear()


# ---- bad arguments ---------------------------------------------------------------------------------------------------

def _delta_args(**over):
    args = delta_inputs(torch.Generator().manual_seed(8), [2, 1], 0, 1, 2, 16, 8, torch.float32)
    args.update(over)
    return args


@pytest.mark.parametrize("over, match", [
    (dict(g=torch.zeros(3, 2, dtype=torch.bfloat16)), "g has dtype bfloat16; expected one of float32"),
    (dict(beta=torch.zeros(3, 3)), r"beta has shape \(3, 3\); expected \[num_tokens, Hv\] = \[3, 2\]"),
    (dict(state=torch.zeros(2, 2, 16, 8, dtype=torch.bfloat16)), "state has dtype bfloat16"),
    (dict(state=torch.zeros(2, 2, 8, 16)), r"state has shape \(2, 2, 8, 16\); expected \[batch, Hv, dk, dv\]"),
    (dict(q=torch.zeros(3, 2, 16), k=torch.zeros(3, 2, 16), v=torch.zeros(3, 3, 8)),
     "v has 3 heads, not a multiple of q and k's 2 heads"),
    (dict(k=torch.zeros(3, 1, 16, dtype=torch.float16)), "k has dtype float16"),
    (dict(q=torch.zeros(3, 1, 16, dtype=torch.float64)), "q has dtype float64"),
    (dict(query_start_loc=torch.tensor([0, 3])), "query_start_loc has 2 entries; expected batch \\+ 1 = 3"),
    (dict(query_start_loc=torch.tensor([0., 2., 3.])), "query_start_loc has dtype float32"),
    (dict(query_start_loc=torch.tensor([1, 2, 3])), "query_start_loc must start at 0"),
    (dict(query_start_loc=torch.tensor([0, 2, 4])), "end at most at num_tokens=3; got first 0, last 4"),
    (dict(query_start_loc=torch.tensor([0, 2, 1])), r"non-decreasing; got query_start_loc\[2\] = 1"),
    (dict(scale=-1.0), "scale must be a positive finite float"),
    (dict(use_qk_l2norm=1), "use_qk_l2norm must be a bool"),
], ids=["g_dtype", "beta_heads", "state_dtype", "state_shape", "hv_not_multiple", "k_dtype", "q_dtype",
        "qsl_length", "qsl_dtype", "qsl_first", "qsl_last", "qsl_decreasing", "scale_negative", "l2norm_not_bool"])
def test_gated_delta_rule_rejects_bad_input(over, match):
    with pytest.raises((ValueError, TypeError), match=match):
        gated_delta_rule(**_delta_args(**over))


def _conv_args(**over):
    args = conv_inputs(torch.Generator().manual_seed(9), [2, 1], 0, 5, 3, torch.bfloat16)
    args.update(over)
    return args


@pytest.mark.parametrize("over, match", [
    (dict(weight=torch.zeros(5, 1, dtype=torch.bfloat16)), r"weight has shape \(5, 1\); expected \[C, W\] = \[5, W\] "
                                                           "with W >= 2"),
    (dict(weight=torch.zeros(4, 3, dtype=torch.bfloat16)), r"weight has shape \(4, 3\)"),
    (dict(weight=torch.zeros(5, 3, dtype=torch.float16)), "weight has dtype float16; expected one of bfloat16, "
                                                          "float32"),
    (dict(conv_state=torch.zeros(2, 5, 3, dtype=torch.bfloat16)), r"conv_state has shape \(2, 5, 3\); expected "
                                                                  r"\[batch, C, W - 1\] = \[2, 5, 2\]"),
    (dict(conv_state=torch.zeros(2, 5, 2)), "conv_state has dtype float32; expected one of bfloat16"),
    (dict(query_start_loc=torch.tensor([0, 3])), "query_start_loc has 2 entries; expected batch \\+ 1 = 3"),
    (dict(activation="gelu"), "activation must be one of"),
], ids=["one_tap", "weight_channels", "weight_dtype", "state_width", "state_dtype", "qsl_length", "activation"])
def test_causal_conv1d_rejects_bad_input(over, match):
    args = _conv_args(**over)
    activation = args.pop("activation", "silu")
    with pytest.raises((ValueError, TypeError), match=match):
        causal_conv1d(**args, activation=activation)


def test_rollback_helpers_reject_bad_input():
    args = _conv_args()
    with pytest.raises(ValueError, match="keep has 3 entries; expected one per sequence"):
        keep_mask(args["query_start_loc"], torch.tensor([1, 1, 1]), 3)
    with pytest.raises(TypeError, match="keep has dtype float32"):
        conv_state_after(args["x"], args["conv_state"], args["query_start_loc"], torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match=r"conv_state has shape \(2, 5, 0\)"):
        conv_state_after(args["x"], args["conv_state"][:, :, :0], args["query_start_loc"], torch.tensor([1, 1]))
