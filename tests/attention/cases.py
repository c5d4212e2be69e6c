"""Attention test cases: a poisoned paged cache filled through kv_store, and an independent float64 oracle."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from hypothesis import strategies as st

import tqops
from tqops.attention.naive import paged_attention_naive
from tqops.kv.naive import kv_load_naive, kv_store_naive

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass
class Case:
    fmt: tqops.CacheFormat
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, slot_bytes]
    block_table: torch.Tensor  # [batch, max_blocks] int32
    seq_lens: torch.Tensor  # [batch] int32
    query_start_loc: torch.Tensor  # [batch + 1] int32
    causal: bool
    sliding_window: Optional[int]
    sinks: Optional[torch.Tensor]
    k_scale: float
    v_scale: float
    key: torch.Tensor  # unquantized keys per sequence, concatenated [sum(seq_lens), num_kv_heads, head_dim]
    value: torch.Tensor

    def kwargs(self):
        return dict(causal=self.causal, sliding_window=self.sliding_window, sinks=self.sinks,
                    k_scale=self.k_scale, v_scale=self.v_scale)

    def args(self):
        return (self.query, self.cache, self.block_table, self.seq_lens, self.query_start_loc, self.fmt.name)

    def to(self, device):
        moved = {f.name: (v.to(device) if isinstance(v, torch.Tensor) else v)
                 for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}
        return Case(**moved)


def make_case(
    fmt, *, q_lens, seq_lens, num_kv_heads=1, group=1, head_dim=64, block_size=16, causal=True,
    sliding_window=None, with_sinks=False, dtype=torch.float32, k_scale=1.0, v_scale=1.0, seed=0,
    extra_blocks=2, pad_entry=0, device="cpu",
) -> Case:
    """Sequences stored at shuffled blocks of a cache poisoned with 0xFF (NaN in every format)."""
    fmt = tqops.get_format(fmt)
    gen = torch.Generator().manual_seed(seed)
    batch = len(q_lens)
    n_blk = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(n_blk + [1]) + 1
    num_blocks = sum(n_blk) + extra_blocks
    cache = tqops.allocate_kv_cache(fmt, num_blocks, block_size, num_kv_heads, head_dim)
    cache.fill_(0xFF)
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((batch, max_blocks), pad_entry, dtype=torch.int32)
    used = 0
    keys, values = [], []
    for b, seq_len in enumerate(seq_lens):
        block_table[b, : n_blk[b]] = perm[used : used + n_blk[b]].to(torch.int32)
        used += n_blk[b]
        # Structured data: a shared offset and a few outlier channels, like real K/V.
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        k[..., :: head_dim // 8] *= 4.0
        k = k + 0.5 * torch.randn(1, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen) + 0.3
        keys.append(k * k_scale * 2)
        values.append(v * v_scale)
        j = torch.arange(seq_len)
        slots = block_table[b, j // block_size].long() * block_size + j % block_size
        kv_store_naive(keys[-1].to(dtype), values[-1].to(dtype), cache, slots, fmt, k_scale, v_scale)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    query = (torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=gen) * 0.5).to(dtype)
    sinks = torch.randn(num_kv_heads * group, generator=gen) * 2 if with_sinks else None
    case = Case(
        fmt=fmt, query=query, cache=cache, block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        causal=causal, sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        key=torch.cat(keys) if keys else torch.zeros(0), value=torch.cat(values) if values else torch.zeros(0),
    )
    return case.to(device)


def dense_oracle(case: Case, scale: Optional[float] = None, kv: str = "cache") -> torch.Tensor:
    """float64 attention over K/V read back with kv_load (kv="cache") or the unquantized K/V (kv="orig").

    As the op defines it, keys whose block-table entry lies outside the cache, or past the table, are left out."""
    num_tokens, num_q_heads, head_dim = case.query.shape
    num_blocks, block_size, num_kv_heads = case.cache.shape[:3]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64)
    starts, lens = case.query_start_loc.tolist(), case.seq_lens.tolist()
    cache = case.cache.cpu()
    q_all = case.query.cpu().double()
    offset = 0
    for b, seq_len in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        j = torch.arange(seq_len)
        table = case.block_table[b].cpu().long()
        blocks = table[(j // block_size).clamp_max(len(table) - 1)]
        key_ok = (j < len(table) * block_size) & (blocks >= 0) & (blocks < num_blocks)
        if kv == "cache":
            slots = torch.where(key_ok, blocks * block_size + j % block_size, -1)
            k, v = kv_load_naive(cache, slots, case.fmt, head_dim, case.k_scale, case.v_scale)
        else:
            k, v = case.key[offset : offset + seq_len].cpu(), case.value[offset : offset + seq_len].cpu()
        offset += seq_len
        k, v = k.double(), v.double()
        for i in range(q0, q1):
            pos = seq_len - (q1 - q0) + (i - q0)
            vis = key_ok.clone()
            if case.causal:
                vis &= j <= pos
            if case.sliding_window is not None:
                vis &= pos - j < case.sliding_window
                if not case.causal:
                    vis &= j - pos < case.sliding_window
            for h in range(num_q_heads):
                kh = h // group
                s = (k[vis, kh] @ q_all[i, h]) * scale
                logits = s
                if case.sinks is not None:
                    logits = torch.cat([s, case.sinks.cpu().double()[h : h + 1]])
                if logits.numel() == 0:
                    continue
                w = torch.softmax(logits, 0)[: s.numel()]
                out[i, h] = w @ v[vis, kh]
    return out


@st.composite
def attention_cases(draw, formats=tqops.FORMATS, max_batch=6, max_q=40, max_ctx=100, head_dims=(64, 128, 256),
                    groups=(1, 4, 8), dtypes=("fp32",)):
    fmt = draw(st.sampled_from(formats))
    batch = draw(st.integers(1, max_batch))
    q_lens = draw(st.lists(st.integers(1, max_q), min_size=batch, max_size=batch))
    ctx = draw(st.lists(st.integers(0, max_ctx), min_size=batch, max_size=batch))
    seq_lens = [q + c for q, c in zip(q_lens, ctx)]
    max_seq = max(seq_lens)
    window = draw(st.sampled_from((None, None, 1, 5, 17, max_seq + 10)))
    scales = draw(st.sampled_from(((1.0, 1.0), (0.5, 2.0), (0.05, 0.1))))
    return dict(
        fmt=fmt, q_lens=q_lens, seq_lens=seq_lens,
        num_kv_heads=draw(st.integers(1, 2)), group=draw(st.sampled_from(groups)),
        head_dim=draw(st.sampled_from(head_dims)), block_size=draw(st.sampled_from((16, 32, 64))),
        causal=draw(st.booleans()), sliding_window=window, with_sinks=draw(st.booleans()),
        dtype=DTYPES[draw(st.sampled_from(dtypes))], k_scale=scales[0], v_scale=scales[1],
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# Attention modes the GPU tests run each format in (make_case keyword arguments).
MODES = {
    "causal": dict(causal=True),
    "noncausal": dict(causal=False),
    "window_sinks": dict(causal=True, sliding_window=300, with_sinks=True),
    "noncausal_window_sinks": dict(causal=False, sliding_window=100, with_sinks=True),
}


def compare_to_reference(case, tol=1.5e-2):
    """``tqops.paged_attention`` on the case against the torch reference on the same device: relative error < tol."""
    out = tqops.paged_attention(*case.args(), **case.kwargs())
    if out.is_cuda:
        torch.cuda.synchronize()
    ref = paged_attention_naive(case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc,
                                case.fmt, case.causal, case.sliding_window, case.sinks,
                                case.query.shape[-1] ** -0.5, case.k_scale, case.v_scale)
    assert out.shape == ref.shape and out.dtype == case.query.dtype
    assert not torch.isnan(out).any()
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < tol, f"relative error {float(err):.2e}"
    return out


def replay_with_seq_lens(run, seq_lens: torch.Tensor, lens_per_replay):
    """Capture ``run`` (an attention call reading ``seq_lens``) in a CUDA graph, then for each entry of
    ``lens_per_replay`` write it into ``seq_lens`` and replay: yields the graph's output after each replay."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for lens in lens_per_replay:
        seq_lens.copy_(torch.tensor(lens, dtype=seq_lens.dtype))
        graph.replay()
        torch.cuda.synchronize()
        yield out
