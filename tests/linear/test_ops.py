"""The linear ops: the GEMV kernel and its prologues against the unfused torch ops (CPU: TRITON_INTERPRET=1), the
ops' dispatch, opcheck, autograd, compile, bad inputs."""
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
from tqops.linear import triton_gemv  # noqa: E402
from tqops.linear.naive import silu_mul_naive  # noqa: E402
from tqops.norm.naive import add_rms_norm_naive  # noqa: E402
from tqops.linear.ops import _runs_gemv  # noqa: E402
from .pdl_replay import assert_pdl_changes_nothing  # noqa: E402

if not torch.cuda.is_available() and not triton_gemv._interpreted():
    triton_gemv = importlib.reload(triton_gemv)

pytestmark = pytest.mark.smoke

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# Launch overrides: default tiles, small chunks, and weight columns loaded before the PDL wait (pre_k) that cover
# all of K, part of it, or more than K.
OVERRIDES = ({}, dict(block_n=4, block_k=64), dict(block_n=16, block_k=32), dict(block_n=4, block_k=32, pre_k=64),
             dict(block_n=8, block_k=64, pre_k=256))


@st.composite
def gemv_cases(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    n, k = draw(st.integers(1, 70)), draw(st.sampled_from((1, 16, 100, 256, 600)))
    pad = draw(st.sampled_from((0, 3)))  # weight rows strided: a slice of a wider matrix, as forward_rows passes
    weight = torch.randn(n, k + pad, generator=gen)[:, :k].to(dtype)
    x = torch.randn(1, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if draw(st.booleans()) else None
    override = draw(st.sampled_from(OVERRIDES))
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


@pytest.mark.parametrize("n", [1024, 4096, 6144])
def test_small_weights_get_half_the_rows_per_program(n):
    # Up to SMALL_WEIGHT_BYTES a weight runs twice the programs (the 0.6B projections: faster in the captured
    # step); larger ones (the 8B projections) keep their tiles. The rows per program never drop below 2.
    small, large = triton_gemv.gemv_config(n, 1024), triton_gemv.gemv_config(n, 8 * triton_gemv.SMALL_WEIGHT_BYTES // n)
    assert n * 1024 * 2 <= triton_gemv.SMALL_WEIGHT_BYTES
    assert small["block_n"] == max(2, large["block_n"] // 2)


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


@pytest.mark.parametrize("x_dtype", ["fp32", "bf16"])
def test_autocast_runs_it_as_f_linear(x_dtype):
    """A training step under bf16 autocast mixes bf16 activations with fp32 weights; F.linear casts both."""
    x = torch.randn(3, 2, 24, dtype=DTYPES[x_dtype], requires_grad=True)
    w, b = torch.randn(10, 24, requires_grad=True), torch.randn(10, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = linear(x, w, b), F.linear(x, w, b)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)
    out.float().sum().backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == x.dtype
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        with pytest.raises(TypeError, match="weight has dtype float32; expected one of bfloat16"):
            linear(x.detach().bfloat16(), w)


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


def _ulp_close(got, want, inputs, weight, dtype):
    """``got`` (rounded once to ``dtype``) against a float64 ``want``: a few ulps of the output plus the effect of a
    one-ulp difference in each input element (the fused prologue rounds where the reference does, in another
    order)."""
    eps = torch.finfo(dtype).eps
    scale = (inputs.double().abs() @ weight.double().abs().t()).max().item() + 1
    torch.testing.assert_close(got.double(), want, rtol=2 * eps, atol=(3 * eps + 1e-6 * weight.shape[1] ** 0.5) * scale)


@st.composite
def prologue_cases(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    n, k = draw(st.integers(1, 40)), draw(st.sampled_from((16, 100, 256, 600)))
    weight = torch.randn(n, k, generator=gen).to(dtype)
    override = draw(st.sampled_from(OVERRIDES))
    return gen, dtype, weight, override


@settings(max_examples=20, deadline=None)
@given(prologue_cases())
def test_gemv_add_rms_norm_prologue_matches_the_unfused_ops(case):
    gen, dtype, weight, override = case
    k = weight.shape[1]
    x, residual = (torch.randn(1, k, generator=gen) * 3).to(dtype), torch.randn(1, k, generator=gen).to(dtype)
    norm_weight = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    args = [t.to(DEVICE) for t in (x, residual, norm_weight, weight)]
    out, total = triton_gemv.gemv_triton(args[0], args[3], residual=args[1], norm_weight=args[2], eps=1e-6,
                                         prologue=triton_gemv.ADD_RMS_NORM, **override)
    normed, want_total = add_rms_norm_naive(x, residual, norm_weight, 1e-6)
    if DEVICE == "cuda":
        assert torch.equal(total.cpu(), want_total)  # the sum rounds once, as the unfused add does
    else:  # the interpreter's fp32 -> bf16 casts truncate where the GPU's round to nearest
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(total.cpu(), want_total, rtol=eps, atol=eps)
    _ulp_close(out.cpu(), F.linear(normed.double(), weight.double()), normed, weight, dtype)


@settings(max_examples=20, deadline=None)
@given(prologue_cases())
def test_gemv_silu_mul_prologue_matches_the_unfused_ops(case):
    gen, dtype, weight, override = case
    gate_up = (torch.randn(1, 2 * weight.shape[1], generator=gen) * 2).to(dtype)
    out = triton_gemv.gemv_triton(gate_up.to(DEVICE), weight.to(DEVICE), prologue=triton_gemv.SILU_MUL, **override)
    act = silu_mul_naive(gate_up.double())
    _ulp_close(out.cpu(), F.linear(act, weight.double()), act, weight, dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(3, 100), (1, 2048), (2, 6)], ids=["3x100", "1x2048", "2x6"])
def test_silu_mul_kernel_matches_reference(shape, dtype):
    gate_up = (torch.randn(shape) * 3).to(DTYPES[dtype])
    got = triton_gemv.silu_mul_triton(gate_up.to(DEVICE)).cpu()
    want = silu_mul_naive(gate_up.double())
    eps = torch.finfo(DTYPES[dtype]).eps
    torch.testing.assert_close(got.double(), want, rtol=2 * eps, atol=2 * eps)


def _fused_args(rows, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 32, generator=gen), torch.randn(rows, 32, generator=gen)
    norm_weight, weight = torch.rand(32, generator=gen) + 0.5, torch.randn(12, 32, generator=gen)
    gate_up, down = torch.randn(rows, 24, generator=gen), torch.randn(10, 12, generator=gen)
    return [t.to(device, dtype) for t in (x, residual, norm_weight, weight, gate_up, down)]


@pytest.mark.parametrize("rows", [1, 3])
def test_fused_ops_on_cpu_are_the_unfused_modules_bit_for_bit(rows):
    for dtype in (torch.float32, torch.bfloat16):
        x, residual, norm_weight, weight, gate_up, down = _fused_args(rows, dtype)
        out, total = add_rms_norm_linear(x, residual, norm_weight, 1e-6, weight)
        normed, want_total = add_rms_norm_naive(x, residual, norm_weight, 1e-6)
        assert torch.equal(total, want_total) and torch.equal(out, F.linear(normed, weight))
        bias = weight[:, 0].contiguous()
        out, _ = add_rms_norm_linear(x, residual, norm_weight, 1e-6, weight, bias)
        assert torch.equal(out, F.linear(normed, weight, bias))
        gate, up = gate_up.chunk(2, -1)
        assert torch.equal(silu_mul_linear(gate_up, down), F.linear(F.silu(gate) * up, down))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3], ids=["one_row_gemv", "three_rows_unfused"])
def test_fused_ops_on_cuda_match_the_unfused_ops(rows):
    x, residual, norm_weight, weight, gate_up, down = _fused_args(rows, torch.bfloat16, "cuda")
    bias = weight[:, 0].contiguous()
    out, total = add_rms_norm_linear(x, residual, norm_weight, 1e-6, weight, bias)
    normed, want_total = add_rms_norm_naive(x, residual, norm_weight, 1e-6)
    assert torch.equal(total, want_total)
    torch.testing.assert_close(out, F.linear(normed, weight, bias), rtol=2e-2, atol=5e-2)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(silu_mul_linear(gate_up, down), F.linear(F.silu(gate) * up, down), rtol=2e-2,
                               atol=5e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows", [1, 3], ids=["one_row", "three_rows"])
def test_fused_opcheck(device, rows):
    for dtype in (torch.float32, torch.bfloat16):
        x, residual, norm_weight, weight, gate_up, down = _fused_args(rows, dtype, device)
        torch.library.opcheck(torch.ops.tqops.add_rms_norm_linear.default, (x, residual, norm_weight, 1e-6, weight))
        torch.library.opcheck(torch.ops.tqops.add_rms_norm_linear.default,
                              (x, residual, norm_weight, 1e-6, weight, weight[:, 0].contiguous()))
        torch.library.opcheck(torch.ops.tqops.silu_mul_linear.default, (gate_up, down))


def test_fused_ops_compile_fullgraph_with_a_dynamic_token_dim():
    def step(x, residual, norm_weight, weight, gate_up, down):
        out, total = add_rms_norm_linear(x, residual, norm_weight, 1e-6, weight)
        return out, total, silu_mul_linear(gate_up, down)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for rows in (1, 3, 5):
        args = _fused_args(rows)
        for got, want in zip(compiled(*args), step(*args)):
            torch.testing.assert_close(got, want)


def _bad_fused(**over):
    x, residual, norm_weight, weight, gate_up, down = _fused_args(2)
    args = dict(x=x, residual=residual, norm_weight=norm_weight, eps=1e-6, weight=weight)
    args.update(over)
    return args


@pytest.mark.parametrize("over, match", [
    (dict(weight=torch.randn(12, 31)), r"weight has shape \(12, 31\); expected \[out_features, 32\]"),
    (dict(weight=torch.randn(12, 32, dtype=torch.bfloat16)), "weight has dtype bfloat16"),
    (dict(residual=torch.randn(2, 31)), r"residual has shape \(2, 31\)"),
    (dict(norm_weight=torch.rand(31)), r"weight has shape \(31,\); expected \[32\]"),
    (dict(eps=-1.0), "eps must be a finite float >= 0"),
    (dict(bias=torch.randn(11)), r"bias has shape \(11,\); expected \[12\]"),
], ids=["weight_in_features", "weight_dtype", "residual_hidden", "norm_weight_size", "eps_negative", "bias_size"])
def test_add_rms_norm_linear_rejects_bad_input(over, match):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        add_rms_norm_linear(**_bad_fused(**over))


@pytest.mark.parametrize("args, match", [
    ((torch.randn(2, 23), torch.randn(10, 11)), r"gate_up has shape \(2, 23\); expected \[num_tokens, 2 \*"),
    ((torch.randn(2, 24), torch.randn(10, 24)), r"weight has shape \(10, 24\); expected \[out_features, 12\]"),
    ((torch.randn(24, 2).t(), torch.randn(10, 12)), "gate_up must be contiguous in its last dim"),
    ((torch.randn(2, 3, 24), torch.randn(10, 12)), "gate_up must have 2 dims"),
], ids=["odd_width", "weight_in_features", "strided", "ndim"])
def test_silu_mul_linear_rejects_bad_input(args, match):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        silu_mul_linear(*args)


def test_pdl_is_off_on_cpu_and_under_tqops_pdl_0(monkeypatch):
    from tqops.pdl import pdl_enabled, pdl_launch_args

    assert not pdl_enabled(torch.device("cpu"))
    assert pdl_launch_args(torch.device("cpu")) == {"USE_PDL": False}
    if torch.cuda.is_available():
        monkeypatch.setenv("TQOPS_PDL", "0")
        assert not pdl_enabled(torch.device("cuda"))
        assert pdl_launch_args(torch.device("cuda")) == {"USE_PDL": False}


def test_pdl_launch_args_only_for_one_row_where_enabled(monkeypatch):
    import tqops.pdl

    monkeypatch.setattr(tqops.pdl, "pdl_enabled", lambda device: True)
    assert tqops.pdl.pdl_launch_args(torch.device("cuda")) == {"USE_PDL": True, "launch_pdl": True}
    assert tqops.pdl.pdl_launch_args(torch.device("cuda"), one_row=False) == {"USE_PDL": False}


@pytest.mark.gpu
def test_a_captured_chain_of_one_row_ops_is_the_same_with_and_without_pdl(monkeypatch):
    # Each op reads the one before it: a kernel that read or wrote too early (before its pdl_wait) shows up as a
    # difference from the serialized launches, replay after replay.
    from tqops.norm import add_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    h, ffn = 256, 384
    ws = dict(qkv=torch.randn(3 * h, h), gate_up=torch.randn(2 * ffn, h), down=torch.randn(h, ffn),
              o=torch.randn(h, 3 * h), norm=torch.rand(h) + 0.5)
    ws = {k: (v / v.shape[-1] ** 0.5 if v.dim() == 2 else v).to("cuda", torch.bfloat16) for k, v in ws.items()}
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16, generator=gen)

    def chain():
        y, residual = x, torch.zeros_like(x)
        for _ in range(4):
            normed, residual = add_rms_norm(y, residual, ws["norm"], 1e-6)
            attn = linear(linear(normed, ws["qkv"]), ws["o"])
            gate_up, residual = add_rms_norm_linear(attn, residual, ws["norm"], 1e-6, ws["gate_up"])
            y = silu_mul_linear(gate_up, ws["down"])
        return y + residual

    assert_pdl_changes_nothing(chain, monkeypatch)
