"""Captured speculative-decoding steps: target decode/verify and the whole DFlash drafter step, per batch bucket."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .buffers import StepBuffers
from .runner import CudaGraphRunner

GROUPS = (0, 1)  # full-attention and sliding-window KV-cache groups; both read the same block table


def default_buckets(max_batch: int) -> list[int]:
    """Powers of two below ``max_batch``, and ``max_batch`` itself: at most 2x padding, log2(B) graphs."""
    return sorted({min(2**i, max_batch) for i in range(max_batch.bit_length() + 1)})


def target_step(target, layer_ids: Optional[tuple] = None) -> Callable:
    """``(input_ids [n], positions [n]) -> (logits [n, V] float32, aux [n, C] or None)``: one target forward + head."""

    def step(input_ids, positions):
        out = target(input_ids, positions, layer_ids=layer_ids)
        hidden, aux = out if layer_ids is not None else (out, None)
        return target.compute_logits(hidden).float(), aux

    return step


def drafter_step(drafter) -> Callable:
    """``(input_ids [n * bs], positions [n * bs]) -> draft logits [n, bs - 1, V] float32``.

    The whole DFlash step: context-state injection and context K/V store (inside ``drafter.forward``), the
    non-causal block pass, and the shared lm_head over the mask positions.
    """
    bs = drafter.block_size

    def step(input_ids, positions):
        hidden = drafter(input_ids, positions)
        torch._check(hidden.shape[0] % bs == 0)  # the token dim may be unbacked under compile
        return drafter.compute_logits(hidden.unflatten(0, (-1, bs))[:, 1:]).float()

    return step


def make_runner(step: Callable, *, q_len: int, max_batch: int, max_blocks: int, block_size: int, device,
                buckets: Optional[Sequence[int]] = None, context_dim: Optional[int] = None,
                context_dtype: torch.dtype = torch.float32) -> CudaGraphRunner:
    """A runner over fresh static buffers for ``step`` (not captured yet: call ``capture()`` once the caches exist)."""
    buffers = StepBuffers(q_len=q_len, max_batch=max_batch, max_blocks=max_blocks, block_size=block_size,
                          groups=GROUPS, device=device, context_dim=context_dim, context_dtype=context_dtype)
    return CudaGraphRunner(step, buffers, buckets or default_buckets(max_batch))


def tables(table: torch.Tensor) -> dict:
    """The per-group block tables of a step: every group shares ``table`` ``[batch, max_blocks]``."""
    return {g: table for g in GROUPS}
