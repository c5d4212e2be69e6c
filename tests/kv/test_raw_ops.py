"""The raw custom ops (torch.ops.tqops.kv_store / kv_load) check scales themselves (shapes, dtypes and heads:
test_bad_inputs.py), and skip out-of-range slots identically on the CPU reference and the Triton store kernel."""
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tqops  # noqa: E402
from tqops.kv import triton_store  # noqa: E402
from tqops.kv.naive import kv_store_naive  # noqa: E402

if not torch.cuda.is_available() and not triton_store._interpreted():
    triton_store = importlib.reload(triton_store)

FMT = "turboquant_4bit_nc"


def _setup(num_kv_heads=2):
    cache = tqops.allocate_kv_cache(FMT, 2, 16, num_kv_heads, 64).zero_()
    key = torch.randn(3, num_kv_heads, 64)
    return cache, key, torch.randn(3, num_kv_heads, 64), torch.tensor([0, 5, -1])


def test_raw_store_rejects_bad_scale():
    cache, key, value, slots = _setup()
    before = cache.clone()
    with pytest.raises(ValueError, match="k_scale must be a positive"):
        torch.ops.tqops.kv_store(key, value, cache, slots, FMT, -1.0, 1.0)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("impl", ["naive", "triton"])
def test_raw_store_skips_out_of_range_slots(impl):
    cache, key, value, _ = _setup()
    slots = torch.tensor([3, 32, 7])  # 32 slots in the cache: the middle token has none
    want = cache.clone()
    kv_store_naive(key[[0, 2]], value[[0, 2]], want, torch.tensor([3, 7]), tqops.get_format(FMT), 1.0, 1.0)
    if impl == "naive":
        torch.ops.tqops.kv_store(key, value, cache, slots, FMT, 1.0, 1.0)
    else:  # compiled on a GPU machine (its tensors there), interpreted on CPU
        device = "cuda" if torch.cuda.is_available() else "cpu"
        key, value, slots, cache = (t.to(device) for t in (key, value, slots, cache))
        triton_store.kv_store_triton(key, value, cache, slots, tqops.get_format(FMT), 1.0, 1.0)
    assert torch.equal(cache.cpu(), want)


@pytest.mark.parametrize("impl", ["naive", "triton"])
def test_raw_store_skips_slots_past_int32(impl):
    """2**32 + 3 is out of range, not slot 3: the store kernels read slots as int64, as the CPU op does."""
    cache, key, value, _ = _setup()
    want = cache.clone()
    kv_store_naive(key[[0]], value[[0]], want, torch.tensor([7]), tqops.get_format(FMT), 1.0, 1.0)
    slots = torch.tensor([7, 2**32 + 3, -2**40])
    device = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    key, value, slots, cache = (t.to(device) for t in (key, value, slots, cache))
    if impl == "naive":
        torch.ops.tqops.kv_store(key, value, cache, slots, FMT, 1.0, 1.0)
    else:
        triton_store.kv_store_triton(key, value, cache, slots, tqops.get_format(FMT), 1.0, 1.0)
    assert torch.equal(cache.cpu(), want)


def test_raw_load_returns_zeros_past_the_cache():
    cache, key, value, slots = _setup()
    tqops.kv_store(key, value, cache, slots, FMT)
    k, v = torch.ops.tqops.kv_load(cache, torch.tensor([0, 32, -1, 5]), FMT, 64, 1.0, 1.0)
    assert torch.equal(k[1:3], torch.zeros_like(k[1:3])) and torch.equal(v[1:3], torch.zeros_like(v[1:3]))
    assert k[[0, 3]].abs().sum() > 0


def test_wrapper_rejects_duplicate_slots_before_writing():
    cache, key, value, _ = _setup()
    before = cache.clone()
    with pytest.raises(ValueError, match=r"slot_mapping stores slot 5 more than once \(entries \[0, 2\]\)"):
        tqops.kv_store(key, value, cache, torch.tensor([5, 1, 5]), FMT)
    assert torch.equal(cache, before)


def test_raw_ops_pass_opcheck_with_int32_and_int64_slots():
    cache, key, value, slots = _setup()
    for s in (slots, slots.to(torch.int32)):
        torch.library.opcheck(torch.ops.tqops.kv_store.default, (key, value, cache.clone(), s, FMT, 1.0, 1.0))
        torch.library.opcheck(torch.ops.tqops.kv_load.default, (cache, s, FMT, 64, 1.0, 1.0))
