"""What the attention experiments share: the e2e verify case (a contiguous-block cache and a batch of 16-token query
blocks) and a log of results as JSON."""
import json
import os

import torch

from tqops.attention.bench_attention import _fill_cache


def verify_case(name: str, batch: int, ctx: int = 8192, q_heads: int = 16, kv_heads: int = 8, head_dim: int = 128,
                q_len: int = 16):
    """(cache, block_table, query [batch * q_len, q_heads, head_dim], query_start_loc, seq_lens) on CUDA.

    Blocks are contiguous, as in the e2e caches. The last sequence ends 7 keys early, and the slots after its end
    hold NaN bit patterns, so a kernel that reads past a sequence shows NaN in its output."""
    cache, bt = _fill_cache(name, batch, ctx, kv_heads, head_dim, 16)
    cache = cache[bt.reshape(-1).long()].contiguous()
    bt = torch.arange(bt.numel(), device="cuda", dtype=torch.int32).view(batch, -1)
    tokens = batch * q_len
    q = torch.randn(tokens, q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, tokens + 1, q_len, device="cuda", dtype=torch.int32)
    seq = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    seq[-1] = ctx - 7
    for p in range(ctx - 7, ctx):
        cache[bt[-1, p // 16], p % 16] = 0xFF
    return cache, bt, q, qsl, seq


class ResultLog:
    """Prints each result as one JSON line and keeps it; ``save`` writes them all to $OUT/<name> (default /tmp)."""

    def __init__(self, name: str):
        self.path = os.path.join(os.environ.get("OUT", "/tmp"), name)
        self.rows = []

    def __call__(self, **row):
        print(json.dumps(row), flush=True)
        self.rows.append(row)

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.rows, f, indent=1)
