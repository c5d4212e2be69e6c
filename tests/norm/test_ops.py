"""add_rms_norm and qk_norm_rope: the Triton kernels against the torch references (CPU: TRITON_INTERPRET=1), opcheck,
bad inputs, and the models' unfused arithmetic."""
import importlib
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' @triton.jit
pytest.importorskip("triton")

from tqops.models.qwen3 import RMSNorm, rope_cos_sin  # noqa: E402
from tqops.norm import add_rms_norm, qk_norm_rope  # noqa: E402
from tqops.norm import triton_norm  # noqa: E402
from tqops.norm.naive import add_rms_norm_naive, apply_rope, qk_norm_rope_naive  # noqa: E402

if not torch.cuda.is_available() and not triton_norm._interpreted():
    triton_norm = importlib.reload(triton_norm)

pytestmark = pytest.mark.smoke

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def inv_freq(head_dim: int, theta: float = 1e6) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)


def ulps(dtype: torch.dtype, n: float = 1.0) -> dict:
    """Tolerance of ``n`` ulps of ``dtype``: fused kernels round once where the references round per op, and the
    interpreter's bf16 casts differ from the GPU's."""
    eps = torch.finfo(dtype).eps
    return dict(rtol=n * eps, atol=n * eps)


@st.composite
def norm_cases(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    tokens, hidden = draw(st.integers(0, 9)), draw(st.sampled_from((16, 40, 128, 1000)))
    pad = draw(st.sampled_from((0, 3)))  # strided rows: views into wider buffers
    x = (torch.randn(tokens, hidden + pad, generator=gen) * 4)[:, :hidden].to(dtype)
    residual = (torch.randn(tokens, hidden + pad, generator=gen))[:, :hidden].to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    return x, residual, weight, draw(st.sampled_from((1e-6, 1e-5)))


@st.composite
def qk_cases(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    tokens, head_dim = draw(st.integers(0, 7)), draw(st.sampled_from((8, 40, 64, 128)))
    num_kv_heads = draw(st.integers(1, 3))
    num_heads = draw(st.sampled_from((0, num_kv_heads, 2 * num_kv_heads)))
    width = (num_heads + 2 * num_kv_heads) * head_dim
    pad = draw(st.sampled_from((0, 5)))
    qkv = (torch.randn(tokens, width + pad, generator=gen) * 3)[:, :width].to(dtype)
    q_weight, k_weight = ((torch.rand(head_dim, generator=gen) + 0.5).to(dtype) for _ in range(2))
    positions = torch.randint(0, draw(st.sampled_from((16, 40000))), (tokens,), generator=gen)
    positions = positions.to(draw(st.sampled_from((torch.int32, torch.int64))))
    return qkv, q_weight, k_weight, positions, inv_freq(head_dim), num_heads, num_kv_heads, 1e-6


def _on(device, args):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@given(norm_cases())
def test_add_rms_norm_kernel_matches_reference(case):
    x, residual, weight, eps = _on(DEVICE, case)
    out, total = triton_norm.add_rms_norm_triton(x, residual, weight, eps)
    want_out, want_total = add_rms_norm_naive(x, residual, weight, eps)
    if triton_norm._interpreted():
        torch.testing.assert_close(total, want_total, **ulps(x.dtype))
    else:
        torch.testing.assert_close(total, want_total, rtol=0, atol=0)  # the same single rounding
    torch.testing.assert_close(out, want_out, **ulps(x.dtype, 2))


@given(qk_cases())
def test_qk_norm_rope_kernel_matches_reference(case):
    args = _on(DEVICE, case)
    got = triton_norm.qk_norm_rope_triton(*args)
    want = qk_norm_rope_naive(*args)
    for g, w in zip(got, want):
        assert g.is_contiguous() and g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, **ulps(g.dtype, 4))


def test_references_are_the_models_unfused_arithmetic():
    """The naive ops reproduce the Qwen3 modules bit for bit: the CPU path of a model is unchanged by them."""
    torch.manual_seed(0)
    x, residual = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16)
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    out, total = add_rms_norm(x, residual, norm.weight, 1e-6)
    torch.testing.assert_close(total, residual + x, rtol=0, atol=0)
    torch.testing.assert_close(out, norm(residual + x), rtol=0, atol=0)

    heads, kv_heads, hd = 4, 2, 32
    qkv = torch.randn(5, (heads + 2 * kv_heads) * hd, dtype=torch.bfloat16)
    positions = torch.tensor([0, 3, 17, 900, 40000])
    q, k = qk_norm_rope(qkv, norm.weight[:hd], norm.weight[hd:], positions, inv_freq(hd, 1e6), heads, kv_heads, 1e-6)
    cos, sin = rope_cos_sin(positions, hd, 1e6, torch.bfloat16)
    qn, kn = RMSNorm(hd, 1e-6).to(torch.bfloat16), RMSNorm(hd, 1e-6).to(torch.bfloat16)
    qn.weight.data.copy_(norm.weight[:hd])
    kn.weight.data.copy_(norm.weight[hd:])
    heads_of = qkv.unflatten(-1, (-1, hd))
    torch.testing.assert_close(q, apply_rope(qn(heads_of[:, :heads]), cos, sin), rtol=0, atol=0)
    torch.testing.assert_close(k, apply_rope(kn(heads_of[:, heads:heads + kv_heads]), cos, sin), rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_opcheck(device, dtype):
    dt = DTYPES[dtype]
    x, residual, weight = torch.randn(3, 40, dtype=dt), torch.randn(3, 40, dtype=dt), torch.rand(40, dtype=dt)
    torch.library.opcheck(torch.ops.tqops.add_rms_norm.default, _on(device, (x, residual, weight, 1e-6)))
    qkv = torch.randn(3, (2 + 2) * 16, dtype=dt)
    args = (qkv, weight[:16].contiguous(), weight[16:32].contiguous(), torch.tensor([0, 5, 9]), inv_freq(16), 2, 1,
            1e-6)
    torch.library.opcheck(torch.ops.tqops.qk_norm_rope.default, _on(device, args))
    kv_only = (qkv[:, :32].contiguous(),) + args[1:5] + (0, 1, 1e-6)
    torch.library.opcheck(torch.ops.tqops.qk_norm_rope.default, _on(device, kv_only))


def test_compiles_fullgraph_with_a_dynamic_token_dim():
    def step(x, residual, w, qkv, qw, kw, pos, freqs):
        out, total = add_rms_norm(x, residual, w, 1e-6)
        q, k = qk_norm_rope(qkv, qw, kw, pos, freqs, 2, 1, 1e-6)
        return out, total, q, k

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for n in (3, 5):
        x, residual, w = torch.randn(n, 16), torch.randn(n, 16), torch.rand(16)
        args = (x, residual, w, torch.randn(n, 64), torch.rand(16), torch.rand(16), torch.arange(n), inv_freq(16))
        for g, want in zip(compiled(*args), step(*args)):
            torch.testing.assert_close(g, want)


def _qk_args(**over):
    args = dict(qkv=torch.randn(3, 64), q_weight=torch.rand(16), k_weight=torch.rand(16),
                positions=torch.arange(3), inv_freq=inv_freq(16), num_heads=2, num_kv_heads=1, eps=1e-6)
    args.update(over)
    return args


@pytest.mark.parametrize("over, match", [
    (dict(qkv=torch.randn(3, 63)), r"qkv has shape \(3, 63\); expected \[num_tokens, 64\]"),
    (dict(qkv=torch.randn(3, 64, dtype=torch.float64)), "qkv has dtype float64"),
    (dict(qkv=torch.randn(64, 3).t()), "qkv must be contiguous in its last dim"),
    (dict(q_weight=torch.rand(8)), r"q_weight has shape \(8,\); expected \[16\]"),
    (dict(k_weight=torch.rand(16, dtype=torch.bfloat16)), "k_weight has dtype bfloat16"),
    (dict(positions=torch.arange(4)), "positions has 4 entries; expected one per qkv row"),
    (dict(positions=torch.zeros(3)), "positions has dtype float32"),
    (dict(inv_freq=inv_freq(16).double()), "inv_freq has dtype float64"),
    (dict(num_kv_heads=0), "num_kv_heads must be an int >= 1"),
    (dict(num_heads=-1), "num_heads must be an int >= 0"),
    (dict(eps=float("nan")), "eps must be a finite float"),
], ids=["qkv_width", "qkv_dtype", "qkv_strided", "q_weight_size", "k_weight_dtype", "positions_count",
        "positions_dtype", "inv_freq_dtype", "no_kv_heads", "negative_heads", "eps_nan"])
def test_qk_norm_rope_rejects_bad_input(over, match):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        qk_norm_rope(**_qk_args(**over))


@pytest.mark.parametrize("over, match", [
    (dict(residual=torch.randn(3, 8)), r"residual has shape \(3, 8\); expected x's shape \(3, 16\)"),
    (dict(residual=torch.randn(4, 16)), r"residual has shape \(4, 16\)"),
    (dict(residual=torch.randn(3, 16, dtype=torch.bfloat16)), "residual has dtype bfloat16"),
    (dict(weight=torch.rand(15)), r"weight has shape \(15,\); expected \[16\]"),
    (dict(x=torch.randn(3, 4, 16)), "x must have 2 dims"),
    (dict(eps=-1.0), "eps must be a finite float >= 0"),
], ids=["residual_hidden", "residual_tokens", "residual_dtype", "weight_size", "x_ndim", "eps_negative"])
def test_add_rms_norm_rejects_bad_input(over, match):
    args = dict(x=torch.randn(3, 16), residual=torch.randn(3, 16), weight=torch.rand(16), eps=1e-6)
    args.update(over)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        add_rms_norm(**args)
