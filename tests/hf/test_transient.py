"""A forward with attn_implementation="tqops" and no PagedKVCache: keys through a cache of the config's format that
lives for the call, equal to transformers' eager attention over K/V stored in that format; padding either side."""
import contextlib

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
from tqops.hf import PagedKVCache, paged_attention_forward  # noqa: E402
from tqops.hf.transient import FORMAT_ATTRIBUTE  # noqa: E402

from .tiny import ARCHITECTURES, left_padded, reference_attention, tiny_model  # noqa: E402

FORMATS = ("bf16", "fp8_e4m3", "turboquant_4bit_nc")


@contextlib.contextmanager
def cache_format(model, fmt):
    """``model.config.tqops_cache_format = fmt`` inside the block (None: unset); the tiny models are shared."""
    had, old = hasattr(model.config, FORMAT_ATTRIBUTE), getattr(model.config, FORMAT_ATTRIBUTE, None)
    if fmt is None:
        if had:
            delattr(model.config, FORMAT_ATTRIBUTE)
    else:
        setattr(model.config, FORMAT_ATTRIBUTE, fmt)
    try:
        yield
    finally:
        if had:
            setattr(model.config, FORMAT_ATTRIBUTE, old)
        elif hasattr(model.config, FORMAT_ATTRIBUTE):
            delattr(model.config, FORMAT_ATTRIBUTE)


def right_padded(lengths, seed: int = 1):
    ids, mask = left_padded(lengths, seed)
    for row, n in enumerate(lengths):  # the same tokens, moved to the front of their rows
        ids[row] = torch.roll(ids[row], n - ids.shape[1])
        mask[row] = torch.roll(mask[row], n - ids.shape[1])
    return ids, mask


def logits(model, attention, fmt, ids, mask, **kwargs):
    model.set_attn_implementation(attention)
    with cache_format(model, fmt), torch.no_grad():
        return model(ids, attention_mask=mask, **kwargs).logits


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_forward_without_a_cache_is_the_reference_over_the_formats_keys(arch, fmt, padding):
    """Windows (mistral, gemma3), sinks (gpt_oss) and both paddings: the real tokens' logits are the eager model's
    over K/V stored in ``fmt``, with no cache and with transformers' own DynamicCache alike."""
    model = tiny_model(arch, initializer_range=0.02)
    ids, mask = (left_padded if padding == "left" else right_padded)([9, 4, 7])
    want = logits(model, reference_attention(fmt), None, ids, mask, use_cache=False)
    real = mask.bool()
    for use_cache in (False, True):
        got = logits(model, "tqops", fmt, ids, mask, use_cache=use_cache)
        torch.testing.assert_close(got[real], want[real], atol=2e-4, rtol=1e-3)


def test_default_format_is_the_models_16_bit_one_and_a_bad_one_is_named():
    model = tiny_model("llama", initializer_range=0.02)
    ids, mask = left_padded([6, 3])
    real = mask.bool()
    torch.testing.assert_close(logits(model, "tqops", None, ids, mask, use_cache=False)[real],
                               logits(model, reference_attention("bf16"), None, ids, mask, use_cache=False)[real],
                               atol=2e-4, rtol=1e-3)
    with pytest.raises(ValueError, match="config.tqops_cache_format='int3'"):
        logits(model, "tqops", "int3", ids, mask)


def test_loss_per_format_orders_by_precision():
    """Held-in perplexity as an evaluation computes it: labels, no cache. 16-bit keys match the reference exactly
    enough, and the coarser formats move the loss more."""
    model = tiny_model("qwen3", initializer_range=0.02)
    ids, mask = left_padded([12, 12, 12], seed=3)
    model.set_attn_implementation("tqops")
    losses = {}
    for fmt in ("fp16", "fp8_e4m3", "turboquant_3bit_nc"):
        with cache_format(model, fmt), torch.no_grad():
            losses[fmt] = model(ids, attention_mask=mask, labels=ids).loss.item()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        exact = model(ids, attention_mask=mask, labels=ids).loss.item()
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert abs(losses["fp16"] - exact) < 1e-4
    assert abs(losses["fp16"] - exact) <= abs(losses["turboquant_3bit_nc"] - exact)


def test_generate_without_a_paged_cache_equals_generate_with_one():
    model = tiny_model("llama")
    ids, mask = left_padded([8, 3, 5])
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("tqops")
    with cache_format(model, "fp8_e4m3"):
        transient = model.generate(ids, **kwargs)
    cache = PagedKVCache(model.config, cache_format="fp8_e4m3", max_batch_size=3, max_cache_len=32)
    assert transient.tolist() == model.generate(ids, past_key_values=cache, **kwargs).tolist()


def test_keys_of_another_kind_are_a_type_error():
    attn = tiny_model("llama").model.layers[0].self_attn
    with pytest.raises(TypeError, match="PagedKVCache step or a tensor"):
        paged_attention_forward(attn, torch.zeros(1, 4, 2, 64), "keys", "values", None)
    with pytest.raises(ValueError, match="key has 1 positions, fewer than the query's 2"):
        paged_attention_forward(attn, torch.zeros(1, 4, 2, 64), torch.zeros(1, 2, 1, 64), torch.zeros(1, 2, 1, 64),
                                None)


@pytest.mark.parametrize("fmt", ["bf16", "turboquant_4bit_nc"])
def test_hybrid_forward_without_a_cache(fmt):
    """Qwen3.5: its Gated DeltaNet layers run transformers' own cacheless path, its attention layers the transient
    cache; the real tokens' logits are the eager model's over K/V stored in ``fmt``."""
    from .test_hybrid import hybrid_model

    model = hybrid_model("qwen3_5-d64-every-4th")
    ids, mask = left_padded([9, 5])
    want = logits(model, reference_attention(fmt), None, ids, mask, use_cache=False)
    got = logits(model, "tqops", fmt, ids, mask, use_cache=False)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-4, rtol=1e-3)
