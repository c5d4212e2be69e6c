"""The decode step with a PagedKVCache compiles with fullgraph=True once and never recompiles."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
# newer transformers (5.24) call the argument `cache`; past_key_values still works there, with this warning
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
from tqops.graphs import compile_model  # noqa: E402
from tqops.hf import PagedKVCache  # noqa: E402

from .tiny import left_padded, tiny_model  # noqa: E402

FMT = "turboquant_4bit_nc"


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3"])
def test_generate_compiles_the_decode_step_once(arch):
    """generate's own compiled decode (what it does on CUDA with a compileable cache), forced onto CPU."""
    model = tiny_model(arch)
    model.set_attn_implementation("tqops")
    ids, mask = left_padded([9, 5])
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    eager = model.generate(ids, past_key_values=PagedKVCache(model.config, FMT, 2, 32), **kwargs)
    config = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # transformers' switch for compiling off CUDA
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):  # the second call, with a new cache, reuses the graph
            got = model.generate(ids, past_key_values=PagedKVCache(model.config, FMT, 2, 32), compile_config=config,
                                 **kwargs)
            assert got.tolist() == eager.tolist()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_compiled_decode_step_matches_eager():
    """``torch.compile(model, fullgraph=True)`` over decode steps after an eager left-padded prefill."""
    model = tiny_model("qwen3")
    model.set_attn_implementation("tqops")
    ids, mask = left_padded([9, 5])
    positions = (mask.sum(-1, keepdim=True) + torch.arange(5)).long()  # each row's next real positions
    tokens = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    compiled, report = compile_model(model, backend="aot_eager")
    logits = {}
    for name, forward in (("eager", model), ("compiled", compiled)):
        cache = PagedKVCache(model.config, FMT, max_batch_size=2, max_cache_len=32, device="cpu")
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
            logits[name] = [forward(tokens[:, t:t + 1], past_key_values=cache,
                                    position_ids=positions[:, t:t + 1]).logits for t in range(5)]
        assert cache.sequence_lengths().tolist() == [9 + 5, 5 + 5]
    assert report.compilations == 1 and not report.graph_breaks, report
    for want, got in zip(logits["eager"], logits["compiled"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _snapshot(cache):
    s = cache.sequences
    return [t.clone() for t in (s.seq_lens, s.seen_tokens, *(layer.kv_cache for layer in cache.layers))]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-decode"])
def test_generate_past_max_cache_len_raises_before_the_first_step(compiled):
    """A prompt of 9 columns and 10 new tokens needs 18 columns (the last token is not stored): with max_cache_len=16
    generate raises before its prefill, also when its decode step is compiled (which skips the eager step check)."""
    model = tiny_model("qwen3")
    model.set_attn_implementation("tqops")
    ids, mask = left_padded([9, 5])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    if compiled:
        config = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
        config._compile_all_devices = True
        kwargs["compile_config"] = config
        torch._dynamo.reset()
    cache = PagedKVCache(model.config, FMT, max_batch_size=2, max_cache_len=16, device="cpu")
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=r"max_cache_len=16.*18"):
        model.generate(ids, past_key_values=cache, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(cache), before)), "the cache changed"
    # 9 + 8 - 1 = 16 columns fit
    kwargs["max_new_tokens"] = 8
    assert model.generate(ids, past_key_values=cache, **kwargs).shape == (2, 9 + 8)
    assert cache.get_seq_length() == 16


def test_compiled_step_past_max_cache_len_raises_and_leaves_the_cache_unchanged():
    """Outside generate a compiled step cannot read the length on the host: it raises (a device-side assert naming
    max_cache_len) instead of dropping the tokens, and stores nothing."""
    model = tiny_model("qwen3")
    model.set_attn_implementation("tqops")
    ids, mask = left_padded([9, 5])
    torch._dynamo.reset()
    compiled, report = compile_model(model, backend="aot_eager")
    cache = PagedKVCache(model.config, FMT, max_batch_size=2, max_cache_len=16, device="cpu")
    positions = (mask.sum(-1, keepdim=True) + torch.arange(8)).long()
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        for t in range(7):  # 9 + 7 = 16 columns
            compiled(ids[:, :1], past_key_values=cache, position_ids=positions[:, t:t + 1])
    assert cache.get_seq_length() == 16 and cache.sequence_lengths().tolist() == [16, 12]
    before = _snapshot(cache)
    with pytest.raises(RuntimeError, match="brings the cache past its max_cache_len"):
        compiled(ids[:, :1], past_key_values=cache, position_ids=positions[:, 7:8])
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(cache), before)), "the cache changed"
    assert report.compilations == 1 and not report.graph_breaks, report
