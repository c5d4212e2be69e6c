"""Paged attention timings per format against torch SDPA on dense bf16 K/V and a device-to-device copy."""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from tqops.attention import paged_attention
from tqops.device_constants import allocate_kv_cache
from tqops.formats import FORMATS, get_format
from tqops.kv.naive import kv_store_naive

from .timing import copy_bandwidth, time_graph

SHAPES = ((1, 32768), (8, 8192), (32, 8192), (1, 131072))
BIG = 256 * 1024  # targets (2) and (4) apply from batch * context >= 256K keys


def _fill_cache(fmt, batch, context, num_kv_heads, head_dim, block_size, gen_seed=0):
    """A cache holding ``batch`` sequences of ``context`` random tokens at shuffled blocks, and its block table."""
    fmt = get_format(fmt)
    n_blk = context // block_size
    cache = allocate_kv_cache(fmt, batch * n_blk, block_size, num_kv_heads, head_dim, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    block_table = torch.randperm(batch * n_blk, device="cuda", generator=g).to(torch.int32).view(batch, n_blk)
    j = torch.arange(context, device="cuda")
    chunk = 16384
    for b in range(batch):
        slots = block_table[b, j // block_size].long() * block_size + j % block_size
        for c in range(0, context, chunk):
            n = min(chunk, context - c)
            k = torch.randn(n, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn(n, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            # The torch reference store (on the GPU): the format's definition, independent of the Triton store.
            kv_store_naive(k, v, cache, slots[c : c + n], fmt, 1.0, 1.0)
    return cache, block_table


def _sdpa_us(batch, context, q_len, num_q_heads, num_kv_heads, head_dim) -> float:
    k = torch.randn(batch, num_kv_heads, context, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, num_q_heads, q_len, head_dim, device="cuda", dtype=torch.bfloat16)
    # Non-causal: for q_len << context the causal corner changes nothing measurable, and SDPA's is_causal
    # aligns the mask top-left, which is not decode semantics.
    return time_graph(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def bench_attention(
    formats: Sequence[str] = FORMATS,
    shapes: Sequence[tuple[int, int]] = SHAPES,
    *,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    q_lens: Sequence[int] = (1, 16),
    log: Optional[Callable[[str], None]] = print,
) -> list[dict]:
    """One row per (shape, format, q_len, mode) with time, bandwidth and the four targets; SDPA and copy rows too.
    ``TQOPS_ATTENTION_FORMATS`` (comma-separated) restricts the formats."""
    formats = os.environ.get("TQOPS_ATTENTION_FORMATS", ",".join(formats)).split(",")
    for name in formats:
        get_format(name)  # an unknown name fails before any timing
    copy_bw = copy_bandwidth()
    rows: list[dict] = []
    for batch, context in shapes:
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        sdpa = {q: _sdpa_us(batch, context, q, num_q_heads, num_kv_heads, head_dim) for q in q_lens}
        dense_bytes = batch * context * num_kv_heads * head_dim * 2 * 2
        for q in q_lens:
            rows.append(dict(batch=batch, context=context, format="sdpa (dense bf16)", q_len=q, mode="dense",
                             time_us=sdpa[q], sdpa_us=sdpa[q], vs_sdpa=1.0, vs_q1=sdpa[q] / sdpa[q_lens[0]],
                             cache_MB=dense_bytes / 1e6, TBps=dense_bytes / sdpa[q] / 1e6,
                             frac_copy_bw=dense_bytes / sdpa[q] * 1e6 / copy_bw))
        for name in formats:
            fmt = get_format(name)
            cache, block_table = _fill_cache(name, batch, context, num_kv_heads, head_dim, block_size)
            cache_bytes = cache.numel()
            own_q1 = None
            for q in q_lens:
                qsl = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * q
                query = torch.randn(batch * q, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
                for causal in ((True,) if q == 1 else (True, False)):
                    def step():
                        return paged_attention(query, cache, block_table, seq_lens, qsl, fmt, causal=causal)

                    us = time_graph(step)
                    if q == q_lens[0]:
                        own_q1 = us
                    bw = cache_bytes / (us * 1e-6)
                    row = dict(batch=batch, context=context, format=name, q_len=q,
                               mode="causal" if causal else "non-causal", time_us=us, sdpa_us=sdpa[q],
                               vs_sdpa=us / sdpa[q], vs_q1=us / own_q1, cache_MB=cache_bytes / 1e6,
                               TBps=bw / 1e12, frac_copy_bw=bw / copy_bw)
                    big = batch * context >= BIG
                    if name == "bf16" and q == 1:
                        row["target"] = "<=1.2x sdpa"
                        row["met"] = us <= 1.2 * sdpa[q]
                    elif name == "turboquant_4bit_nc" and q == 1 and big:
                        row["target"] = "<=0.5x sdpa"
                        row["met"] = us <= 0.5 * sdpa[q]
                    if q > 1:
                        row["target"] = "<=1.5x own q1"
                        row["met"] = us <= 1.5 * own_q1
                    if big:
                        row["bw_target_met"] = bw >= 0.7 * copy_bw
                    rows.append(row)
                    if log:
                        log(f"{batch}x{context} {name:20s} q={q:3d} {row['mode']:10s} {us:9.1f} us "
                            f"sdpa {sdpa[q]:8.1f} bw {bw / 1e12:5.2f} TB/s ({bw / copy_bw:4.0%} of copy)")
            del cache
            torch.cuda.empty_cache()
    rows.append(dict(format="copy (d2d)", TBps=copy_bw / 1e12, frac_copy_bw=1.0))
    return rows


def plot_attention(rows: list[dict], path: str) -> None:
    """PNG of time vs batch*context per format: q_len 1 (causal) and q_len 16 (non-causal) side by side."""
    import matplotlib  # the optional "plot" extra, imported only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, (q, mode) in zip(axes, ((1, "causal"), (16, "non-causal"))):
        series: dict[str, list[tuple]] = {}
        for r in rows:
            if r.get("q_len") != q or r.get("mode") not in (mode, "dense"):
                continue
            label = f"{r['batch']}x{r['context'] // 1024}K"
            series.setdefault(r["format"], []).append((r["batch"] * r["context"], r["time_us"], label))
        for name, pts in series.items():
            pts.sort()
            style = "k--" if name.startswith("sdpa") else "-o"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name, markersize=4)
        ticks = sorted({(p[0], p[2]) for pts in series.values() for p in pts})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([t[0] for t in ticks], [t[1] for t in ticks], rotation=30)
        ax.set_title(f"q_len {q} ({mode})")
        ax.set_xlabel("batch x context (keys)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time per call (us, CUDA graph replay)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep_configs(
    formats: Sequence[str] = ("bf16", "turboquant_4bit_nc", "turboquant_3bit_nc", "fp8_e4m3"),
    shapes: Sequence[tuple[int, int]] = ((32, 8192), (1, 131072)),
    q_lens: Sequence[int] = (1, 16),
    configs: Sequence[dict] = (
        dict(), dict(block_n=32), dict(block_n=128), dict(num_warps=8), dict(num_stages=3),
        dict(num_stages=1), dict(block_n=128, num_warps=8), dict(num_splits_scale=2), dict(num_splits_scale=0.5),
    ),
    num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128, block_size: int = 16,
    log: Optional[Callable[[str], None]] = print,
) -> list[dict]:
    """Time the raw kernel under launch overrides, to tune the default heuristics."""
    # Imported here: triton is optional without CUDA, where `python -m tqops.bench quality` imports this module.
    from tqops.attention.triton_paged import launch_config, paged_attention_triton

    rows = []
    for batch, context in shapes:
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        for name in formats:
            fmt = get_format(name)
            cache, block_table = _fill_cache(name, batch, context, num_kv_heads, head_dim, block_size)
            for q in q_lens:
                qsl = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * q
                query = torch.randn(batch * q, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
                base = launch_config(batch * q, batch, num_q_heads, num_kv_heads, head_dim, block_size,
                                     block_table.shape[1], torch.cuda.get_device_properties(0).multi_processor_count, fmt)
                for cfg in configs:
                    kw = dict(cfg)
                    if "num_splits_scale" in kw:
                        kw["num_splits"] = max(1, int(base["num_splits"] * kw.pop("num_splits_scale")))
                    try:
                        us = time_graph(lambda: paged_attention_triton(
                            query, cache, block_table, seq_lens, qsl, fmt, q > 1, None, None, head_dim**-0.5,
                            1.0, 1.0, **kw), rep_ms=50)
                    except Exception as e:  # a config the compiler rejects (e.g. out of shared memory)
                        us = float("nan")
                        if log:
                            log(f"  config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
                    bw = cache.numel() / (us * 1e-6)
                    rows.append(dict(batch=batch, context=context, format=name, q_len=q, config=str(cfg),
                                     splits=kw.get("num_splits", base["num_splits"]), time_us=us, TBps=bw / 1e12))
                    if log:
                        log(f"{batch}x{context} {name:20s} q={q:3d} {str(cfg):45s} {us:9.1f} us {bw / 1e12:5.2f} TB/s")
            del cache
            torch.cuda.empty_cache()
    return rows
