"""TurboQuant stores saturate instead of overflowing: extreme but finite K/V never read back NaN or inf.

Every fp16 field (the MSE key norm, the uniform values' scale and zero) saturates at +-65504, and values are clipped
to +-65504 before they are quantized, in the torch reference and in both Triton store kernels (CPU:
TRITON_INTERPRET=1), and the two agree byte for byte. The one exception is
rows whose rotation overflows fp32 (several entries near the fp32 maximum): the butterfly's partial sums and the
reference's matmul overflow in different places (and inf - inf is NaN in one but not the other), so their key codes
may differ; their fp16 fields and value codes still agree.
"""
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the kernel's @triton.jit, which picks compiled vs interpreted at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import tqops  # noqa: E402
from tqops.kv import triton_store  # noqa: E402
from tqops.kv.naive import unpack_codes  # noqa: E402
from tqops.quant import lloyd_max  # noqa: E402

if not torch.cuda.is_available() and not triton_store._interpreted():
    # Something imported the module before TRITON_INTERPRET was set; rebuild the kernels interpreted.
    triton_store = importlib.reload(triton_store)

# The interpreter's numpy warns about the fp32 overflows these inputs are made of.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

INTERPRETED = triton_store._interpreted()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP16_MAX = 65504.0
FP32_MAX = torch.finfo(torch.float32).max
TURBOQUANT = [f for f in tqops.FORMATS if f.startswith("turboquant")]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BLOCK_SIZE, HEADS = 16, 2

# One row per case on a standard normal base; j is where a single huge entry goes.
ROWS = ("normal", "one_-7e4", "one_1e6", "one_3e38", "norm_1e5", "norm_1e20", "around_-7e4", "all_+3e38",
        "signs_3e38", "all_-3e38")
ONE_HUGE = {"one_-7e4": -7e4, "one_1e6": 1e6, "one_3e38": 3e38}


def _rows(d: int, gen: torch.Generator, j: int) -> torch.Tensor:
    x = torch.randn(len(ROWS), d, generator=gen, dtype=torch.float64)
    for i, name in enumerate(ROWS):
        if name in ONE_HUGE:
            x[i, j] = ONE_HUGE[name]
        elif name.startswith("norm_"):
            x[i] *= float(name[5:])  # the key norm overflows fp16 (1e5) or the fp32 sum of squares (1e20)
        elif name.startswith("all_"):
            x[i] = float(name[4:])
        elif name == "around_-7e4":
            x[i] = -7e4 * (1 + 0.1 * x[i])  # not constant: a constant row rotates to exact zeros, which are ties
        elif name == "signs_3e38":
            x[i] = x[i].sign() * 3e38
    return x


def _inputs(fmt_name: str, d: int, dtype: torch.dtype):
    """key, value [len(ROWS), HEADS, d] in dtype; head 1 negates a second draw."""
    gen = torch.Generator().manual_seed(d + len(fmt_name))
    j = d // 3
    key = torch.stack([_rows(d, gen, j), -_rows(d, gen, j)], 1).to(dtype)
    value = torch.stack([_rows(d, gen, j), -_rows(d, gen, j)], 1).to(dtype)
    return key, value


def _rotation_overflows(x: torch.Tensor) -> torch.Tensor:
    """Rows whose rotation can overflow fp32: its partial sums are bounded by sum |x|."""
    return x.double().abs().sum(-1) > FP32_MAX / 2


def _half(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] -> float64 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).double()


def _store(kind: str, fmt, key, value, slot_mapping, num_blocks: int, k_scale: float = 1.0) -> torch.Tensor:
    """A cache written by the CPU reference (tqops.kv_store) or a Triton kernel (on DEVICE), returned on CPU."""
    d = key.shape[-1]
    cache = torch.full((num_blocks, BLOCK_SIZE, HEADS, fmt.slot_bytes(d)), 0xFF, dtype=torch.uint8)
    if kind == "reference":
        tqops.kv_store(key, value, cache, slot_mapping, fmt, k_scale=k_scale)
        return cache
    cache = cache.to(DEVICE)
    args = (key.to(DEVICE), value.to(DEVICE), cache, slot_mapping.to(DEVICE), fmt, k_scale, 1.0)
    if kind == "default":
        triton_store.kv_store_triton(*args)
    else:  # the [rows, channels] kernel, which MSE formats do not use by default
        triton_store.launch(*args, **dict(triton_store.default_config(fmt, d, key.dtype), rows=False, block_r=16,
                                          num_warps=4))
    return cache.cpu()


def _check_fields_and_codes(cache, fmt, key, value, slot_mapping):
    """Finite readback, fp16 fields saturated where the true figure is past 65504, codes at the nearest end."""
    d = key.shape[-1]
    key_hat, value_hat = tqops.kv_load(cache, slot_mapping, fmt, d)
    assert bool(torch.isfinite(key_hat).all()) and bool(torch.isfinite(value_hat).all())
    slots = cache.view(-1, HEADS, cache.shape[-1])[slot_mapping.long()]
    k, v = key.double(), value.double()

    if fmt.key_mode == "mse":
        nb = fmt.key_code_bytes(d)
        codes = unpack_codes(slots[..., :nb], fmt.key_bits)
        c_norm = lloyd_max(fmt.key_bits)[0].double()[codes].norm(dim=-1)
        true_norm = k.norm(dim=-1) / c_norm  # float64: never overflows here
        stored = _half(slots[..., nb : nb + 2])
        saturated = true_norm >= FP16_MAX
        assert bool(saturated.any()), "no key norm saturated: the cases lost their point"
        assert bool((stored[saturated] == FP16_MAX).all()), "an overflowing key norm did not saturate at 65504"
        ok = ~saturated
        assert bool(((stored[ok] - true_norm[ok]).abs() <= true_norm[ok] * 2.0**-10).all())
        # Codes keep the direction (a single huge entry stays the largest, with its sign) unless the rotation
        # itself overflowed.
        cos = torch.nn.functional.cosine_similarity(key_hat.double(), k, dim=-1)
        assert bool((cos[~_rotation_overflows(k)] > 0.6).all()), f"key directions lost: {cos}"
        for name, big in ONE_HUGE.items():
            row = key_hat[ROWS.index(name)]  # [HEADS, d]; head 1 holds -big
            sign = 1.0 if big > 0 else -1.0
            assert row.abs().argmax(-1).tolist() == [d // 3] * HEADS, name
            assert row[:, d // 3].sign().tolist() == [sign, -sign], name
    else:
        fmax = torch.finfo(fmt.fp8_dtype).max
        assert torch.equal(key_hat.double(), k.clamp(-fmax, fmax).to(fmt.fp8_dtype).double()), "fp8 keys saturate"

    # Values are clipped to +-65504 before they are quantized: the zero saturates there, the scale never does.
    levels = (1 << fmt.value_bits) - 1
    nb = fmt.value_code_bytes(d)
    vslots = slots[..., fmt.value_offset(d) :]
    scale, zero = _half(vslots[..., nb : nb + 2]), _half(vslots[..., nb + 2 : nb + 4])
    clipped = v.clamp(-FP16_MAX, FP16_MAX)
    assert bool((clipped != v).any()), "no value beyond +-65504: the cases lost their point"
    vmin, vmax = clipped.amin(-1), clipped.amax(-1)
    assert torch.equal(zero, vmin.to(torch.float16).double())
    assert bool((zero.abs() == FP16_MAX).any()), "no value zero saturated: the cases lost their point"
    true_scale = (vmax - zero).clamp_min(0) / levels * (1 + 2.0**-10)
    assert bool((true_scale < FP16_MAX).all())
    assert bool(((scale - true_scale).abs() <= true_scale * 2.0**-10).all())
    codes = unpack_codes(vslots[..., :nb], fmt.value_bits)
    zero, scale = zero.unsqueeze(-1), scale.unsqueeze(-1)
    # (a row of one clipped value, e.g. all past 65504, has scale 0: its codes are 0 and it reads back as the zero)
    below, above = v < zero, (v > zero + levels * scale) & (scale > 0)
    assert bool((codes[below] == 0).all()) and bool((codes[above] == levels).all()), "out-of-range values clamp"
    # Every value reads back within half a step of its clipped value (plus the fp32 rounding of zero + code * scale),
    # so no readback lies more than half a step beyond +-65504.
    err = (value_hat.double() - clipped).abs()
    assert bool((err <= (scale / 2 + clipped.abs() * 2.0**-20).expand_as(v)).all())
    assert bool((value_hat.double().abs() <= FP16_MAX + scale / 2).all()), "a value read back beyond +-65504"


def _attend(cache, fmt, d, dtype, num_blocks):
    """paged_attention on CPU: the last 3 of len(ROWS) tokens, 2 query heads per KV head, causal and not."""
    gen = torch.Generator().manual_seed(d)
    query = torch.randn(3, 2 * HEADS, d, generator=gen).to(dtype)
    block_table = torch.arange(num_blocks, dtype=torch.int32).view(1, -1)
    seq_lens, starts = torch.tensor([len(ROWS)], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    for causal in (True, False):
        out = tqops.paged_attention(query, cache, block_table, seq_lens, starts, fmt, causal=causal)
        assert out.dtype == dtype and bool(torch.isfinite(out).all()), f"non-finite attention (causal={causal})"


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("head_dim", (64, 128), ids=lambda d: f"d{d}")
@pytest.mark.parametrize("fmt_name", TURBOQUANT)
def test_extreme_inputs_saturate(fmt_name, head_dim, dtype):
    fmt, dtype = tqops.get_format(fmt_name), DTYPES[dtype]
    key, value = _inputs(fmt_name, head_dim, dtype)
    num_blocks = -(-len(ROWS) // BLOCK_SIZE)
    slot_mapping = torch.arange(len(ROWS))
    kinds = ("reference", "default", "general") if fmt.key_mode == "mse" else ("reference", "default")
    caches = {kind: _store(kind, fmt, key, value, slot_mapping, num_blocks) for kind in kinds}
    for kind, cache in caches.items():
        _check_fields_and_codes(cache, fmt, key, value, slot_mapping)
        _attend(cache, fmt, head_dim, dtype, num_blocks)

    ref = caches["reference"].view(-1, HEADS, caches["reference"].shape[-1])[: len(ROWS)]
    same = ~_rotation_overflows(key) if fmt.key_mode == "mse" else torch.ones(len(ROWS), HEADS, dtype=torch.bool)
    assert bool((~same).any()) == (fmt.key_mode == "mse")
    codes = fmt.key_code_bytes(head_dim) if fmt.key_mode == "mse" else 0
    tie = _scale_near_a_tie(fmt, value)
    for kind in kinds[1:]:
        out = caches[kind].view(-1, HEADS, ref.shape[-1])[: len(ROWS)]
        # The kernels' scale quotient is a product by 1 / levels: an fp32 ulp from the reference's, so a scale whose
        # exact figure sits on an fp16 midpoint (as 65504 - zero / levels can, clipped) may round the other way, and
        # that row's value codes with it.
        alike = ~tie | _same_value_scale(out, ref, fmt, head_dim)
        assert torch.equal(out[same & alike], ref[same & alike]), f"{kind} kernel bytes differ from the reference"
        # Where the rotation overflowed, only the key codes may differ.
        rest = ~same & alike
        assert torch.equal(out[rest][..., codes:], ref[rest][..., codes:]), f"{kind}: fp16 fields or values differ"
        values = fmt.value_offset(head_dim)
        assert torch.equal(out[..., :values][same], ref[..., :values][same]), f"{kind}: key bytes differ"


def _scale_near_a_tie(fmt, value) -> torch.Tensor:
    """``[rows, heads]``: the exact value scale of the clipped row lies within 2^-20 of an fp16 rounding midpoint."""
    levels = (1 << fmt.value_bits) - 1
    v = value.double().clamp(-FP16_MAX, FP16_MAX)
    zero = v.amin(-1).to(torch.float16).double()
    exact = (v.amax(-1) - zero).clamp_min(0) / levels * (1 + 2.0**-10)
    down = exact.to(torch.float16).double()
    up = torch.nextafter(down.to(torch.float16), torch.tensor(float("inf"), dtype=torch.float16)).double()
    below = torch.nextafter(down.to(torch.float16), torch.tensor(-float("inf"), dtype=torch.float16)).double()
    mid = torch.minimum(((down + up) / 2 - exact).abs(), ((down + below) / 2 - exact).abs())
    return mid <= exact.abs() * 2.0**-20


def _same_value_scale(out, ref, fmt, head_dim) -> torch.Tensor:
    at = fmt.value_offset(head_dim) + fmt.value_code_bytes(head_dim)
    return (out[..., at:at + 2] == ref[..., at:at + 2]).all(-1)


@pytest.mark.parametrize("k_scale", (0.25, 0.37), ids=("pow2_scale", "general_scale"))
def test_k8v4_fp8_keys_saturate_with_scales(k_scale):
    """x / k_scale past fp32 (3e38 / 0.25) or past e4m3 saturates at 448 in the reference and the kernel."""
    fmt = tqops.get_format("turboquant_k8v4")
    key, value = _inputs(fmt.name, 64, torch.float32)
    slot_mapping = torch.arange(len(ROWS))
    ref, out = (_store(kind, fmt, key, value, slot_mapping, 1, k_scale) for kind in ("reference", "default"))
    assert torch.equal(ref, out)
    key_hat, value_hat = tqops.kv_load(ref, slot_mapping, fmt, 64, k_scale=k_scale)
    assert bool(torch.isfinite(key_hat).all()) and bool(torch.isfinite(value_hat).all())
    big = key.abs() / k_scale > 448
    assert bool(big.any()) and torch.equal(key_hat[big], key.sign()[big] * 448 * k_scale)


@pytest.mark.parametrize("kind", ["reference", "default", "general"])
@pytest.mark.parametrize("big", [1e5, 1e30, -1e5, 3e38], ids=["1e5", "1e30", "-1e5", "3e38"])
@pytest.mark.parametrize("fmt_name", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_a_value_beyond_65504_reads_back_clipped(fmt_name, big, kind):
    """One entry past the fp16 range in a row of normal values reads back as +-65504, within half a step (saturating
    the fp16 fields alone would read 1e5 back as 100,034 and 1e30 as 917,056)."""
    fmt = tqops.get_format(fmt_name)
    gen = torch.Generator().manual_seed(11)
    value = torch.randn(1, HEADS, 64, generator=gen)
    value[0, :, 5] = big
    cache = _store(kind, fmt, torch.randn(1, HEADS, 64, generator=gen), value, torch.tensor([0]), 1)
    _, value_hat = tqops.kv_load(cache, torch.tensor([0]), fmt, 64)
    nb = fmt.value_offset(64) + fmt.value_code_bytes(64)
    step = _half(cache.view(-1, HEADS, cache.shape[-1])[0, :, nb:nb + 2])
    clipped = max(min(big, FP16_MAX), -FP16_MAX)
    assert bool(((value_hat[0, :, 5].double() - clipped).abs() <= step / 2).all()), value_hat[0, :, 5]
