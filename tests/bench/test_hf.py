"""The Hugging Face decode benchmark's three set-ups on CPU at a tiny shape: they run, and agree on the logits."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tqops.bench import hf  # noqa: E402

TINY = dict(hf.QWEN3_8B, vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)


def _decode_logits(attn_implementation, cache_factory):
    model = hf.hf_qwen3(TINY, attn_implementation, "cpu", dtype=torch.float32)
    torch.manual_seed(1)
    step = hf.hf_decode_step(model, cache_factory(model), batch=2, context=40)
    return step()


def test_tqops_cache_decode_matches_static_cache():
    import tqops.hf

    static = _decode_logits("sdpa", lambda m: transformers.StaticCache(config=m.config, max_cache_len=64))
    paged = _decode_logits("tqops", lambda m: tqops.hf.PagedKVCache(m.config, cache_format="fp16", max_batch_size=2,
                                                                     max_cache_len=64))
    assert paged.shape == static.shape == (2, 1, TINY["vocab_size"])
    # the paged cache holds K/V in fp16, the static one in fp32
    torch.testing.assert_close(paged, static, rtol=2e-3, atol=2e-3 * static.abs().max().item())


def test_bench_rows_on_cpu():
    rows = hf.bench_hf(TINY, batches=(1,), context=40, formats=("bf16",), device="cpu")
    (row,) = rows
    for key in ("static_cache_compiled_ms", "hf_tqops_cache_ms", "tqops_qwen3_ms"):
        assert row[key] > 0
    assert row["vs_static_cache"] == pytest.approx(row["hf_tqops_cache_ms"] / row["static_cache_compiled_ms"])
