"""Greedy generation with a PagedKVCache equals transformers' own eager attention, batch 1 and left-padded batch 3."""
import pytest
import torch

pytest.importorskip("transformers")
# newer transformers (5.24) call the argument `cache`; past_key_values still works there, with this warning
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
from tqops.hf import PagedKVCache  # noqa: E402

from .tiny import ARCHITECTURES, left_padded, reference_attention, tiny_model  # noqa: E402

NEW_TOKENS = 32
# (cache format, prompt lengths): each architecture runs a bf16 single row and an fp16 left-padded batch of 3.
CASES = {"bf16-batch1": ("bf16", [11]), "fp16-batch3-left-padded": ("fp16", [11, 4, 8])}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers(arch, case):
    fmt, lengths = CASES[case]
    model = tiny_model(arch)
    ids, mask = left_padded(lengths)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    # transformers' eager attention of this architecture, over K/V rounded as the cache stores them
    model.set_attn_implementation(reference_attention(fmt))
    want = model.generate(ids, **kwargs)
    model.set_attn_implementation("tqops")
    cache = PagedKVCache(model.config, cache_format=fmt, max_batch_size=4, max_cache_len=64)
    got = model.generate(ids, past_key_values=cache, **kwargs)
    assert got.tolist() == want.tolist()
    # each row holds its real tokens only: prompt + every new token but the last (not fed back), never the padding
    new_tokens = got.shape[1] - ids.shape[1]
    assert cache.sequence_lengths()[:len(lengths)].tolist() == [n + new_tokens - 1 for n in lengths]
    assert cache.get_seq_length() == ids.shape[1] + new_tokens - 1


def test_one_line_generate_sizes_its_cache_and_equals_a_hand_made_one():
    """``tqops.hf.generate``: the cache sized from the rows (times num_return_sequences) and the prompt plus
    max_new_tokens, passed by the keyword this transformers takes (no deprecation warning)."""
    import warnings

    import tqops.hf

    model = tiny_model("qwen3")
    model.set_attn_implementation("tqops")
    ids, mask = left_padded([9, 4])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    cache = PagedKVCache(model.config, cache_format="fp8_e4m3", max_batch_size=2, max_cache_len=64)
    want = model.generate(ids, **{tqops.hf.cache_argument(model): cache}, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        got = tqops.hf.generate(model, ids, cache_format="fp8_e4m3", **kwargs)
        sampled = tqops.hf.generate(model, ids, attention_mask=mask, max_new_tokens=3, do_sample=True,
                                    num_return_sequences=2, pad_token_id=0)
    assert got.tolist() == want.tolist() and sampled.shape == (4, ids.shape[1] + 3)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=2, past_key_values=None), "makes its own cache; got past_key_values="),
    (dict(max_new_tokens=2, cache_format="int4"), "unknown cache format 'int4'"),
])
def test_one_line_generate_names_bad_arguments(kwargs, message):
    import tqops.hf

    model = tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        tqops.hf.generate(model, torch.ones(1, 3, dtype=torch.long), **kwargs)


def test_cache_keyword_follows_the_models_forward():
    import tqops.hf

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, past_key_values=None):
            return input_ids

    assert tqops.hf.cache_argument(Old()) == "past_key_values" and tqops.hf.cache_argument(New()) == "cache"


def test_generate_checks_warn_when_transformers_has_no_such_method(monkeypatch):
    from transformers import GenerationMixin

    from tqops.hf import generation

    monkeypatch.delattr(GenerationMixin, "_prepare_cache_for_generation")
    with pytest.warns(RuntimeWarning, match="does not check a PagedKVCache"):
        assert generation.install() is False
