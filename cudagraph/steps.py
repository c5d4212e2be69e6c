"""Runners over step functions: static buffers and buckets for a step, the per-group block tables of a step, and the
runners kept on the module whose step they replay."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..graphs import KV_CACHE_GROUPS
from ..graphs.compile import ModelLocal, model_local
from .buffers import StepBuffers
from .runner import CudaGraphRunner


def default_buckets(max_batch: int) -> list[int]:
    """Powers of two below ``max_batch``, and ``max_batch`` itself: at most 2x padding, log2(B) graphs."""
    return sorted({min(2**i, max_batch) for i in range(max_batch.bit_length() + 1)})


def make_runner(step: Callable, *, q_len: int, max_batch: int, max_blocks: int, block_size: int, device,
                buckets: Optional[Sequence[int]] = None, context_dim: Optional[int] = None,
                context_dtype: torch.dtype = torch.float32, state_mode: Optional[str] = None,
                uniforms: bool = False) -> CudaGraphRunner:
    """A runner over fresh static buffers for ``step`` (not captured yet: call ``capture()`` once the caches exist)."""
    buffers = StepBuffers(q_len=q_len, max_batch=max_batch, max_blocks=max_blocks, block_size=block_size,
                          groups=KV_CACHE_GROUPS, device=device, context_dim=context_dim, context_dtype=context_dtype,
                          state_mode=state_mode, uniforms=uniforms)
    return CudaGraphRunner(step, buffers, buckets or default_buckets(max_batch))


def tables(table: torch.Tensor) -> dict:
    """The per-group block tables of a step: every group shares ``table`` ``[batch, max_blocks]``."""
    return {g: table for g in KV_CACHE_GROUPS}


def captured_graphs(owner) -> ModelLocal:
    """The runners kept on ``owner`` (the module whose step they replay; see ``kept_runner``): ``{"caches": the data
    pointers the graphs were captured against, key -> runner}``, empty before the first. Kept on the module, so they
    are freed with it (their steps reference it: a module-level weak-keyed map would keep the module alive through its
    own values), and a copy of the module starts with none. ``.clear()`` drops them and their graphs now, e.g. before
    ``destroy_process_group`` under tensor parallelism (NCCL cannot tear a group down while graphs that captured its
    collectives are alive, pytorch#115388)."""
    return model_local(owner, "_tqops_captured_steps")


def kept_runner(owner, key, caches: tuple, make: Callable[[], CudaGraphRunner]) -> CudaGraphRunner:
    """``owner``'s runner for ``key``, made by ``make`` unless kept, so a later call of the same key replays instead of
    capturing again. ``caches``: the data pointers of the memory the step reads and writes in place besides its
    buffers (KV caches, state pools); a captured graph points at them, so if they moved, every runner kept on
    ``owner`` goes."""
    kept = captured_graphs(owner)
    if kept.get("caches") != caches:
        kept.clear()
        kept["caches"] = caches
    if key not in kept:
        kept[key] = make()
    return kept[key]
