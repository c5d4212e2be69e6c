"""Bad arguments to kv_store / kv_load raise a clear error naming the argument, and leave the cache untouched."""
import pytest
import torch

import tqops

FMT = "turboquant_4bit_nc"


def _setup():
    cache = tqops.allocate_kv_cache(FMT, 2, 16, 2, 64).zero_()
    key = torch.randn(3, 2, 64)
    return cache, key, key.clone(), torch.tensor([0, 5, -1])


CASES = {
    "key_dtype": (lambda c, k, v, s: (k.to(torch.int32), v, c, s, FMT), TypeError, "key has dtype int32"),
    "key_rank": (lambda c, k, v, s: (k[0], v, c, s, FMT), ValueError, "key must have 3 dims"),
    "value_shape": (lambda c, k, v, s: (k, v[:, :1], c, s, FMT), ValueError, "value has shape"),
    "value_tokens": (lambda c, k, v, s: (k, v[:2], c, s, FMT), ValueError, "value has shape"),
    "heads": (lambda c, k, v, s: (k[:, :1], v[:, :1], c, s, FMT), ValueError, "key has 1 kv heads"),
    "head_dim": (lambda c, k, v, s: (k[..., :32], v[..., :32], c, s, FMT), ValueError, "head_dim=32"),
    "cache_dtype": (lambda c, k, v, s: (k, v, c.float(), s, FMT), TypeError, "kv_cache has dtype float32"),
    "cache_slot_bytes": (lambda c, k, v, s: (k, v, c, s, "bf16"), ValueError, "bytes per slot"),
    "format_name": (lambda c, k, v, s: (k, v, c, s, "int4"), ValueError, "unknown cache format 'int4'"),
    "slot_dtype": (lambda c, k, v, s: (k, v, c, s.float(), FMT), TypeError, "slot_mapping has dtype float32"),
    "slot_count": (lambda c, k, v, s: (k, v, c, s[:2], FMT), ValueError, "slot_mapping has 2 entries"),
    "slot_range": (lambda c, k, v, s: (k, v, c, torch.tensor([0, 32, 1]), FMT), IndexError, "slot_mapping\\[1\\] = 32"),
    "slot_past_int32": (lambda c, k, v, s: (k, v, c, torch.tensor([0, 2**32 + 1, 1]), FMT), IndexError,
                        r"slot_mapping\[1\] = 4294967297 does not fit int32"),
    "slot_below_int32": (lambda c, k, v, s: (k, v, c, torch.tensor([0, -2**40, 1]), FMT), IndexError,
                         r"slot_mapping\[1\] = -1099511627776 does not fit int32"),
    "device": (lambda c, k, v, s: (k.to("meta"), v, c, s, FMT), ValueError, "key is on meta"),
    "key_stride": (lambda c, k, v, s: (k.transpose(1, 2).contiguous().transpose(1, 2), v, c, s, FMT),
                   ValueError, "contiguous in head_dim"),
}


ENTRIES = {"wrapper": lambda *args: tqops.kv_store(*args),
           "raw_op": lambda *args: torch.ops.tqops.kv_store(*args, 1.0, 1.0)}


# Shape, dtype and head checks run in the raw op too; the slot range is a value check of the wrapper (the raw op
# skips out-of-range slots: test_raw_ops.py).
VALUE_CHECKS = ("slot_range", "slot_past_int32", "slot_below_int32")


@pytest.mark.parametrize("entry,case", [(e, c) for e in ENTRIES for c in CASES
                                        if e == "wrapper" or c not in VALUE_CHECKS], ids=lambda x: x)
def test_kv_store_rejects(entry, case):
    make_args, exc, message = CASES[case]
    cache, key, value, slots = _setup()
    before = cache.clone()
    with pytest.raises(exc, match=message):
        ENTRIES[entry](*make_args(cache, key, value, slots))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("scale,exc", [(0.0, ValueError), (float("nan"), ValueError), ("1", TypeError)])
def test_kv_store_rejects_bad_scales(scale, exc):
    cache, key, value, slots = _setup()
    before = cache.clone()
    with pytest.raises(exc, match="k_scale"):
        tqops.kv_store(key, value, cache, slots, FMT, k_scale=scale)
    assert torch.equal(cache, before)


def test_kv_load_rejects_out_of_range_slot_and_wrong_head_dim():
    cache, *_ = _setup()
    with pytest.raises(IndexError, match="slot_mapping\\[0\\] = 99"):
        tqops.kv_load(cache, torch.tensor([99]), FMT, 64)
    with pytest.raises(IndexError, match=r"slot_mapping\[1\] = 4294967296 does not fit int32"):
        tqops.kv_load(cache, torch.tensor([0, 2**32]), FMT, 64)
    with pytest.raises(ValueError, match="bytes per slot"):
        tqops.kv_load(cache, torch.tensor([0]), FMT, 128)


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(num_blocks=0), ValueError, "num_blocks"),
    (dict(block_size=24), ValueError, "power of two"),
    (dict(head_dim=96), ValueError, "head_dim=96"),
])
def test_allocate_rejects(kwargs, exc, message):
    args = dict(fmt=FMT, num_blocks=2, block_size=16, num_kv_heads=2, head_dim=64) | kwargs
    with pytest.raises(exc, match=message):
        tqops.allocate_kv_cache(**args)


def _on_meta(*tensors):
    return [torch.empty_like(t, device="meta") for t in tensors]


def _attention_args():
    cache = tqops.allocate_kv_cache(FMT, 2, 16, 2, 64)
    return (torch.randn(3, 4, 64), cache, torch.tensor([[0, 1]]), torch.tensor([3]), torch.tensor([0, 3]))


def _store_on_meta():
    cache, key, value, slots = _on_meta(*_setup())
    tqops.kv_store(key, value, cache, slots, FMT)


def _load_on_meta():
    cache, _, _, slots = _on_meta(*_setup())
    tqops.kv_load(cache, slots, FMT, 64)


def _fused_store_on_meta():
    cache, _, _, slots = _on_meta(*_setup())
    qkv, q_weight, k_weight, positions, inv_freq = _on_meta(torch.randn(3, 6 * 64), torch.ones(64), torch.ones(64),
                                                            torch.arange(3), torch.ones(32))
    tqops.kv.ops.qk_norm_rope_store(qkv, q_weight, k_weight, positions, inv_freq, 2, 2, 1e-6, cache, slots, FMT)


# Each wrapper on tensors that are all on the meta device (shapes, no data): the first one named, before any value
# check reads them. The raw ops' fake impls still run for them (torch.compile and opcheck use those).
META_CALLS = {
    "kv_store": (_store_on_meta, "key"),
    "kv_load": (_load_on_meta, "kv_cache"),
    "paged_attention": (lambda: tqops.paged_attention(*_on_meta(*_attention_args()), FMT), "query"),
    "qk_norm_rope_store": (_fused_store_on_meta, "qkv"),
}


@pytest.mark.parametrize("case", list(META_CALLS))
def test_wrappers_name_a_meta_device_argument(case):
    call, arg = META_CALLS[case]
    with pytest.raises(ValueError, match=rf"^{arg} is on the meta device \(no data\)"):
        call()


def test_raw_ops_still_run_their_fake_impls_on_meta_tensors():
    cache, key, value, slots = _on_meta(*_setup())
    torch.ops.tqops.kv_store(key, value, cache, slots, FMT, 1.0, 1.0)
    out = torch.ops.tqops.paged_attention(*_on_meta(*_attention_args()), FMT, True, None, None, 0.125, 1.0, 1.0)
    assert out.device.type == "meta" and out.shape == (3, 4, 64)


@pytest.mark.parametrize("device,message", [
    pytest.param("cuda", r"device='cuda', but this torch has no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a CUDA device is present")),
    ("cuda:99", r"device='cuda:99', but (this torch has no CUDA device|only \d+ CUDA device)"),
    ("gpu", r"device='gpu' is not a torch device"),
], ids=["cuda-on-a-cpu-build", "cuda-99", "not-a-device"])
def test_allocate_names_a_device_that_is_not_here(device, message):
    with pytest.raises(ValueError, match=message):
        tqops.allocate_kv_cache(FMT, 2, 16, 2, 64, device=device)
