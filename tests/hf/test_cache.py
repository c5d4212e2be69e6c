"""PagedKVCache bookkeeping: sizes, crop and rollback, and errors that leave the cache bitwise unchanged."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
# newer transformers (5.24) call the argument `cache`; past_key_values still works there, with this warning
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
from tqops.hf import PagedKVCache, paged_attention_forward  # noqa: E402

from .tiny import decode, first_step, left_padded, prefill, tiny_model  # noqa: E402

LENGTHS = [9, 4, 7]  # a left-padded batch of 3, width 9


def _model(arch="gpt_oss"):
    model = tiny_model(arch)
    model.set_attn_implementation("tqops")
    return model


def _snapshot(cache):
    s = cache.sequences
    return [t.clone() for t in (s.block_table, s.seq_lens, s.seen_tokens, *(layer.kv_cache for layer in cache.layers))]


def _assert_unchanged(cache, before):
    after = _snapshot(cache)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(after, before)), "the cache changed"


@pytest.mark.parametrize("fmt", ["bf16", "turboquant_4bit_nc"])
def test_crop_then_decode_is_as_if_never_decoded(fmt):
    model = _model()
    ids, mask = left_padded(LENGTHS)
    cache = PagedKVCache(model.config, cache_format=fmt, max_batch_size=3, max_cache_len=32)
    prefill_logits = prefill(model, cache, ids, mask)
    lengths = torch.tensor(LENGTHS)
    assert cache.sequence_lengths()[:3].tolist() == LENGTHS and cache.get_seq_length() == 9
    tokens = torch.randint(1, 100, (3, 4), generator=torch.Generator().manual_seed(2))
    steps = [decode(model, cache, tokens[:, t:t + 1], (lengths + t)[:, None]) for t in range(4)]

    cache.crop(9)  # back to the prompt: the four decode steps never happened
    assert cache.get_seq_length() == 9 and cache.sequence_lengths()[:3].tolist() == LENGTHS
    again = [decode(model, cache, tokens[:, t:t + 1], (lengths + t)[:, None]) for t in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(again, steps))

    cache.crop(-2)  # transformers 5's form: drop the last two steps
    assert cache.get_seq_length() == 11
    for t in (2, 3):
        assert torch.equal(decode(model, cache, tokens[:, t:t + 1], (lengths + t)[:, None]), steps[t])

    cache.crop(0)  # removes nothing, as transformers 5 treats it
    cache.crop(100)  # past the end: nothing to drop
    assert cache.get_seq_length() == 13

    cache.crop(6)  # into the prompt: each row loses its last 3 real tokens (the 4-token row keeps 1)
    assert cache.sequence_lengths()[:3].tolist() == [6, 1, 4]
    tail = decode(model, cache, ids[:, 6:], (lengths[:, None] - 3 + torch.arange(3)))
    torch.testing.assert_close(tail, prefill_logits[:, 6:], rtol=1e-4, atol=1e-4 * prefill_logits.abs().max().item())


def test_prompt_lookup_decoding_rolls_back_to_greedy():
    """transformers' prompt-lookup (speculative) decoding verifies drafts and crops the rejected ones."""
    model = _model("llama")
    ids = torch.tensor([[5, 17, 42, 8, 99, 5, 17, 42, 8, 99, 5, 17]])
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    greedy = model.generate(ids, past_key_values=PagedKVCache(model.config, "bf16", 1, 64), **kwargs)
    cache = PagedKVCache(model.config, "bf16", 1, 64)
    crops = []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(n), crop(n))
    got = model.generate(ids, past_key_values=cache, prompt_lookup_num_tokens=3, **kwargs)
    assert got.tolist() == greedy.tolist()
    assert any(n < 0 for n in crops), "no draft was rejected"


def test_sizes_and_reset():
    model = _model()
    cache = PagedKVCache(model.config, cache_format="fp8_e4m3", max_batch_size=3, max_cache_len=40, block_size=32)
    assert (cache.max_batch_size, cache.max_cache_len, len(cache)) == (3, 40, 2)
    assert cache.get_max_cache_shape() == cache.get_max_length() == 40
    assert cache.get_seq_length() == 0 and cache.is_compileable and cache.is_croppable
    assert cache.is_sliding == [True, False]  # gpt-oss alternates sliding and full attention
    assert cache.layers[0].kv_cache is None  # device=None: allocated on the first step's device
    ids, mask = left_padded(LENGTHS)
    prefill(model, cache, ids, mask)
    assert tuple(cache.layers[0].kv_cache.shape[:2]) == (3 * 2, 32)  # 2 blocks of 32 per row hold 40 tokens
    assert cache.get_seq_length() == 9
    cache.reset()
    assert cache.get_seq_length() == 0 and not cache.sequence_lengths().any()
    # a reset cache gives the same logits as a fresh one
    fresh = PagedKVCache(model.config, cache_format="fp8_e4m3", max_batch_size=3, max_cache_len=40, block_size=32)
    assert torch.equal(prefill(model, cache, ids, mask), prefill(model, fresh, ids, mask))


def _other_attention(model, cache, ids, mask):
    model.set_attn_implementation("eager")
    try:
        prefill(model, cache, ids[:, -1:], None)
    finally:
        model.set_attn_implementation("tqops")


def _softcap(model, cache, ids, mask):
    step = cache.update(torch.zeros(3, 2, 1, 64), torch.zeros(3, 2, 1, 64), 0)
    paged_attention_forward(model.model.layers[0].self_attn, torch.zeros(3, 4, 1, 64), *step, None, softcap=50.0)


def _step_from_layer_1(model, cache, ids, mask):
    step = cache.update(torch.zeros(3, 2, 1, 64), torch.zeros(3, 2, 1, 64), 1)
    paged_attention_forward(model.model.layers[1].self_attn, torch.zeros(3, 4, 1, 64), *step, None)


def _float64_step(model, cache, ids, mask):
    # kv_store takes bf16/fp16/fp32 keys: the step is rejected before it advances the row lengths
    keys = torch.zeros(3, 2, 1, 64, dtype=torch.float64)
    step = cache.update(keys, keys, 0)
    paged_attention_forward(model.model.layers[0].self_attn, torch.zeros(3, 4, 1, 64, dtype=torch.float64), *step,
                            None)


def _right_padded(model, cache, ids, mask):
    fresh_mask = torch.ones_like(mask[:, :3])
    fresh_mask[1, 2] = 0
    prefill(model, cache, ids[:, :3], torch.cat([mask, fresh_mask], 1))


# name: (action on a cache that holds a left-padded prompt, exception, message)
BAD_STEPS = {
    "batch-over-max_batch_size": (lambda m, c, ids, mask: prefill(m, c, torch.ones(4, 1, dtype=torch.long), None),
                                  ValueError, "max_batch_size=3"),
    "past-max_cache_len": (lambda m, c, ids, mask: prefill(m, c, ids.repeat(1, 3), None),
                           ValueError, "max_cache_len=32"),
    "padding-after-real-tokens": (_right_padded, ValueError, "left padding"),
    "padding-in-a-continuing-row": (lambda m, c, ids, mask: prefill(m, c, ids[:, :1], torch.cat(
        [mask, torch.tensor([[1], [0], [1]])], 1)), ValueError, "already holds"),
    "4d-mask": (lambda m, c, ids, mask: prefill(m, c, ids[:, :1], torch.zeros(3, 1, 1, 10)),
                ValueError, "2D padding mask"),
    "other-attn-implementation": (_other_attention, ValueError, "attn_implementation='tqops'"),
    "softcap": (_softcap, NotImplementedError, "soft-capping"),
    "float64-keys": (_float64_step, TypeError, "key has dtype float64"),
    "step-starting-at-layer-1": (_step_from_layer_1, RuntimeError, "layer 0 did not start"),
    "reorder_cache": (lambda m, c, ids, mask: c.reorder_cache(torch.tensor([1, 0, 2])), NotImplementedError,
                      "beam search"),
    "batch_repeat_interleave": (lambda m, c, ids, mask: c.batch_repeat_interleave(2), NotImplementedError,
                                "num_beams=1"),
    "crop-past-the-start": (lambda m, c, ids, mask: c.crop(-10), ValueError, "holds 9"),
    "crop-not-an-int": (lambda m, c, ids, mask: c.crop(2.0), TypeError, "max_length must be an int"),
}


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_bad_step_raises_and_leaves_the_cache_unchanged(case):
    action, error, message = BAD_STEPS[case]
    model = _model()
    ids, mask = left_padded(LENGTHS)
    cache = PagedKVCache(model.config, cache_format="turboquant_4bit_nc", max_batch_size=3, max_cache_len=32)
    prefill(model, cache, ids, mask)
    before = _snapshot(cache)
    with pytest.raises(error, match=message):
        action(model, cache, ids, mask)
    _assert_unchanged(cache, before)


def test_float64_model_fails_then_the_same_cache_works_in_float32():
    model = copy.deepcopy(tiny_model("llama")).double()
    model.set_attn_implementation("tqops")
    ids, mask = left_padded([7, 3])
    cache = PagedKVCache(model.config, "bf16", max_batch_size=2, max_cache_len=32)
    with pytest.raises(TypeError, match="float64"):
        prefill(model, cache, ids, mask)
    assert cache.get_seq_length() == 0 and not cache.sequence_lengths().any()
    model.float()
    fresh = PagedKVCache(model.config, "bf16", max_batch_size=2, max_cache_len=32)
    assert torch.equal(prefill(model, cache, ids, mask), prefill(model, fresh, ids, mask))
    assert torch.equal(cache.sequence_lengths(), fresh.sequence_lengths())


def test_step_failing_in_a_later_layer_is_undone(monkeypatch):
    """A failure no check foresees (here: layer 1's ops, after layer 0 stored its tokens) leaves the row lengths as
    they were: only the last layer's finish advances them."""
    import tqops.hf.attention as attention

    model = _model("llama")
    ids, mask = left_padded(LENGTHS)
    caches = [PagedKVCache(model.config, "turboquant_4bit_nc", max_batch_size=3, max_cache_len=32) for _ in range(2)]
    for cache in caches:
        prefill(model, cache, ids, mask)
    failing, store_and_attend = caches[0], attention._store_and_attend

    def fail_in_layer_1(layer, *args):
        if layer is failing.layers[1]:
            raise RuntimeError("layer 1 failed")
        return store_and_attend(layer, *args)

    tokens, positions = torch.tensor([[3], [4], [5]]), torch.tensor(LENGTHS)[:, None]
    monkeypatch.setattr(attention, "_store_and_attend", fail_in_layer_1)
    with pytest.raises(RuntimeError, match="layer 1 failed"):
        decode(model, failing, tokens, positions)
    monkeypatch.undo()
    assert failing.get_seq_length() == 9 and failing.sequence_lengths().tolist() == LENGTHS
    assert torch.equal(decode(model, failing, tokens, positions), decode(model, caches[1], tokens, positions))


def _llama_and_two_prefilled_caches():
    """A tiny Llama and two caches after the same prefill: one for a step that fails, one for the reference."""
    model = _model("llama")
    ids, mask = left_padded(LENGTHS)
    caches = [PagedKVCache(model.config, "turboquant_4bit_nc", max_batch_size=3, max_cache_len=32) for _ in range(2)]
    for cache in caches:
        prefill(model, cache, ids, mask)
    return model, caches


@pytest.mark.parametrize("where", ["layer-0-mlp", "layer-1-input-norm"])
def test_step_failing_outside_the_attention_is_undone(where):
    """A failure between two layers' attention (here layer 0's MLP, or layer 1's input norm, after layer 0 stored the
    step's K/V) leaves the row lengths as they were: a retry of the step reads no unwritten slot."""
    model, caches = _llama_and_two_prefilled_caches()
    failing = caches[0]
    before = [t.clone() for t in (failing.sequences.seq_lens, failing.sequences.seen_tokens)]

    def fail(module, args):
        raise RuntimeError(f"{where} failed")

    layer = model.model.layers[0].mlp if where == "layer-0-mlp" else model.model.layers[1].input_layernorm
    stores = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda *a: stores.append(1))
    handle = layer.register_forward_pre_hook(fail)
    tokens, positions = torch.tensor([[3], [4], [5]]), torch.tensor(LENGTHS)[:, None]
    try:
        with pytest.raises(RuntimeError, match=f"{where} failed"):
            decode(model, failing, tokens, positions)
    finally:
        handle.remove()
        hook.remove()
    assert stores, "layer 0's attention did not run before the failure"
    assert torch.equal(failing.sequences.seq_lens, before[0]) and torch.equal(failing.sequences.seen_tokens, before[1])
    assert failing.get_seq_length() == 9 and failing.sequence_lengths().tolist() == LENGTHS
    assert torch.equal(decode(model, failing, tokens, positions), decode(model, caches[1], tokens, positions))


def test_step_failing_after_the_last_attention_stays_and_crop_removes_it():
    """A failure after the last layer's attention (here the final norm) comes after every layer stored the step: the
    cache holds and counts it, and crop(-q_len) removes it, after which a retry equals a fresh cache's step."""
    model, caches = _llama_and_two_prefilled_caches()
    failing = caches[0]

    def fail(module, args):
        raise RuntimeError("final norm failed")

    handle = model.model.norm.register_forward_pre_hook(fail)
    tokens, positions = torch.tensor([[3], [4], [5]]), torch.tensor(LENGTHS)[:, None]
    try:
        with pytest.raises(RuntimeError, match="final norm failed"):
            decode(model, failing, tokens, positions)
    finally:
        handle.remove()
    assert failing.get_seq_length() == 10 and failing.sequence_lengths().tolist() == [n + 1 for n in LENGTHS]
    failing.crop(-1)
    assert failing.get_seq_length() == 9 and failing.sequence_lengths().tolist() == LENGTHS
    assert torch.equal(decode(model, failing, tokens, positions), decode(model, caches[1], tokens, positions))


def test_the_calling_models_attention_decides_not_the_caches_config(tmp_path):
    """The cache's config may be another object than the model's (reloaded, copied): the model's attention counts."""
    model = _model("llama")
    ids, mask = left_padded(LENGTHS)
    model.config.save_pretrained(tmp_path)
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path)  # _attn_implementation not "tqops"
    fresh = PagedKVCache(model.config, "bf16", max_batch_size=3, max_cache_len=32)
    cache = PagedKVCache(reloaded, "bf16", max_batch_size=3, max_cache_len=32)
    assert torch.equal(prefill(model, cache, ids, mask), prefill(model, fresh, ids, mask))

    says_tqops = PagedKVCache(copy.deepcopy(model.config), "bf16", max_batch_size=3, max_cache_len=32)
    prefill(model, says_tqops, ids, mask)
    before = _snapshot(says_tqops)
    model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(ValueError, match="attn_implementation='tqops'"):
            prefill(model, says_tqops, ids[:, -1:], None)
    finally:
        model.set_attn_implementation("tqops")
    _assert_unchanged(says_tqops, before)


@pytest.mark.parametrize("max_batch_size", [2, 4], ids=["rows-for-the-prompts", "rows-for-every-beam"])
def test_beam_search_raises_before_the_prompt_step(max_batch_size):
    """generate(num_beams=2) fails before its first step, whether or not the cache has a row for every beam (with
    enough rows the prompt step used to run and write the cache before the first beam reorder raised)."""
    model = _model("llama")
    ids, mask = left_padded([7, 3])
    cache = PagedKVCache(model.config, "bf16", max_batch_size=max_batch_size, max_cache_len=32, device="cpu")
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=r"num_beams=2.*beam search.*expected num_beams=1"):
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, num_beams=2,
                       do_sample=False, pad_token_id=0)
    _assert_unchanged(cache, before)


def test_generate_with_more_rows_than_max_batch_size_raises_before_the_prompt_step():
    model = _model("llama")
    ids, mask = left_padded([7, 3])
    cache = PagedKVCache(model.config, "bf16", max_batch_size=3, max_cache_len=32, device="cpu")
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=r"4 rows.*num_return_sequences=2.*max_batch_size=3"):
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=True,
                       num_return_sequences=2, pad_token_id=0)
    _assert_unchanged(cache, before)


def test_tqops_attention_given_keys_of_another_kind_says_what_to_pass():
    model = _model()
    with pytest.raises(TypeError, match="past_key_values=tqops.hf.PagedKVCache"), torch.no_grad():
        paged_attention_forward(model.model.layers[0].self_attn, torch.zeros(1, 4, 1, 64), object(), object(), None)


BAD_ARGUMENTS = {
    "unknown-format": ({"cache_format": "int4"}, ValueError, "unknown cache format 'int4'"),
    "layer-index-out-of-range": ({"layer_cache_formats": {2: "bf16"}}, IndexError, "layer_cache_formats has key 2"),
    "layer-formats-not-a-dict": ({"layer_cache_formats": ["bf16"]}, TypeError, "layer_cache_formats must be a dict"),
    "layer-named-twice": ({"layer_cache_formats": {0: "bf16", -2: "fp8_e4m3"}}, ValueError,
                          "layer_cache_formats keys 0 and -2 both name layer 0, with different formats"),
    "zero-max_batch_size": ({"max_batch_size": 0}, ValueError, "max_batch_size must be a positive int"),
    "max_cache_len-not-int": ({"max_cache_len": 64.0}, ValueError, "max_cache_len must be a positive int"),
    "block_size-below-16": ({"block_size": 8}, ValueError, "block_size must be a power of two >= 16"),
    "device-not-here": ({"device": "cuda:99"}, ValueError,
                        r"device='cuda:99', but (this torch has no CUDA device|only \d+ CUDA device)"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_are_named(case):
    kwargs, error, message = BAD_ARGUMENTS[case]
    with pytest.raises(error, match=message):
        PagedKVCache(tiny_model("llama").config, **kwargs)


@pytest.mark.parametrize("change,message", [
    ({"head_dim": 32}, "head_dim=32"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
], ids=["head_dim-32", "chunked-attention-layers"])
def test_unsupported_configs_are_named(change, message):
    config = copy.deepcopy(tiny_model("qwen3").config)
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        PagedKVCache(config)


def _config_with_layers(model, num_layers):
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = (config.layer_types * num_layers)[:num_layers]
    return config


@pytest.mark.parametrize("num_layers", [1, 3], ids=["fewer-layers", "more-layers"])
@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
@pytest.mark.parametrize("call", ["forward", "generate"])
def test_cache_for_another_layer_count_fails_before_anything_is_stored(call, arch, num_layers):
    """With more layers than the model, the step would never be committed (every step overwriting position 0); with
    fewer, the first layer would commit it before the missing layer failed. Either way: a ValueError, the cache as it
    was."""
    model = _model(arch)
    ids, mask = left_padded(LENGTHS)
    cache = PagedKVCache(_config_with_layers(model, num_layers), "bf16", max_batch_size=3, max_cache_len=32,
                         device="cpu")
    before = _snapshot(cache)
    message = rf"the model has 2 decoder layers .*, but this PagedKVCache was built for {num_layers}"
    with pytest.raises(ValueError, match=message):
        first_step(model, cache, ids, mask, call)
    _assert_unchanged(cache, before)
