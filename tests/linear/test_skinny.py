"""The skinny GEMM (2-16 rows against a large weight): the kernel against a float64 reference (CPU: TRITON_INTERPRET=1),
which calls take it, and the ops through it on the GPU."""
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

from tqops.linear import add_rms_norm_linear, linear, silu_mul_linear  # noqa: E402
from tqops.linear import triton_skinny  # noqa: E402
from tqops.linear.naive import silu_mul_naive  # noqa: E402
from tqops.linear.ops import _runs_gemv, _runs_skinny  # noqa: E402
from tqops.norm.naive import add_rms_norm_naive  # noqa: E402
from .pdl_replay import assert_pdl_changes_nothing  # noqa: E402

if not torch.cuda.is_available() and not triton_skinny._interpreted():
    triton_skinny = importlib.reload(triton_skinny)

pytestmark = pytest.mark.smoke

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Launch overrides: the default tile, and small ones so odd N and K leave partial tiles under the interpreter too.
OVERRIDES = ({}, dict(block_n=16, block_k=16), dict(block_n=32, block_k=64), dict(block_n=64, block_k=32))


def assert_matches_float64(got, x, weight, bias):
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # fp32 products and sums, one rounding to the output dtype (cuBLAS rounds alike, in another order)
    eps = torch.finfo(x.dtype).eps
    scale = (x.double().abs() @ weight.double().abs().t()).max().item() + 1
    torch.testing.assert_close(got.double(), want, rtol=2 * eps, atol=(2 * eps + 1e-6 * x.shape[-1] ** 0.5) * scale)
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], weight.shape[0])


@st.composite
def skinny_cases(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    rows, n = draw(st.integers(1, 16)), draw(st.integers(1, 150))
    k = draw(st.sampled_from((16, 40, 100, 256, 600)))
    pad = draw(st.sampled_from((0, 3)))  # weight rows strided: a slice of a wider matrix
    weight = torch.randn(n, k + pad, generator=gen)[:, :k].to(dtype)
    x = torch.randn(rows, k + pad, generator=gen)[:, :k].to(dtype)  # input rows strided too
    bias = torch.randn(n, generator=gen).to(dtype) if draw(st.booleans()) else None
    return x, weight, bias, draw(st.sampled_from(OVERRIDES))


@settings(max_examples=30, deadline=None)
@given(skinny_cases())
def test_skinny_kernel_matches_reference(case):
    x, weight, bias, override = (a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in case)
    assert_matches_float64(triton_skinny.skinny_gemm_triton(x, weight, bias, **override), x, weight, bias)


@pytest.mark.parametrize("rows", [0, 17])
def test_skinny_kernel_edges(rows):
    x, w = torch.randn(rows, 32, dtype=torch.bfloat16, device=DEVICE), torch.randn(8, 32, dtype=torch.bfloat16,
                                                                                 device=DEVICE)
    if rows > triton_skinny.MAX_ROWS:
        with pytest.raises(ValueError, match="at most 16"):
            triton_skinny.skinny_gemm_triton(x, w)
    else:
        assert triton_skinny.skinny_gemm_triton(x, w).shape == (0, 8)


def test_cpu_never_takes_the_skinny_gemm():
    # The rule reads shapes, dtypes and strides only; on the CPU the ops stay the torch references.
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    w = torch.randn(1, 64, dtype=torch.bfloat16).expand(triton_skinny.MIN_WEIGHT_BYTES // 128, 64)  # 16 MB as a view
    assert not _runs_skinny(x, w) and not _runs_gemv(x, w)


LARGE = (2048, triton_skinny.MIN_WEIGHT_BYTES // (2 * 2048))  # a bf16 weight of exactly MIN_WEIGHT_BYTES


@pytest.mark.gpu
@pytest.mark.parametrize("shape, skinny", [((1, 4096), False), ((2, 4096), True), ((2, 4, 4096), True),
                                           ((16, 4096), True), ((17, 4096), False)],
                         ids=["one_row", "two_rows", "eight_rows_3d", "sixteen_rows", "seventeen_rows"])
def test_skinny_gemm_runs_for_2_to_16_rows_against_large_weights(shape, skinny):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    w = torch.randn(*LARGE, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(*shape[:-1], LARGE[1], dtype=torch.bfloat16, device="cuda")
    assert _runs_skinny(x, w) == skinny
    assert not _runs_skinny(x, w[: LARGE[0] // 2])  # a weight below MIN_WEIGHT_BYTES keeps cuBLAS
    assert not _runs_skinny(x.float(), w.float())  # fp32 keeps cuBLAS
    assert_matches_float64(linear(x, w), x, w, None)


@pytest.mark.gpu
def test_fused_ops_through_the_skinny_gemm_match_the_unfused_ops():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, out = LARGE[1], LARGE[0]
    x, res = (torch.randn(8, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    nw = torch.rand(hidden, device="cuda", generator=gen, dtype=torch.bfloat16) + 0.5
    w = torch.randn(out, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) / hidden**0.5
    y, total = add_rms_norm_linear(x, res, nw, 1e-6, w)
    normed, want_total = add_rms_norm_naive(x, res, nw, 1e-6)
    assert torch.equal(total, want_total)
    assert_matches_float64(y, normed, w, None)
    gate_up = torch.randn(8, 2 * hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert_matches_float64(silu_mul_linear(gate_up, w), silu_mul_naive(gate_up), w, None)


@pytest.mark.gpu
def test_skinny_opcheck():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    w = torch.randn(*LARGE, dtype=torch.bfloat16, device="cuda")
    x, b = torch.randn(5, LARGE[1], dtype=torch.bfloat16, device="cuda"), torch.randn(LARGE[0], device="cuda")
    torch.library.opcheck(torch.ops.tqops.linear.default, (x, w, b.bfloat16()))


@pytest.mark.gpu
def test_a_captured_chain_through_the_skinny_gemm_is_the_same_with_and_without_pdl(monkeypatch):
    # 8 rows against weights of MIN_WEIGHT_BYTES: the norm and activation kernels and the skinny GEMMs all launch
    # with PDL; each op reads the one before it, so a read before its pdl_wait shows up as a difference.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = LARGE[1]  # hidden x hidden bf16: twice MIN_WEIGHT_BYTES
    w_up = torch.randn(2 * hidden, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) / hidden**0.5
    w_down = torch.randn(hidden, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) / hidden**0.5
    nw = torch.rand(hidden, device="cuda", generator=gen, dtype=torch.bfloat16) + 0.5
    x = torch.randn(8, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert _runs_skinny(x, w_up) and _runs_skinny(x, w_down)

    def chain():
        y, residual = x, torch.zeros_like(x)
        for _ in range(3):
            gate_up, residual = add_rms_norm_linear(y, residual, nw, 1e-6, w_up)
            y = silu_mul_linear(gate_up, w_down)
        return y + residual

    assert_pdl_changes_nothing(chain, monkeypatch)
