"""Prefill logits with fp8 and TurboQuant caches: finite, exact for the stored K/V, close to the dense model."""
import functools

import pytest
import torch

pytest.importorskip("transformers")
# newer transformers (5.24) call the argument `cache`; past_key_values still works there, with this warning
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
from tqops import get_format  # noqa: E402
from tqops.hf import PagedKVCache  # noqa: E402

from .tiny import ARCHITECTURES, left_padded, reference_attention, tiny_model  # noqa: E402

INIT = 0.02
QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
             "turboquant_3bit_nc")
# Formats with at least 4-bit keys and values stay within cosine 0.99 of the dense model's logits.
NEAR_DENSE = ("fp8_e4m3", "fp8_e5m2", "turboquant_k8v4", "turboquant_4bit_nc")
IDS, MASK = left_padded([11, 4, 8])
REAL = MASK.bool()  # logits of padding positions are not compared


def _prefill_logits(model, implementation, cache=None):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(IDS, attention_mask=MASK, past_key_values=cache).logits[REAL]


@functools.lru_cache(maxsize=None)
def _dense_logits(arch):
    return _prefill_logits(tiny_model(arch, INIT), "eager")


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_quantized_prefill_logits(arch, fmt):
    model = tiny_model(arch, INIT)
    cache = PagedKVCache(model.config, cache_format=fmt, max_batch_size=3, max_cache_len=16)
    got = _prefill_logits(model, "tqops", cache)
    assert got.isfinite().all()
    # the model's eager attention over the same quantized K/V (stored, then read back with kv_load)
    want = _prefill_logits(model, reference_attention(fmt))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), _dense_logits(arch).flatten(), dim=0).item()
    assert cosine >= (0.99 if fmt in NEAR_DENSE else 0.9), f"cosine {cosine:.4f} to the dense model's logits"


def test_layer_cache_formats_override_by_layer():
    model = tiny_model("qwen3", INIT)
    cache = PagedKVCache(model.config, cache_format="turboquant_3bit_nc", max_batch_size=3, max_cache_len=16,
                         layer_cache_formats={-1: "bf16"})
    assert cache.cache_formats == ["turboquant_3bit_nc", "bf16"]
    got = _prefill_logits(model, "tqops", cache)
    assert got.isfinite().all()
    assert [layer.kv_cache.shape[-1] for layer in cache.layers] == [get_format(f).slot_bytes(64)
                                                                    for f in cache.cache_formats]
