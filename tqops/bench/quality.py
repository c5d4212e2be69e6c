"""How much a cache format changes attention outputs: cosine vs attention over the unquantized K/V."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from tqops.attention import paged_attention
from tqops.device_constants import allocate_kv_cache
from tqops.formats import FORMATS, get_format
from tqops.kv.naive import kv_store_naive


def structured_kv(num_tokens: int, num_kv_heads: int, head_dim: int, gen: torch.Generator):
    """Keys/values ``[num_tokens, num_kv_heads, head_dim]`` shaped like real ones: outlier channels, a shared offset."""
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    outliers = torch.randperm(head_dim, generator=gen)[: max(1, head_dim // 32)]
    key[..., outliers] *= 8.0
    key += 1.5 * torch.randn(1, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 0.7 + 0.2
    value[..., outliers] *= 4.0
    return key, value


def peaky_queries(key: torch.Tensor, num_queries: int, group: int, gen: torch.Generator, peak_logit: float = 10.0):
    """Queries ``[num_queries, num_kv_heads * group, head_dim]`` each pointing at a few keys, so softmax is peaked.

    A key fully aligned with the query would score about ``peak_logit`` (at scale head_dim ** -0.5) above the rest.
    """
    seq_len, num_kv_heads, head_dim = key.shape
    centered = key - key.mean(0, keepdim=True)
    picks = torch.randint(0, seq_len, (num_queries, num_kv_heads, group, 3), generator=gen)
    heads = torch.arange(num_kv_heads)[None, :, None, None]
    target = centered[picks, heads].sum(-2)  # [q, Hkv, g, d]
    key_norm = centered.norm(dim=-1).mean()
    target = target / target.norm(dim=-1, keepdim=True) * (peak_logit * head_dim**0.5 / key_norm)
    noise = torch.randn(target.shape, generator=gen) * float(target.norm(dim=-1).mean()) / head_dim
    return (target + noise).flatten(1, 2)


def dense_attention(query, key, value, causal: bool, scale: float) -> torch.Tensor:
    """float64 attention of ``query`` ``[q, Hq, d]`` over one sequence's ``key``/``value`` ``[L, Hkv, d]``."""
    q_len, num_q_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_q_heads // num_kv_heads
    k = key.double().repeat_interleave(group, 1).transpose(0, 1)
    v = value.double().repeat_interleave(group, 1).transpose(0, 1)
    s = torch.einsum("qhd,hkd->hqk", query.double(), k) * scale
    if causal:
        pos = seq_len - q_len + torch.arange(q_len)
        s = s.masked_fill(torch.arange(seq_len)[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hqk,hkd->qhd", torch.softmax(s, -1), v)


def cosine_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each ``[..., d]`` output row."""
    a, b = a.double(), b.double()
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-300)


def attention_quality(
    formats: Sequence[str] = FORMATS,
    *,
    seq_len: int = 1024,
    q_len: int = 16,
    num_kv_heads: int = 2,
    group: int = 4,
    head_dim: int = 128,
    block_size: int = 16,
    causal: bool = False,
    query_dtype: torch.dtype = torch.float32,
    device: Optional[str] = None,
    seed: int = 0,
) -> list[dict]:
    """Per format: mean and worst cosine of paged_attention's output against float64 attention on the original K/V.

    One sequence of structured K/V (outlier channels, a shared offset) and peaky queries; rows for BENCHMARKS.md.
    """
    gen = torch.Generator().manual_seed(seed)
    key, value = structured_kv(seq_len, num_kv_heads, head_dim, gen)
    query = peaky_queries(key, q_len, group, gen)
    scale = head_dim**-0.5
    exact = dense_attention(query, key, value, causal, scale)
    n_blk = -(-seq_len // block_size)
    block_table = torch.randperm(n_blk, generator=gen).to(torch.int32)[None, :]
    j = torch.arange(seq_len)
    slots = block_table[0, j // block_size].long() * block_size + j % block_size
    rows = []
    for name in formats:
        fmt = get_format(name)
        # fp8 formats get a per-layer scale that maps the largest |x| near the top of the fp8 range.
        k_scale = v_scale = 1.0
        if fmt.fp8_dtype is not None and fmt.key_mode == "fp8":
            k_scale = float(key.abs().max()) / (torch.finfo(fmt.fp8_dtype).max / 2)
        if fmt.value_mode == "fp8":
            v_scale = float(value.abs().max()) / (torch.finfo(fmt.fp8_dtype).max / 2)
        cache = allocate_kv_cache(fmt, n_blk, block_size, num_kv_heads, head_dim, device=device)
        # The reference store defines the format; the Triton store is tested against it elsewhere.
        kv_store_naive(key.to(device), value.to(device), cache, slots.to(device), fmt, k_scale, v_scale)
        out = paged_attention(
            query.to(device=device, dtype=query_dtype), cache, block_table.to(device),
            torch.tensor([seq_len], dtype=torch.int32, device=device),
            torch.tensor([0, q_len], dtype=torch.int32, device=device), fmt,
            causal=causal, scale=scale, k_scale=k_scale, v_scale=v_scale,
        ).cpu()
        cos = cosine_rows(out, exact)
        rel = (out.double() - exact).norm() / exact.norm()
        rows.append(dict(format=name, mean_cosine=float(cos.mean()), worst_cosine=float(cos.min()),
                         rel_error=float(rel)))
    return rows
