"""The format, not the kernel, sets the error: cosine vs unquantized attention, and agreement with a float64 model."""
import pytest
import torch

import tqops
from tqops.bench.quality import attention_quality, cosine_rows, dense_attention, peaky_queries, structured_kv

# Mean / worst cosine floors on structured K/V with peaky queries (head_dim 128, 1024 keys): measured, with margin.
FLOORS = {
    "bf16": (0.9999, 0.999),
    "fp16": (0.99999, 0.9999),
    "fp8_e4m3": (0.99, 0.9),
    "fp8_e5m2": (0.97, 0.7),
    "turboquant_k8v4": (0.98, 0.9),
    "turboquant_4bit_nc": (0.985, 0.95),
    "turboquant_k3v4_nc": (0.98, 0.93),
    "turboquant_3bit_nc": (0.95, 0.88),
}


def test_quality_rows_meet_floors():
    rows = attention_quality(seq_len=512, q_len=8)
    assert [r["format"] for r in rows] == list(tqops.FORMATS)
    for r in rows:
        mean_floor, worst_floor = FLOORS[r["format"]]
        assert r["mean_cosine"] >= mean_floor, r
        assert r["worst_cosine"] >= worst_floor, r
    # More bits never hurt: 4-bit TurboQuant beats 3-bit.
    by = {r["format"]: r for r in rows}
    assert by["turboquant_4bit_nc"]["mean_cosine"] > by["turboquant_3bit_nc"]["mean_cosine"]


@pytest.mark.parametrize("fmt", tqops.FORMATS)
@pytest.mark.parametrize("causal", [True, False])
def test_error_is_the_formats(fmt, causal):
    """paged_attention over the cache == float64 attention over kv_load'ed K/V, far inside the quantization error."""
    gen = torch.Generator().manual_seed(1)
    seq_len, q_len, num_kv_heads, group, head_dim, block_size = 300, 8, 2, 4, 64, 32
    key, value = structured_kv(seq_len, num_kv_heads, head_dim, gen)
    query = peaky_queries(key, q_len, group, gen)
    n_blk = -(-seq_len // block_size)
    block_table = torch.randperm(n_blk + 2, generator=gen)[:n_blk].to(torch.int32)[None, :]
    j = torch.arange(seq_len)
    slots = block_table[0, j // block_size].long() * block_size + j % block_size
    cache = tqops.allocate_kv_cache(fmt, n_blk + 2, block_size, num_kv_heads, head_dim)
    tqops.kv_store(key, value, cache, slots, fmt, 0.05, 0.02)
    out = tqops.paged_attention(query, cache, block_table, torch.tensor([seq_len], dtype=torch.int32),
                                torch.tensor([0, q_len], dtype=torch.int32), fmt, causal=causal,
                                k_scale=0.05, v_scale=0.02)
    k_hat, v_hat = tqops.kv_load(cache, slots, fmt, head_dim, 0.05, 0.02)
    scale = head_dim**-0.5
    exact = dense_attention(query, key, value, causal, scale)
    model = dense_attention(query, k_hat, v_hat, causal, scale)
    quant_err = (model - exact).norm()
    assert (out.double() - model).norm() <= 1e-3 * quant_err + 1e-6 * exact.norm()
    torch.testing.assert_close(cosine_rows(out, exact), cosine_rows(model, exact), rtol=0, atol=1e-5)
