"""transformers' own DFlash path (``generate(assistant_model=..., speculation_type="dflash")``, transformers >= 5.24)
with the target on a tqops PagedKVCache: greedy output equals plain greedy decoding; its drafts get rejected, so the
paged cache is cropped between steps."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MuseGlimmerAssistantModel"):
    pytest.skip("transformers' DFlash path (its MuseGlimmerAssistant drafter) needs transformers >= 5.24",
                allow_module_level=True)
from transformers.generation import candidate_generator  # noqa: E402

from tqops.hf import PagedKVCache  # noqa: E402

from .tiny import VOCAB, tiny_model  # noqa: E402


def assistant():
    """A random 1-layer DFlash drafter in transformers' own class, reading target layers 0 and 1, blocks of 4."""
    torch.manual_seed(0)
    config = transformers.MuseGlimmerAssistantConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, block_size=4, mask_token_id=3, target_layer_ids=[0, 1], vocab_size=VOCAB, bos_token_id=None,
        eos_token_id=None, pad_token_id=0)
    return transformers.MuseGlimmerAssistantModel(config).eval()


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "turboquant_4bit_nc"])
def test_transformers_dflash_on_a_paged_cache_is_greedy(fmt, monkeypatch):
    target = tiny_model("qwen3")
    target.set_attn_implementation("tqops")
    ids = torch.randint(4, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    plain = target.generate(ids, cache=PagedKVCache(target.config, fmt, max_batch_size=1, max_cache_len=64), **kwargs)
    crops = []
    crop = PagedKVCache.crop
    monkeypatch.setattr(PagedKVCache, "crop", lambda self, n: (crops.append(n), crop(self, n))[1])
    drafted = []
    get = candidate_generator.DFlashTokenCandidateGenerator.get_candidates
    monkeypatch.setattr(candidate_generator.DFlashTokenCandidateGenerator, "get_candidates",
                        lambda self, *a, **k: (drafted.append(1), get(self, *a, **k))[1])
    cache = PagedKVCache(target.config, fmt, max_batch_size=1, max_cache_len=64)
    spec = target.generate(ids, cache=cache, assistant_model=assistant(), speculation_type="dflash", **kwargs)
    assert spec.tolist() == plain.tolist()
    assert drafted and crops  # it drafted, and the rejected drafts were cropped off the paged cache
