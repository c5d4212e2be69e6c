"""The TurboQuant CUDA decode kernel's program choice: per-head against all-heads programs and their split counts."""
from __future__ import annotations

from typing import Sequence

import torch
from tqdm import tqdm

from tqops.attention import cuda_paged

from .attention import _fill_cache
from .timing import time_graph

# (batch, context) at q_len 1 where all-heads programs can run (>= 8 query tiles, >= 128K keys over the table)
SHAPES = ((8, 32768), (16, 16384), (32, 8192), (64, 4096), (128, 2048))


def rule_choice(batch: int, context: int, fmt: str, num_kv_heads: int = 8, head_dim: int = 128) -> str:
    """What ``paged_attention_cuda`` runs by default for ``batch`` one-token sequences of ``context`` keys (4 q heads
    a kv head, so one query tile of 4 rows a sequence): "all-heads" or "per-head"."""
    from tqops.formats import get_format

    bits = cuda_paged.FORMATS[fmt]
    slot_stride = num_kv_heads * get_format(fmt).slot_bytes(head_dim)
    applies = cuda_paged.all_heads_applies(1, batch, num_kv_heads, slot_stride, bits[0], batch * context)
    return "all-heads" if applies else "per-head"


@torch.no_grad()
def bench_programs(formats: Sequence[str] = tuple(cuda_paged.FORMATS), shapes: Sequence[tuple[int, int]] = SHAPES,
                   num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128,
                   block_size: int = 16) -> list[dict]:
    """One row per (format, shape), q_len 1: microseconds of per-head programs, of all-heads programs at the rule's
    split count (``all_heads_splits``), half and twice it, and of the default call, with what the rule chose."""
    from tqops.attention.constants import sm_count

    device = torch.cuda.current_device()
    num_sms = sm_count(device)
    scale = head_dim**-0.5
    rows = []
    for name, (batch, context) in tqdm([(f, s) for f in formats for s in shapes], desc="programs"):
        cache, table = _fill_cache(name, batch, context, num_kv_heads, head_dim, block_size)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        query = torch.randn(batch, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        splits = cuda_paged.all_heads_splits(batch, 1, context, num_sms)
        variants = {"per_head_us": dict(all_heads=False), "all_heads_us": dict(all_heads=True),
                    "all_heads_half_splits_us": dict(all_heads=True, num_splits=max(1, splits // 2)),
                    "all_heads_twice_splits_us": dict(all_heads=True, num_splits=2 * splits), "default_us": {}}
        row = dict(format=name, batch=batch, context=context,
                   rule=rule_choice(batch, context, name, num_kv_heads, head_dim), kv_heads=num_kv_heads,
                   all_heads_splits=splits)
        ref = None
        for key, kw in variants.items():
            def call(kw=kw):
                return cuda_paged.paged_attention_cuda(query, cache, table, seq_lens, qsl, name, True, None, scale,
                                                       **kw)

            out = call()
            ref = out if ref is None else ref
            torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)  # every variant computes the same attention
            row[key] = time_graph(call)
        row["fastest"] = min((k for k in variants if k != "default_us"), key=lambda k: row[k])[:-3]
        rows.append(row)
        del cache
        torch.cuda.empty_cache()
    return rows
