"""tqops.linear: the GEMV kernel against F.linear (CPU: TRITON_INTERPRET=1), the op's dispatch, opcheck, autograd,
compile, bad inputs."""
import importlib
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel's @triton.jit
pytest.importorskip("triton")

from tqops.linear import linear  # noqa: E402
from tqops.linear import triton_gemv  # noqa: E402
from tqops.linear.ops import _runs_gemv  # noqa: E402

if not torch.cuda.is_available() and not triton_gemv._interpreted():
    triton_gemv = importlib.reload(triton_gemv)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@st.composite
def gemv_cases(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    n, k = draw(st.integers(1, 70)), draw(st.sampled_from((1, 16, 100, 256, 600)))
    pad = draw(st.sampled_from((0, 3)))  # weight rows strided: a slice of a wider matrix, as forward_rows passes
    weight = torch.randn(n, k + pad, generator=gen)[:, :k].to(dtype)
    x = torch.randn(1, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if draw(st.booleans()) else None
    override = draw(st.sampled_from(({}, dict(block_n=4, block_k=64), dict(block_n=16, block_k=32))))
    return x, weight, bias, override


@settings(max_examples=30, deadline=None)
@given(gemv_cases())
def test_gemv_kernel_matches_reference(case):
    x, weight, bias, override = (a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in case)
    got = triton_gemv.gemv_triton(x, weight, bias, **override)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # fp32 products and sums, one rounding to the output dtype (cuBLAS and the CPU round alike, in another order)
    eps = torch.finfo(x.dtype).eps
    scale = (x.double().abs() @ weight.double().abs().t()).max().item() + 1
    torch.testing.assert_close(got.double(), want, rtol=2 * eps, atol=(2 * eps + 1e-6 * x.shape[1] ** 0.5) * scale)
    assert got.dtype == x.dtype and got.shape == (1, weight.shape[0])


@pytest.mark.parametrize("shape, gemv", [((1, 64), True), ((1, 1, 64), True), ((2, 64), False), ((0, 64), False)],
                         ids=["one_row", "one_row_3d", "two_rows", "no_rows"])
def test_op_runs_the_gemv_only_for_one_row_on_cuda(shape, gemv):
    x, w = torch.randn(shape, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    assert not _runs_gemv(x, w)  # CPU: always F.linear
    if torch.cuda.is_available():
        assert _runs_gemv(x.cuda(), w.cuda()) == gemv
        assert not _runs_gemv(x.cuda().float(), w.cuda().float())  # fp32 keeps cuBLAS
    out = linear(x.to(DEVICE), w.to(DEVICE))
    assert out.shape == (*shape[:-1], 8)
    torch.testing.assert_close(out, F.linear(x.to(DEVICE), w.to(DEVICE)), rtol=2e-2, atol=2e-2)


def test_cpu_results_are_f_linear_bit_for_bit():
    x, w, b = torch.randn(1, 96, dtype=torch.bfloat16), torch.randn(40, 96, dtype=torch.bfloat16), torch.randn(40)
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert torch.equal(linear(x.float(), w.float(), b), F.linear(x.float(), w.float(), b))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows", [1, 3], ids=["one_row", "three_rows"])
def test_opcheck(device, rows):
    x, w, b = torch.randn(rows, 24), torch.randn(10, 24), torch.randn(10)
    torch.library.opcheck(torch.ops.tqops.linear.default, (x.to(device), w.to(device), b.to(device)))
    torch.library.opcheck(torch.ops.tqops.linear.default, (x.to(device).bfloat16(), w.to(device).bfloat16(), None))
    grads = [t.to(device).requires_grad_() for t in (x, w, b)]
    torch.library.opcheck(torch.ops.tqops.linear.default, tuple(grads))


def test_gradients_are_f_linears():
    x, w, b = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((2, 3, 5), (4, 5), (4,)))
    torch.autograd.gradcheck(linear, (x, w, b))


def test_compiles_fullgraph_with_a_dynamic_token_dim():
    compiled = torch.compile(linear, fullgraph=True, dynamic=True)
    w = torch.randn(12, 16)
    for n in (1, 3, 5):
        x = torch.randn(n, 16)
        torch.testing.assert_close(compiled(x, w), F.linear(x, w))


@pytest.mark.parametrize("args, match", [
    ((torch.randn(2, 16), torch.randn(8, 15)), r"weight has shape \(8, 15\); expected \[out_features, 16\]"),
    ((torch.randn(2, 16), torch.randn(8, 16, dtype=torch.float64)), "weight has dtype float64"),
    ((torch.randn(2, 16), torch.randn(16)), "weight must have 2 dims"),
    ((torch.randn(2, 16), torch.randn(8, 16), torch.randn(7)), r"bias has shape \(7,\); expected \[8\]"),
    ((torch.randn(2, 16), torch.randn(8, 16), torch.randn(8, dtype=torch.bfloat16)), "bias has dtype bfloat16"),
    ((torch.arange(16), torch.randn(8, 16)), "x has dtype int64"),
    ((torch.tensor(1.0), torch.randn(8, 16)), "x is a scalar"),
], ids=["in_features", "weight_dtype", "weight_ndim", "bias_size", "bias_dtype", "x_int", "x_scalar"])
def test_rejects_bad_input(args, match):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        linear(*args)
