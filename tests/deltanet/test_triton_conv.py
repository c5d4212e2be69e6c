"""The Triton causal conv (``causal_conv1d_rows`` on CUDA) against the torch references, on CPU under
TRITON_INTERPRET=1: pool rows by index, the spare row, kept prefixes, channel splits, padding rows, odd sizes."""
import os

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel's @triton.jit
pytest.importorskip("triton")

from tqops.deltanet import conv_state_after  # noqa: E402
from tqops.deltanet import triton_conv  # noqa: E402
from tqops.deltanet.ops import causal_conv1d_torch  # noqa: E402

from .test_ops import starts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 outputs: the interpreter's fp32 -> bf16 casts may round one ulp apart from torch's
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=0.07, rtol=0.02)}


@st.composite
def cases(draw):
    batch = draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(0, 21), min_size=batch, max_size=batch))
    pad = draw(st.integers(0, 3))
    width = draw(st.integers(2, 5))
    c = draw(st.sampled_from([3, 40, 130, 200]))
    pool_rows = batch + draw(st.integers(1, 3))
    indices = draw(st.permutations(range(pool_rows)))[:batch]
    spare = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    indices = [-1 if s else i for i, s in zip(indices, spare)]
    if indices.count(-1) > 1:  # one spare row: at most one padded sequence reads it
        indices = [i if i != -1 else pool_rows - 2 - j for j, i in enumerate(indices)]
    keep = draw(st.lists(st.integers(-2, 24), min_size=batch, max_size=batch))
    s0 = draw(st.integers(0, c))
    s1 = draw(st.integers(s0, c))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return dict(lens=lens, pad=pad, width=width, c=c, pool_rows=pool_rows, indices=indices, keep=keep,
                splits=(s0, s1), dtype=dtype)


def _inputs(case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(case["lens"]) + case["pad"]
    c, w, dt = case["c"], case["width"], case["dtype"]
    x = torch.randn(n, c, generator=gen).to(dt)
    weight = torch.randn(c, w, generator=gen).to(dt)
    pool = torch.randn(case["pool_rows"], c, w - 1, generator=gen).to(dt)
    idx = torch.tensor(case["indices"])
    rows = torch.where(idx < 0, case["pool_rows"] - 1, idx)
    return x, weight, pool, idx, rows, starts(case["lens"])


@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_conv_matches_torch(case):
    x, weight, pool, idx, rows, qsl = _inputs(case)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    ref_y, ref_state = causal_conv1d_torch(x, weight, pool[rows], qsl, "silu")
    parts, state = triton_conv.conv_varlen(dev(x), dev(weight), dev(pool), dev(qsl), state_indices=dev(idx),
                                           splits=case["splits"])
    s0, s1 = case["splits"]
    assert [p.shape[1] for p in parts] == [s0, s1 - s0, case["c"] - s1]
    assert all(p.is_contiguous() for p in parts)
    torch.testing.assert_close(torch.cat(parts, 1).cpu().float(), ref_y.float(), **TOL[case["dtype"]])
    torch.testing.assert_close(state.cpu(), ref_state, atol=0, rtol=0)  # a state is copied inputs: exact


@settings(max_examples=25, deadline=None)
@given(case=cases())
def test_kept_prefix_state(case):
    x, weight, pool, idx, rows, qsl = _inputs(case, seed=1)
    keep = torch.tensor(case["keep"])
    y, state = triton_conv.conv_varlen(x.to(DEVICE), weight.to(DEVICE), pool.to(DEVICE), qsl.to(DEVICE),
                                       state_indices=idx.to(DEVICE), keep=keep.to(DEVICE), silu=False)
    torch.testing.assert_close(state.cpu(), conv_state_after(x, pool[rows], qsl, keep), atol=0, rtol=0)
    ref_y, _ = causal_conv1d_torch(x, weight, pool[rows], qsl, None)
    torch.testing.assert_close(y.cpu().float(), ref_y.float(), **TOL[case["dtype"]])


def test_rows_without_indices_and_poisoned_outputs():
    """Row b of the pool without indices; the padding rows come back 0 even where the output memory held NaN."""
    gen = torch.Generator().manual_seed(2)
    lens, c, w = [3, 1], 24, 4
    x = torch.randn(6, c, generator=gen)
    weight, pool = torch.randn(c, w, generator=gen), torch.randn(2, c, w - 1, generator=gen)
    qsl = starts(lens)
    y, state = triton_conv.conv_varlen(x.to(DEVICE), weight.to(DEVICE), pool.to(DEVICE), qsl.to(DEVICE))
    ref_y, ref_state = causal_conv1d_torch(x, weight, pool, qsl, "silu")
    assert y[4:].eq(0).all()
    torch.testing.assert_close(y.cpu(), ref_y, **TOL[torch.float32])
    torch.testing.assert_close(state.cpu(), ref_state)


def test_rows_before_the_first_sequence_are_zeros():
    """A raw call whose query_start_loc starts past row 0 (the eager wrappers reject it): those rows are 0, not
    whatever the output memory held, as in the torch op."""
    gen = torch.Generator().manual_seed(3)
    c, w = 24, 4
    x = torch.randn(7, c, generator=gen)
    weight, pool = torch.randn(c, w, generator=gen), torch.randn(1, c, w - 1, generator=gen)
    qsl = torch.tensor([2, 5])
    y, state = triton_conv.conv_varlen(x.to(DEVICE), weight.to(DEVICE), pool.to(DEVICE), qsl.to(DEVICE))
    ref_y, ref_state = causal_conv1d_torch(x, weight, pool, qsl, "silu")
    assert y[:2].eq(0).all() and y[5:].eq(0).all()
    torch.testing.assert_close(y.cpu(), ref_y, **TOL[torch.float32])
    torch.testing.assert_close(state.cpu(), ref_state)


@settings(max_examples=20, deadline=None)
@given(case=cases(), kept=st.booleans())
def test_state_written_over_its_pool_row(case, kept):
    """``state_out="in_place"``: each sequence's new state lands on the pool row it was read from, and no other row
    changes; ``"none"`` leaves the pool as it was."""
    x, weight, pool, idx, rows, qsl = _inputs(case, seed=4)
    assume(rows.unique().numel() == rows.numel())  # a row written twice ends as either write
    keep = torch.tensor(case["keep"]) if kept else None
    _, ref_state = triton_conv.conv_varlen(x.to(DEVICE), weight.to(DEVICE), pool.to(DEVICE), qsl.to(DEVICE),
                                           state_indices=idx.to(DEVICE), keep=None if keep is None else keep.to(DEVICE))
    written = pool.to(DEVICE)
    y, none = triton_conv.conv_varlen(x.to(DEVICE), weight.to(DEVICE), written, qsl.to(DEVICE),
                                      state_indices=idx.to(DEVICE), keep=None if keep is None else keep.to(DEVICE),
                                      state_out="in_place")
    assert none is None
    expected = pool.clone()
    expected[rows] = ref_state.cpu()
    torch.testing.assert_close(written.cpu(), expected, atol=0, rtol=0)
    untouched = pool.to(DEVICE)
    triton_conv.conv_varlen(x.to(DEVICE), weight.to(DEVICE), untouched, qsl.to(DEVICE), state_indices=idx.to(DEVICE),
                            state_out="none")
    assert untouched.cpu().equal(pool)


def test_bad_bounds_are_clamped_as_the_torch_path_clamps_them():
    """A raw query_start_loc that decreases and runs past the rows: the kernel bounds it as ``ops._bounds`` does
    (clamped, then non-decreasing), so its outputs and states equal the torch path's."""
    gen = torch.Generator().manual_seed(5)
    c, w = 40, 4
    x = torch.randn(9, c, generator=gen)
    weight, pool = torch.randn(c, w, generator=gen), torch.randn(4, c, w - 1, generator=gen)
    qsl, idx = torch.tensor([-3, 6, 2, 40], dtype=torch.int32), torch.tensor([2, 0, 1])
    from tqops.deltanet.ops import _bounds
    ref_y, ref_state = causal_conv1d_torch(x, weight, pool[idx], _bounds(qsl, 9), "silu")
    y, state = triton_conv.conv_varlen(x.to(DEVICE), weight.to(DEVICE), pool.to(DEVICE), qsl.to(DEVICE),
                                       state_indices=idx.to(DEVICE))
    torch.testing.assert_close(y.cpu(), ref_y, **TOL[torch.float32])
    torch.testing.assert_close(state.cpu(), ref_state, atol=0, rtol=0)
