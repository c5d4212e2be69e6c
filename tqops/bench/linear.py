"""The decoder's projections at one and at eight rows: tqops.linear against F.linear (cuBLAS) and the byte floor."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tqops.linear import linear

from .e2e import SHAPES
from .timing import copy_bandwidth, time_per_call

L2_BYTES = 60 << 20  # the calls cycle through enough weight copies (~4x L2) that none is read from L2


def projections(cfg: dict) -> dict[str, tuple[int, int]]:
    """A decoder layer's projections, name -> (out_features, in_features)."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * cfg["intermediate_size"], h),
            "down_proj": (h, cfg["intermediate_size"])}


@torch.no_grad()
def bench_linear(shapes: Sequence[str] = tuple(SHAPES), rows: Sequence[int] = (1, 8),
                 dtype=torch.bfloat16) -> list[dict]:
    """One row per (shape, projection, rows): microseconds per call of both, and the weight bytes over the copy
    bandwidth measured in the same run."""
    copy_bw = copy_bandwidth()
    out = []
    cases = [(s, name, nk, m) for s in shapes for name, nk in projections(SHAPES[s][0]).items() for m in rows]
    for shape, name, (n, k), m in tqdm(cases, desc="linear"):
        sets = max(1, min(64, -(-4 * L2_BYTES // (n * k * 2))))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(sets)]
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        torch.testing.assert_close(linear(x, weights[0]), F.linear(x, weights[0]), rtol=2e-2, atol=2e-2)
        cublas = time_per_call([lambda w=w: F.linear(x, w) for w in weights]) * 1e6
        ours = time_per_call([lambda w=w: linear(x, w) for w in weights]) * 1e6
        floor = n * k * 2 / copy_bw * 1e6
        out.append(dict(shape=shape, projection=name, rows=m, out_features=n, in_features=k, cublas_us=cublas,
                        tqops_us=ours, floor_us=floor, **{"tqops/cublas": ours / cublas, "tqops/floor": ours / floor}))
        del weights
    return out
