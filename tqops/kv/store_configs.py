"""Launch configurations of the Triton kv_store kernel to compare when tuning its default_config."""
from __future__ import annotations

import torch

from ..formats import get_format
from .triton_store import default_config


def candidate_configs(fmt, head_dim: int = 128, dtype=torch.bfloat16) -> dict:
    """Named launch parameters to compare when tuning default_config (the GPU tests check each one).

    rNwM: the general kernel, N tokens per program at head_dim 128 (scaled to keep the tile size at other
    head_dims), M warps.
    """
    fmt = get_format(fmt)
    base = default_config(fmt, head_dim, dtype)
    out = {"default": base}
    general = dict(base, rows=False, c2_counts=False, maxnreg=None)
    for r, w in ((16, 4), (32, 4), (32, 8), (64, 8), (64, 16)):
        out[f"r{r}w{w}"] = dict(general, block_r=r * 128 // head_dim, num_warps=w)
    out["persist2"] = dict(base, programs_per_sm=2)
    if fmt.key_mode == "mse":
        # rows_rNwM: the row-per-thread kernel, N rows per program, M warps (32 * M / N threads per row), with
        # uncapped registers and one program per row block.
        for r, w in ((2, 1), (4, 1), (8, 1), (16, 2), (32, 1)):
            for counts in (False, True):
                out[f"rows_r{r}w{w}" + ("_counts" if counts else "")] = dict(
                    base, rows=True, block_r=r * 128 // head_dim, num_warps=w, c2_counts=counts, maxnreg=None,
                    programs_per_sm=0)
        out["rows_maxnreg80"] = dict(base, rows=True, maxnreg=80)
        out["rows_grid56"] = dict(base, rows=True, programs_per_sm=56)
        out["rows_flip_counts"] = dict(base, rows=True, c2_counts=not base.get("c2_counts", False))
    return out
