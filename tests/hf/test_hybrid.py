"""PagedKVCache on hybrid Qwen3.5 models (Gated DeltaNet linear attention + gated full attention): greedy generation
equals transformers' eager model, failed steps leave the cache as it was, reset, crop and bad inputs."""
import functools
import importlib
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")
# newer transformers (5.24) call the argument `cache`; past_key_values still works there, with this warning
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
from tqops.hf import PagedKVCache, generate_speculative  # noqa: E402
from tqops.hf.cache import LinearAttentionCacheLayer, PagedCacheLayer  # noqa: E402

from .test_speculative import PerRowOracle, random_drafter  # noqa: E402
from .tiny import VOCAB, decode, first_step, left_padded, prefill, reference_attention  # noqa: E402

LINEAR, FULL = "linear_attention", "full_attention"
EVERY_4TH = [LINEAR] * 3 + [FULL]  # Qwen3.5's full_attention_interval 4
EVERY_2ND = [LINEAR, FULL] * 2
TRAILING_LINEAR = [LINEAR, FULL, LINEAR, LINEAR]  # linear layers after the last attention layer (not in Qwen3.5)
NEW_TOKENS = 32
LENGTHS = [11, 4, 8]  # a left-padded batch of 3, width 11


@pytest.fixture(autouse=True, scope="module")
def torch_gated_delta_rule():
    """transformers binds the Gated DeltaNet functions at import to fla's or causal-conv1d's kernels where installed
    (Triton, CUDA only); on CPU both the eager reference and the tqops route run transformers' torch reference."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("qwen3_5", "qwen3_5_moe"):
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
            for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                       "causal_conv1d_update"):
                patch.setattr(module, fn, inspect.unwrap(getattr(module, fn)))
        yield


def _text_config(head_dim, layer_types, **extra):
    # hidden 128, 4 query heads over 2 kv heads (GQA); Gated DeltaNet with 2 key heads over 4 value heads of 32
    return dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=len(layer_types),
                num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                layer_types=list(layer_types), initializer_range=0.5, pad_token_id=0, **extra)


def _build(kind, head_dim, layer_types):
    t = transformers
    if kind == "qwen3_5":
        return t.Qwen3_5ForCausalLM(t.Qwen3_5TextConfig(**_text_config(head_dim, layer_types)))
    if kind == "qwen3_5_moe":
        config = t.Qwen3_5MoeTextConfig(**_text_config(head_dim, layer_types, num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=64, shared_expert_intermediate_size=64))
        return t.Qwen3_5MoeForCausalLM(config)
    # the vision-language model, generating text only (its tiny vision tower never runs)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=128,
                  initializer_range=0.5)
    return t.Qwen3_5ForConditionalGeneration(t.Qwen3_5Config(text_config=_text_config(head_dim, layer_types),
                                                             vision_config=vision))


# name: (model class, head_dim, layer types)
MODELS = {
    "qwen3_5-d64-every-4th": ("qwen3_5", 64, EVERY_4TH),
    "qwen3_5-d256-every-2nd": ("qwen3_5", 256, EVERY_2ND),
    "qwen3_5_moe-d64-every-2nd": ("qwen3_5_moe", 64, EVERY_2ND),
    "qwen3_5_vl-d128-every-4th": ("qwen3_5_vl", 128, EVERY_4TH),
    "qwen3_5-d64-trailing-linear": ("qwen3_5", 64, TRAILING_LINEAR),
}


@functools.lru_cache(maxsize=None)
def hybrid_model(name: str):
    """A random fp32 model in eval mode, built once per session; tests switch its attention."""
    torch.manual_seed(0)
    return _build(*MODELS[name]).eval()


def _tqops(name="qwen3_5-d64-every-4th"):
    model = hybrid_model(name)
    model.set_attn_implementation("tqops")
    return model


def _snapshot(cache):
    """Every byte the cache holds (NaN-poisoned rows included) and its counters."""
    s = cache.sequences
    tensors = [s.seq_lens, s.seen_tokens]
    for layer in cache.layers:
        tensors += [layer.kv_cache] if isinstance(layer, PagedCacheLayer) else [layer.conv, layer.recurrent]
    states = [(layer.rows, layer.has_previous_state[0]) for layer in cache.layers
              if isinstance(layer, LinearAttentionCacheLayer)]
    return [t.clone().reshape(-1).view(torch.uint8) for t in tensors], states


def _assert_unchanged(cache, before):
    after = _snapshot(cache)
    assert after[1] == before[1], "the linear-attention states' rows changed"
    assert all(torch.equal(a, b) for a, b in zip(after[0], before[0])), "the cache changed"


# (cache format, prompt lengths): each model runs a bf16 single row and an fp16 left-padded batch of 3
CASES = {"bf16-batch1": ("bf16", [11]), "fp16-batch3-left-padded": ("fp16", LENGTHS)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_transformers(name, case):
    fmt, lengths = CASES[case]
    model = hybrid_model(name)
    ids, mask = left_padded(lengths)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    # transformers' eager model (its own linear-attention cache), full attention over K/V rounded as tqops stores them
    model.set_attn_implementation(reference_attention(fmt))
    want = model.generate(ids, **kwargs)
    model.set_attn_implementation("tqops")
    cache = PagedKVCache(model.config, cache_format=fmt, max_batch_size=4, max_cache_len=64)
    got = model.generate(ids, past_key_values=cache, **kwargs)
    assert got.tolist() == want.tolist()
    # not a degenerate random model: each row's greedy tokens vary
    assert all(len(set(row)) > NEW_TOKENS // 2 for row in got[:, ids.shape[1]:].tolist())
    new_tokens = got.shape[1] - ids.shape[1]
    assert cache.sequence_lengths()[:len(lengths)].tolist() == [n + new_tokens - 1 for n in lengths]
    assert cache.get_seq_length() == ids.shape[1] + new_tokens - 1
    linear = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayer)]
    assert cache.is_linear == [kind == LINEAR for kind in MODELS[name][2]]
    assert all(layer.rows == len(lengths) and layer.pending is None for layer in linear)


def test_turboquant_cache_matches_transformers():
    model = hybrid_model("qwen3_5-d256-every-2nd")
    ids, mask = left_padded(LENGTHS)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    model.set_attn_implementation(reference_attention("turboquant_4bit_nc"))
    want = model.generate(ids, **kwargs)
    model.set_attn_implementation("tqops")
    cache = PagedKVCache(model.config, "turboquant_4bit_nc", max_batch_size=3, max_cache_len=32)
    assert cache.cache_formats == [None, "turboquant_4bit_nc", None, "turboquant_4bit_nc"]
    assert model.generate(ids, past_key_values=cache, **kwargs).tolist() == want.tolist()


def test_sizes_and_layers():
    model = _tqops()
    cache = PagedKVCache(model.config, "bf16", max_batch_size=3, max_cache_len=32, device="cpu")
    assert cache.is_hybrid and cache.is_compileable and not cache.is_croppable
    assert cache.is_linear == [True, True, True, False] and len(cache) == 4
    conv_dim = 2 * 2 * 32 + 4 * 32
    layer = cache.layers[0]
    assert layer.conv.shape == layer.conv_scratch.shape == (3, conv_dim, 4)  # linear_conv_kernel_dim 4
    assert layer.recurrent.shape == (3, 4, 32, 32) and layer.recurrent.dtype == torch.float32
    assert not cache.has_previous_state() and cache.get_conv_state(0) is None
    ids, mask = left_padded(LENGTHS)
    prefill(model, cache, ids, mask)
    assert cache.has_previous_state() and cache.has_previous_state(0, state_idx=0)
    # what transformers 5.24 reads (get_*_state) and 5.17 reads (layers[i].*_states[0]) are the same rows
    for i in range(3):
        assert cache.get_conv_state(i).shape == (3, conv_dim, 4)
        assert cache.get_recurrent_state(i).shape == (3, 4, 32, 32)
        assert torch.equal(cache.layers[i].conv_states[0], cache.get_conv_state(i))
        assert torch.equal(cache.layers[i].recurrent_states[0], cache.get_recurrent_state(i))
    assert cache.get_seq_length() == 11 and cache.sequence_lengths().tolist() == LENGTHS
    assert not cache.is_recording_past(0)


def test_reset_then_generate_again():
    model = _tqops("qwen3_5_moe-d64-every-2nd")
    ids, mask = left_padded(LENGTHS)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    cache = PagedKVCache(model.config, "fp16", max_batch_size=3, max_cache_len=32)
    first = model.generate(ids, past_key_values=cache, **kwargs)
    cache.reset()
    assert cache.get_seq_length() == 0 and not cache.sequence_lengths().any()
    assert not cache.has_previous_state(0) and cache.get_conv_state(0) is None and cache.get_recurrent_state(2) is None
    assert model.generate(ids, past_key_values=cache, **kwargs).tolist() == first.tolist()
    # after a reset the linear-attention states take the next batch, here a single row
    cache.reset()
    one = model.generate(ids[:1], attention_mask=mask[:1], past_key_values=cache, max_new_tokens=16, do_sample=False,
                         pad_token_id=0)
    assert one.tolist() == first[:1].tolist() and cache.layers[0].rows == 1


def test_crop_removes_nothing_or_raises():
    model = _tqops()
    ids, mask = left_padded(LENGTHS)
    cache = PagedKVCache(model.config, "bf16", max_batch_size=3, max_cache_len=32)
    prefill(model, cache, ids, mask)
    before = _snapshot(cache)
    for length in (11, 0, 100):  # the current length, transformers 5's "remove nothing", past the end
        cache.crop(length)
    cache.rollback_rows([0, 0, 0])
    _assert_unchanged(cache, before)
    for undo in (lambda: cache.crop(-1), lambda: cache.crop(10), lambda: cache.rollback_rows([0, 1, 0])):
        with pytest.raises(NotImplementedError, match=r"recurrent state.*record_linear_inputs"):
            undo()
    with pytest.raises(ValueError, match="holds 11"):  # argument errors come first, as for any cache
        cache.crop(-12)
    _assert_unchanged(cache, before)
    # the cache still works: a decode step equals one on a cache that never saw the crops
    fresh = PagedKVCache(model.config, "bf16", max_batch_size=3, max_cache_len=32)
    prefill(model, fresh, ids, mask)
    tokens, positions = torch.tensor([[3], [4], [5]]), torch.tensor(LENGTHS)[:, None]
    assert torch.equal(decode(model, cache, tokens, positions), decode(model, fresh, tokens, positions))


def test_prompt_lookup_decoding_raises_before_the_first_step():
    """transformers' assisted and prompt-lookup decoding crop the cache after each verify step: transformers refuses
    them for these models itself, and the cache refuses to record past states for them (activate_past_recording),
    both before anything is written."""
    model = _tqops()
    ids = torch.tensor([[5, 17, 42, 8, 99, 5, 17, 42, 8, 99, 5, 17]])
    cache = PagedKVCache(model.config, "bf16", 1, 64, device="cpu")
    before = _snapshot(cache)
    with pytest.raises(ValueError, match="not supported with stateful models"):
        model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0,
                       prompt_lookup_num_tokens=3)
    with pytest.raises(NotImplementedError, match="assisted, prompt-lookup or speculative decoding"):
        cache.activate_past_recording()
    _assert_unchanged(cache, before)


def _two_prefilled_caches(model):
    ids, mask = left_padded(LENGTHS)
    caches = [PagedKVCache(model.config, "turboquant_4bit_nc", max_batch_size=3, max_cache_len=32) for _ in range(2)]
    for cache in caches:
        prefill(model, cache, ids, mask)
    return caches


def _fail_in_last_attention(model, failing, monkeypatch):
    import tqops.hf.attention as attention

    store_and_attend = attention._store_and_attend

    def fail(layer, *args):
        if layer is failing.layers[3]:
            raise RuntimeError("last attention failed")
        return store_and_attend(layer, *args)

    monkeypatch.setattr(attention, "_store_and_attend", fail)
    return "last attention failed"


def _raise(message):
    def hook(*args):
        raise RuntimeError(message)
    return hook


# where a step fails, after some layers wrote their part of it: before the last attention layer's commit
FAILURES = {
    "layer-2-linear-attention": lambda model, cache, mp: (
        model.model.layers[2].linear_attn.register_forward_hook(_raise("layer 2 failed")), "layer 2 failed"),
    "layer-0-mlp": lambda model, cache, mp: (
        model.model.layers[0].mlp.register_forward_pre_hook(_raise("layer 0 mlp failed")), "layer 0 mlp failed"),
    "last-attention": lambda model, cache, mp: (None, _fail_in_last_attention(model, cache, mp)),
}


@pytest.mark.parametrize("q_len", [1, 3], ids=["decode", "three-tokens"])
@pytest.mark.parametrize("where", list(FAILURES))
def test_step_failing_before_the_commit_leaves_the_cache_as_it_was(where, q_len, monkeypatch):
    """Layers 0-2 (Gated DeltaNet) have run the step when it fails (in layer 2 after its state update, in layer 0's
    MLP, or in layer 3's attention): the conv and recurrent states and the row lengths are as before, and a retry
    equals the step on a cache that never saw the failure."""
    model = _tqops()
    failing, reference = _two_prefilled_caches(model)
    before = _snapshot(failing)
    tokens = torch.randint(1, VOCAB, (3, q_len), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor(LENGTHS)[:, None] + torch.arange(q_len)
    handle, message = FAILURES[where](model, failing, monkeypatch)
    try:
        with pytest.raises(RuntimeError, match=message):
            decode(model, failing, tokens, positions)
    finally:
        if handle is not None:
            handle.remove()
        monkeypatch.undo()
    _assert_unchanged(failing, before)
    assert torch.equal(decode(model, failing, tokens, positions), decode(model, reference, tokens, positions))
    assert torch.equal(decode(model, failing, tokens[:, :1], positions[:, :1] + q_len),
                       decode(model, reference, tokens[:, :1], positions[:, :1] + q_len))


def test_failed_prefill_leaves_the_cache_empty(monkeypatch):
    model = _tqops()
    ids, mask = left_padded(LENGTHS)
    failing = PagedKVCache(model.config, "bf16", max_batch_size=3, max_cache_len=32, device="cpu")
    before = _snapshot(failing)
    _fail_in_last_attention(model, failing, monkeypatch)
    with pytest.raises(RuntimeError, match="last attention failed"):
        prefill(model, failing, ids, mask)
    monkeypatch.undo()
    _assert_unchanged(failing, before)
    assert not failing.has_previous_state(0) and failing.get_seq_length() == 0
    fresh = PagedKVCache(model.config, "bf16", max_batch_size=3, max_cache_len=32)
    assert torch.equal(prefill(model, failing, ids, mask), prefill(model, fresh, ids, mask))


def test_step_failing_after_the_commit_stays_and_reset_recovers():
    """A failure after the last attention layer (the final norm) comes after the commit: every layer holds the step.
    crop cannot take it out of the linear-attention states; reset() and a new prefill can."""
    model = _tqops()
    failing, reference = _two_prefilled_caches(model)
    tokens, positions = torch.tensor([[3], [4], [5]]), torch.tensor(LENGTHS)[:, None]
    handle = model.model.norm.register_forward_pre_hook(_raise("final norm failed"))
    try:
        with pytest.raises(RuntimeError, match="final norm failed"):
            decode(model, failing, tokens, positions)
    finally:
        handle.remove()
    assert failing.get_seq_length() == 12 and failing.sequence_lengths().tolist() == [n + 1 for n in LENGTHS]
    decode(model, reference, tokens, positions)
    for i in range(3):  # the step is in the linear-attention states too
        assert torch.equal(failing.get_recurrent_state(i), reference.get_recurrent_state(i))
    with pytest.raises(NotImplementedError, match="recurrent state"):
        failing.crop(-1)
    failing.reset()
    ids, mask = left_padded(LENGTHS)
    fresh = PagedKVCache(model.config, "turboquant_4bit_nc", max_batch_size=3, max_cache_len=32)
    assert torch.equal(prefill(model, failing, ids, mask), prefill(model, fresh, ids, mask))


def test_linear_states_take_the_models_dtype():
    """The conv states are allocated in the config's dtype (float32 here) and take the model's at the first step; the
    recurrent states stay float32, as transformers' delta rules return them."""
    model = hybrid_model("qwen3_5-d64-every-4th")
    bf16 = type(model)(model.config).to(torch.bfloat16).eval()
    bf16.load_state_dict(model.state_dict())
    bf16.set_attn_implementation("tqops")
    cache = PagedKVCache(bf16.config, "bf16", max_batch_size=3, max_cache_len=32, device="cpu")
    ids, mask = left_padded(LENGTHS)
    logits = prefill(bf16, cache, ids, mask)
    logits = torch.cat([logits[:, -1:], decode(bf16, cache, ids[:, -1:], torch.tensor(LENGTHS)[:, None])], 1)
    assert logits.isfinite().all()
    assert cache.layers[0].conv.dtype == torch.bfloat16 and cache.layers[0].recurrent.dtype == torch.float32
    with pytest.raises(ValueError, match="run every step in one dtype"):
        cache.update_conv_state(torch.zeros(3, 256, 1), 0)


def test_decode_step_compiles_once():
    """generate's compiled decode step (what it does on CUDA with a compileable cache), forced onto CPU: the linear
    states' rows, scratch and commit trace into one graph with fullgraph=True and never recompile."""
    model = _tqops("qwen3_5-d256-every-2nd")
    ids, mask = left_padded([9, 5])
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    eager = model.generate(ids, past_key_values=PagedKVCache(model.config, "bf16", 2, 32), **kwargs)
    config = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # transformers' switch for compiling off CUDA
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):  # the second call, with a new cache, reuses the graph
            got = model.generate(ids, past_key_values=PagedKVCache(model.config, "bf16", 2, 32),
                                 compile_config=config, **kwargs)
            assert got.tolist() == eager.tolist()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


# ---- bad inputs ---------------------------------------------------------------------------------------------
def _changed_config(**change):
    config = transformers.Qwen3_5TextConfig(**_text_config(64, EVERY_2ND))
    for key, value in change.items():
        setattr(config, key, value)
    return config


def test_config_without_gated_delta_net_fields_is_named():
    config = transformers.PretrainedConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=64, hidden_size=128, layer_types=EVERY_2ND)
    with pytest.raises(ValueError, match=r"linear_attention layers, but config.linear_conv_kernel_dim=None"):
        PagedKVCache(config)


@pytest.mark.parametrize("change,kwargs,message", [
    ({"head_dim": 32}, {}, "head_dim=32"),
    ({"linear_num_value_heads": 3}, {}, "linear_num_value_heads=3, not a multiple of linear_num_key_heads=2"),
    ({"linear_conv_kernel_dim": 0}, {}, "config.linear_conv_kernel_dim=0"),
    ({"layer_types": [LINEAR] * 4}, {}, "only linear_attention layers"),
    ({}, {"layer_cache_formats": {0: "bf16"}}, "key 0, but layer 0 is a linear-attention"),
    ({}, {"layer_cache_formats": {-2: "bf16"}}, r"key -2, but layer 2 is a linear-attention.*layers are \[1, 3\]"),
], ids=["head_dim-32", "value-heads-not-a-multiple", "no-conv-kernel", "only-linear-layers",
        "format-for-linear-layer-0", "format-for-linear-layer-minus-2"])
def test_unsupported_configs_are_named(change, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PagedKVCache(_changed_config(**change), **kwargs)


def test_formats_for_attention_layers_are_taken():
    cache = PagedKVCache(_changed_config(), "turboquant_4bit_nc", layer_cache_formats={1: "bf16", -1: "fp8_e4m3"})
    assert cache.cache_formats == [None, "bf16", None, "fp8_e4m3"]


def _other_batch(model, cache, ids, mask):
    decode(model, cache, torch.tensor([[3], [4]]), torch.tensor([[11], [4]]))


def _three_tokens_of_other_batch(model, cache, ids, mask):
    decode(model, cache, torch.ones(2, 3, dtype=torch.long), torch.tensor([[11, 12, 13], [4, 5, 6]]))


# name: (action on a cache that holds a left-padded prompt, exception, message)
BAD_STEPS = {
    # the model's own one-token path concatenates the held conv state with the step's: a shape error, before a write
    "fewer-rows-than-the-states": (_other_batch, RuntimeError, "Sizes of tensors must match"),
    "fewer-rows-in-a-longer-step": (_three_tokens_of_other_batch, ValueError, "this step has 2 rows, but the "
                                                                              "linear-attention states hold 3"),
    "batch-over-max_batch_size": (lambda m, c, ids, mask: prefill(m, c, torch.ones(4, 2, dtype=torch.long), None),
                                  ValueError, "max_batch_size=3"),
    "conv-state-of-another-shape": (lambda m, c, ids, mask: c.update_conv_state(torch.zeros(3, 100, 1), 0),
                                    ValueError, r"conv_states of layer 0 has shape \(3, 100, 1\); expected "
                                                r"\[batch, 256, tokens\]"),
    "recurrent-state-of-another-shape": (lambda m, c, ids, mask: c.update_recurrent_state(torch.zeros(3, 2, 32, 32),
                                                                                          1),
                                         ValueError, r"expected \[batch, 4, 32, 32\]"),
    "conv-state-of-an-attention-layer": (lambda m, c, ids, mask: c.get_conv_state(3), ValueError,
                                         "layer 3 is an attention layer"),
    "keys-for-a-linear-layer": (lambda m, c, ids, mask: c.update(torch.zeros(3, 2, 1, 64), torch.zeros(3, 2, 1, 64),
                                                                 0), ValueError, "layer 0 is a linear-attention layer"),
    "beam-reorder": (lambda m, c, ids, mask: c.reorder_cache(torch.tensor([1, 0, 2])), NotImplementedError,
                     "beam search"),
    "offload-a-linear-layer": (lambda m, c, ids, mask: c.layers[0].offload(), NotImplementedError, "offloading"),
}


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_bad_step_raises_and_leaves_the_cache_unchanged(case):
    action, error, message = BAD_STEPS[case]
    model = _tqops()
    ids, mask = left_padded(LENGTHS)
    cache = PagedKVCache(model.config, "turboquant_4bit_nc", max_batch_size=3, max_cache_len=32)
    prefill(model, cache, ids, mask)
    before = _snapshot(cache)
    with pytest.raises(error, match=message):
        action(model, cache, ids, mask)
    _assert_unchanged(cache, before)



def test_recorded_step_rolls_back_exactly():
    """Inside record_linear_inputs a verify-like step of 4 tokens per row, then rollback_rows by row: every layer's
    states and the next step's logits equal those of a cache that ran only the kept tokens."""
    model = _tqops()
    ids, mask = left_padded(LENGTHS)
    caches = [PagedKVCache(model.config, "bf16", max_batch_size=3, max_cache_len=32) for _ in range(2)]
    for cache in caches:
        prefill(model, cache, ids, mask)
    block = torch.tensor([[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]])
    positions = torch.tensor(LENGTHS)[:, None] + torch.arange(4)
    drop = torch.tensor([3, 0, 2])
    with caches[0].record_linear_inputs(model):
        decode(model, caches[0], block, positions)
        caches[0].rollback_rows(drop)
    # the reference: the same rows with their kept tokens only, one row at a time (rows keep different counts)
    for row, keep in enumerate((4 - drop).tolist()):
        single = PagedKVCache(model.config, "bf16", max_batch_size=1, max_cache_len=32)
        prefill(model, single, ids[row:row + 1], mask[row:row + 1])
        decode(model, single, block[row:row + 1, :keep], positions[row:row + 1, :keep])
        # the linear-attention layers (every 4th layer is attention); not bitwise: the projections' GEMMs over 12 rows
        # and over `keep` rows round differently
        for i in range(3):
            torch.testing.assert_close(caches[0].get_recurrent_state(i)[row], single.get_recurrent_state(i)[0],
                                       atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(caches[0].get_conv_state(i)[row], single.get_conv_state(i)[0], atol=1e-4,
                                       rtol=1e-4)
    assert caches[0].sequence_lengths()[:3].tolist() == [n + 4 - d for n, d in zip(LENGTHS, drop.tolist())]
    with pytest.raises(NotImplementedError, match="last step"):  # once per step: the states before it are gone
        caches[0].rollback_rows([1, 0, 0])
    # crop takes back columns of the last step from every row alike: 4 columns less 1 equals the rows' first 3
    with caches[1].record_linear_inputs(model):
        decode(model, caches[1], block, positions)
        caches[1].crop(-1)
    reference = PagedKVCache(model.config, "bf16", max_batch_size=3, max_cache_len=32)
    prefill(model, reference, ids, mask)
    decode(model, reference, block[:, :3], positions[:, :3])
    next_token, at = torch.tensor([[1], [2], [3]]), positions[:, 3:]
    torch.testing.assert_close(decode(model, caches[1], next_token, at), decode(model, reference, next_token, at),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["bf16", "turboquant_4bit_nc"])
def test_generate_speculative_over_a_hybrid_model_equals_its_greedy(fmt):
    """DFlash over transformers' Qwen3.5 on a PagedKVCache: each row rolls its Gated DeltaNet states back to its
    accepted tokens, and the output is the model's own greedy generate on the same cache format."""
    model = _tqops()
    ids, mask = left_padded(LENGTHS)
    want = model.generate(ids, attention_mask=mask, past_key_values=PagedKVCache(model.config, fmt, 3, 64),
                          max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[:, ids.shape[1]:].tolist()
    drafted = generate_speculative(model, random_drafter(model, block_size=8), ids, NEW_TOKENS, attention_mask=mask,
                                   cache_format=fmt)
    assert drafted.tokens == want
    oracle = generate_speculative(model, None, ids, NEW_TOKENS, attention_mask=mask, cache_format=fmt,
                                  proposer=PerRowOracle(want, [7, 0, 3], 8, model.config.vocab_size))
    assert oracle.tokens == want and max(sum(oracle.acceptance_lengths, [])) > 1


def _hybrid_config(layer_types, head_dim=64):
    return transformers.Qwen3_5TextConfig(**_text_config(head_dim, layer_types))


# name: (the model, the layer types the cache is built for)
OTHER_LAYERS = {
    "more-layers": ("qwen3_5-d64-every-4th", EVERY_4TH * 2),
    "fewer-layers": ("qwen3_5-d64-every-4th", [LINEAR, FULL]),
    "fewer-layers-same-start": ("qwen3_5-d256-every-2nd", [LINEAR, FULL]),
    "other-layer-types": ("qwen3_5-d64-every-4th", EVERY_2ND),
}


@pytest.mark.parametrize("call", ["forward", "generate"])
@pytest.mark.parametrize("case", list(OTHER_LAYERS))
def test_cache_for_other_layers_fails_before_anything_is_stored(case, call):
    name, layer_types = OTHER_LAYERS[case]
    model = _tqops(name)
    ids, mask = left_padded(LENGTHS)
    config = _hybrid_config(layer_types, MODELS[name][1])
    cache = PagedKVCache(config, "bf16", max_batch_size=3, max_cache_len=32, device="cpu")
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=r"the model has 4 decoder layers .*, but this PagedKVCache was built for "
                                         rf"{len(layer_types)}|layer \d is an? (attention|linear-attention) layer"):
        first_step(model, cache, ids, mask, call)
    _assert_unchanged(cache, before)
