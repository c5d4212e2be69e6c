"""kv_store / kv_load round trips through the public API on CPU (the torch reference)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tqops
from tqops.kv.naive import value_scale_zero
from tqops.quant.codebook import gaussian_distortion

from .strategies import fp8_ulp, store_cases

MSE_FORMATS = [f for f in tqops.FORMATS if tqops.get_format(f).key_mode == "mse"]


def _fresh_cache(case, fill_seed):
    fmt = case["fmt"]
    cache = tqops.allocate_kv_cache(fmt, case["num_blocks"], case["block_size"], case["num_kv_heads"], case["head_dim"])
    # Random bytes, not a constant, so "untouched" is checked against something a store could plausibly write.
    cache.copy_(torch.randint(0, 256, cache.shape, generator=torch.Generator().manual_seed(fill_seed), dtype=torch.uint8))
    return cache


def _check_keys(case, key_hat):
    fmt, key = case["fmt"], case["key"].float()
    if fmt.key_mode == "dense":
        torch.testing.assert_close(key_hat, case["key"].to(fmt.dense_dtype).float(), rtol=0, atol=0)
    elif fmt.key_mode == "fp8":
        scaled = key / case["k_scale"]
        fmax = torch.finfo(fmt.fp8_dtype).max
        err = (key_hat / case["k_scale"] - scaled.clamp(-fmax, fmax)).abs()
        assert bool((err <= fp8_ulp(scaled.clamp(-fmax, fmax), fmt.fp8_dtype)).all())
    else:
        norm = key.norm(dim=-1)
        # Norm correction: the reconstruction keeps ||k|| up to the fp16 rounding of the stored norm.
        torch.testing.assert_close(key_hat.norm(dim=-1), norm, rtol=2e-3, atol=1e-6)
        rel = (key_hat - key).pow(2).sum(-1) / norm.pow(2).clamp_min(1e-30)
        # Per vector the error concentrates around the Lloyd-Max figure; 4x leaves room for d=64 spread.
        assert float(rel.max()) <= 4 * gaussian_distortion(fmt.key_bits)


def _check_values(case, value_hat):
    fmt, value = case["fmt"], case["value"].float()
    if fmt.value_mode == "dense":
        torch.testing.assert_close(value_hat, case["value"].to(fmt.dense_dtype).float(), rtol=0, atol=0)
    elif fmt.value_mode == "fp8":
        scaled = value / case["v_scale"]
        fmax = torch.finfo(fmt.fp8_dtype).max
        err = (value_hat / case["v_scale"] - scaled.clamp(-fmax, fmax)).abs()
        assert bool((err <= fp8_ulp(scaled.clamp(-fmax, fmax), fmt.fp8_dtype)).all())
    else:
        scale, zero = value_scale_zero(value, fmt.value_bits)
        # Half a step, plus the fp16 rounding of the zero point (the minimum may sit half an fp16 ulp below it).
        bound = scale / 2 + zero.abs() * 2.0**-11 + 1e-7
        assert bool(((value_hat - value).abs() <= bound).all())


@given(case=store_cases(), fill_seed=st.integers(0, 1000))
def test_round_trip(case, fill_seed):
    cache = _fresh_cache(case, fill_seed)
    before = cache.clone()
    fmt, slot_mapping = case["fmt"], case["slot_mapping"]
    tqops.kv_store(case["key"], case["value"], cache, slot_mapping, fmt.name, case["k_scale"], case["v_scale"])

    written = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool)
    written[slot_mapping[slot_mapping >= 0].long()] = True
    flat, flat_before = cache.view(-1, *cache.shape[2:]), before.view(-1, *cache.shape[2:])
    assert torch.equal(flat[~written], flat_before[~written]), "a store touched a slot it was not given"

    keep = slot_mapping >= 0
    key_hat, value_hat = tqops.kv_load(cache, slot_mapping, fmt, case["head_dim"], case["k_scale"], case["v_scale"])
    assert key_hat.dtype == value_hat.dtype == torch.float32
    assert key_hat.shape == case["key"].shape
    assert bool((key_hat[~keep] == 0).all()) and bool((value_hat[~keep] == 0).all())
    sub = dict(case, key=case["key"][keep], value=case["value"][keep])
    _check_keys(sub, key_hat[keep])
    _check_values(sub, value_hat[keep])


@pytest.mark.parametrize("name", MSE_FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("data", ["gaussian", "structured"])
def test_key_distortion_matches_lloyd_max(name, head_dim, data):
    """Mean ||k - k_hat||^2 / ||k||^2 is within 10% of the Lloyd-Max figure, also for structured keys."""
    fmt = tqops.get_format(name)
    gen = torch.Generator().manual_seed(head_dim)
    n, heads = 1024, 4
    key = torch.randn(n, heads, head_dim, generator=gen)
    if data == "structured":  # outlier channels and a shared offset, as real keys have
        key[..., :4] *= 20.0
        key += torch.randn(1, heads, head_dim, generator=gen) * 3.0
    cache = tqops.allocate_kv_cache(fmt, n // 16, 16, heads, head_dim)
    slots = torch.arange(n)
    tqops.kv_store(key, key, cache, slots, fmt)
    key_hat, _ = tqops.kv_load(cache, slots, fmt, head_dim)
    rel = ((key_hat - key).pow(2).sum(-1) / key.pow(2).sum(-1)).mean().item()
    figure = gaussian_distortion(fmt.key_bits)
    if data == "gaussian":
        assert rel == pytest.approx(figure, rel=0.10)
    else:
        # A few dominant channels spread by the Hadamard rotation give lighter tails than a Gaussian,
        # so structured keys may do better than the figure, never more than 10% worse.
        assert rel <= 1.10 * figure


@pytest.mark.parametrize("name", tqops.FORMATS)
def test_zero_and_constant_vectors(name):
    fmt = tqops.get_format(name)
    key = torch.zeros(2, 1, 64)
    value = torch.stack([torch.zeros(1, 64), torch.full((1, 64), 0.75)])
    cache = tqops.allocate_kv_cache(fmt, 1, 16, 1, 64)
    tqops.kv_store(key, value, cache, torch.tensor([0, 5]), fmt)
    key_hat, value_hat = tqops.kv_load(cache, torch.tensor([0, 5]), fmt, 64)
    assert torch.equal(key_hat, torch.zeros_like(key_hat))
    torch.testing.assert_close(value_hat, value, rtol=0, atol=1e-3)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "turboquant_k8v4"])
def test_fp8_saturates_instead_of_nan(name):
    fmt = tqops.get_format(name)
    key = torch.full((1, 1, 64), 1e6)
    cache = tqops.allocate_kv_cache(fmt, 1, 16, 1, 64)
    tqops.kv_store(key, key, cache, torch.tensor([0]), fmt)
    key_hat, _ = tqops.kv_load(cache, torch.tensor([0]), fmt, 64)
    assert torch.isfinite(key_hat).all()
    assert key_hat.max().item() == torch.finfo(fmt.fp8_dtype).max


@settings(max_examples=5)
@given(case=store_cases(max_heads=2, max_blocks=2))
def test_opcheck(case):
    fmt = case["fmt"]
    cache = _fresh_cache(case, 0).zero_()
    torch.library.opcheck(
        torch.ops.tqops.kv_store.default,
        (case["key"], case["value"], cache, case["slot_mapping"], fmt.name, case["k_scale"], case["v_scale"]),
    )
    # opcheck works on copies, so store for real before checking the readback of those slots.
    tqops.kv_store(case["key"], case["value"], cache, case["slot_mapping"], fmt, case["k_scale"], case["v_scale"])
    torch.library.opcheck(
        torch.ops.tqops.kv_load.default,
        (cache, case["slot_mapping"], fmt.name, case["head_dim"], case["k_scale"], case["v_scale"]),
    )


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.smoke) if n == "turboquant_4bit_nc" else n
                                  for n in tqops.FORMATS])
def test_compiled_store_and_load_match_eager(name):
    torch._dynamo.reset()
    fmt = tqops.get_format(name)
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(7, 2, 64, generator=gen), torch.randn(7, 2, 64, generator=gen)
    slots = torch.tensor([3, -1, 17, 0, 31, 8, -1])

    def step(k, v, cache, slot_mapping):
        tqops.kv_store(k, v, cache, slot_mapping, fmt, 0.5, 1.5)
        return tqops.kv_load(cache, slot_mapping, fmt, 64, 0.5, 1.5)

    eager_cache = tqops.allocate_kv_cache(fmt, 2, 16, 2, 64).zero_()
    compiled_cache = eager_cache.clone()
    expected = step(key, value, eager_cache, slots)
    got = torch.compile(step, fullgraph=True, backend="inductor")(key, value, compiled_cache, slots)
    assert torch.equal(compiled_cache, eager_cache)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
