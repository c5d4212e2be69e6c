"""The Triton gated delta rule over pool rows (``gated_delta_rule_rows`` on CUDA) against the torch path, on CPU under
TRITON_INTERPRET=1: rows by index, the spare row, fused gates, kept prefixes, state written or kept, padding rows."""
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel's @triton.jit
pytest.importorskip("triton")

from tqops.deltanet import gated_delta_rule_rows  # noqa: E402
from tqops.deltanet import triton_recurrent  # noqa: E402

from .test_ops import starts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 states: the GPU's exp and sqrt are approximate (a few ulp), the interpreter's exact
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=0.05, rtol=0.02)}


@st.composite
def cases(draw):
    batch = draw(st.integers(1, 3))
    hk = draw(st.sampled_from([1, 2]))
    pool_rows = batch + draw(st.integers(1, 2))
    indices = draw(st.permutations(range(pool_rows - 1)))[:batch] if batch < pool_rows else []
    spare = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    indices = [-1 if s and i == 0 else row for i, (s, row) in enumerate(zip(spare, indices))]  # one padded row
    return dict(lens=draw(st.lists(st.integers(0, 6), min_size=batch, max_size=batch)), pad=draw(st.integers(0, 2)),
                hk=hk, hv=hk * draw(st.sampled_from([1, 2])), dk=draw(st.sampled_from([8, 12, 16])),
                dv=draw(st.sampled_from([4, 8, 12])), pool_rows=pool_rows, indices=indices,
                keep=draw(st.none() | st.lists(st.integers(-1, 7), min_size=batch, max_size=batch)),
                write_state=draw(st.booleans()), dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])))


def _inputs(case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(case["lens"]) + case["pad"]
    hk, hv, dk, dv, dt = case["hk"], case["hv"], case["dk"], case["dv"], case["dtype"]
    mixed = torch.randn(n, 2 * hk * dk + hv * dv, generator=gen).to(dt)  # q, k, v as strided views of one row
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=1)
    return dict(q=q.contiguous().view(n, hk, dk), k=k.contiguous().view(n, hk, dk), v=v.contiguous().view(n, hv, dv),
                a=torch.randn(n, 2 * hv, generator=gen).to(dt)[:, ::2], b=torch.randn(n, hv, generator=gen).to(dt),
                A_log=torch.randn(hv, generator=gen), dt_bias=torch.randn(hv, generator=gen).to(dt),
                pool=torch.randn(case["pool_rows"], hv, dk, dv, generator=gen),
                state_indices=torch.tensor(case["indices"], dtype=torch.int64), query_start_loc=starts(case["lens"]))


def _run(fn, t, case, **kw):
    t = {name: x.to(DEVICE) for name, x in t.items()}
    keep = None if case["keep"] is None else torch.tensor(case["keep"]).to(DEVICE)
    o = fn(t["q"], t["k"], t["v"], t["a"].contiguous() if fn is gated_delta_rule_rows else t["a"], t["b"],
           t["A_log"], t["dt_bias"], t["pool"], t["state_indices"], t["query_start_loc"], keep=keep,
           write_state=case["write_state"], **kw)
    return o, t["pool"]


@settings(max_examples=30, deadline=None)
@given(case=cases())
def test_kernel_matches_the_torch_path(case):
    """Outputs and the pool after the launch equal the torch path's (gather, torch gates, reference rule, scatter),
    rows other than the sequences' unchanged; the spare row is compared only where no sequence writes it."""
    t = _inputs(case)
    ref_pool = t["pool"].clone()
    ref_o = gated_delta_rule_rows(t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"], ref_pool,
                                  t["state_indices"], t["query_start_loc"],
                                  keep=None if case["keep"] is None else torch.tensor(case["keep"]),
                                  write_state=case["write_state"])
    o, pool = _run(triton_recurrent.recurrent_rows, {n: x.clone() for n, x in t.items()}, case)
    torch.testing.assert_close(o.cpu().float(), ref_o.float(), **TOL[case["dtype"]])
    torch.testing.assert_close(pool.cpu(), ref_pool, **TOL[torch.float32])
    if not case["write_state"]:
        assert pool.cpu().equal(t["pool"])


def test_rows_no_sequence_covers_and_past_the_kept_prefix_are_zeros():
    """Rows before the first and past the last sequence, and tokens past a kept prefix, come back 0 where the output
    memory held NaN (the launcher's torch.empty), and a keep of 0 leaves the row's state exactly as it was."""
    case = dict(lens=[3, 2], pad=2, hk=1, hv=2, dk=8, dv=8, pool_rows=3, indices=[1, 0], keep=[0, 1],
                write_state=True, dtype=torch.float32)
    t = _inputs(case, seed=1)
    t["query_start_loc"] = torch.tensor([1, 4, 6])
    with torch.device(DEVICE):
        torch.empty(1 << 16).fill_(float("nan"))  # poison the allocator's next blocks
    o, pool = _run(triton_recurrent.recurrent_rows, {n: x.clone() for n, x in t.items()}, case)
    o = o.cpu()
    assert o[0].eq(0).all() and o[6:].eq(0).all()  # before qsl[0], past qsl[-1]
    assert o[1:4].eq(0).all() and o[5].eq(0).all() and o[4].ne(0).any()  # keep 0 of row 1; keep 1 of row 0
    assert pool.cpu()[1].equal(t["pool"][1]) and not pool.cpu()[0].equal(t["pool"][0])


def test_output_none_writes_only_the_state():
    case = dict(lens=[4], pad=0, hk=1, hv=1, dk=8, dv=8, pool_rows=2, indices=[0], keep=None, write_state=True,
                dtype=torch.float32)
    t = _inputs(case, seed=2)
    assert _run(triton_recurrent.recurrent_rows, {n: x.clone() for n, x in t.items()}, case, output=False)[0] is None
    ref_pool = t["pool"].clone()
    gated_delta_rule_rows(t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"], ref_pool,
                          t["state_indices"], t["query_start_loc"], output=False)
    _, pool = _run(triton_recurrent.recurrent_rows, {n: x.clone() for n, x in t.items()}, case, output=False)
    torch.testing.assert_close(pool.cpu(), ref_pool, **TOL[torch.float32])


def test_bad_bounds_are_clamped_as_the_torch_path_clamps_them():
    """A raw query_start_loc that decreases and runs past the rows gives the torch path's outputs and states."""
    case = dict(lens=[2, 3, 4], pad=0, hk=1, hv=2, dk=8, dv=8, pool_rows=4, indices=[2, 0, 1], keep=None,
                write_state=True, dtype=torch.float32)
    t = _inputs(case, seed=3)
    t["query_start_loc"] = torch.tensor([-3, 6, 2, 40], dtype=torch.int32)
    ref_pool = t["pool"].clone()
    ref_o = gated_delta_rule_rows(t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"], ref_pool,
                                  t["state_indices"], t["query_start_loc"])
    o, pool = _run(triton_recurrent.recurrent_rows, {n: x.clone() for n, x in t.items()}, case)
    torch.testing.assert_close(o.cpu(), ref_o, **TOL[torch.float32])
    torch.testing.assert_close(pool.cpu(), ref_pool, **TOL[torch.float32])
