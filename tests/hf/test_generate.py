"""Greedy generation with a PagedKVCache equals transformers' own eager attention, batch 1 and left-padded batch 3."""
import pytest

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
