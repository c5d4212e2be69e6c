"""DFlash context-state injection: hands this step's target hidden states to the drafter inside its graph."""
from __future__ import annotations

import torch

from .context import get_forward_context


@torch.library.custom_op("tqops::dflash_context_states", mutates_args=())
def dflash_context_states(like: torch.Tensor, context_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``[like.shape[0], context_dim]`` in ``dtype``: the forward context's context states, one row per query token.

    ``like`` is any tensor whose first dim is the step's token count (the drafter passes ``input_ids``), so the
    output shape is symbolic in the graph's own input and the drafter keeps ``forward(input_ids, positions)``.
    """
    ctx = get_forward_context()
    states = ctx.context_states
    num_tokens = like.shape[0]
    if states is None:
        raise RuntimeError("the drafter asked for DFlash context states, but the forward context has none")
    if states.dim() != 2 or states.shape[1] != context_dim or states.shape[0] < num_tokens:
        raise ValueError(
            f"forward context's context_states has shape {tuple(states.shape)}; expected at least "
            f"[{num_tokens}, {context_dim}] (one row per query token)"
        )
    if states.device != like.device:
        raise ValueError(f"context_states is on {states.device}, the drafter runs on {like.device}")
    # A fresh tensor: custom-op outputs may not alias memory the compiler cannot see.
    return states[:num_tokens].to(dtype=dtype, copy=True)


@dflash_context_states.register_fake
def _(like, context_dim, dtype):
    return like.new_empty((like.shape[0], context_dim), dtype=dtype)


def context_states(like: torch.Tensor, context_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The injected context states ``[num_tokens, context_dim]`` in the drafter's ``dtype``."""
    return torch.ops.tqops.dflash_context_states(like, context_dim, dtype)


@torch.library.custom_op("tqops::dflash_context_positions", mutates_args=())
def dflash_context_positions(like: torch.Tensor) -> torch.Tensor:
    """``[like.shape[0]]`` int64: the forward context's positions of this step's context rows (for RoPE)."""
    positions = get_forward_context().context_positions
    num_tokens = like.shape[0]
    if positions is None:
        raise RuntimeError("the drafter asked for DFlash context positions, but the forward context has none")
    if positions.dim() != 1 or positions.shape[0] < num_tokens:
        raise ValueError(f"forward context's context_positions has shape {tuple(positions.shape)}; expected at "
                         f"least [{num_tokens}] (one per query token)")
    return positions[:num_tokens].to(dtype=torch.int64, copy=True)


@dflash_context_positions.register_fake
def _(like):
    return like.new_empty((like.shape[0],), dtype=torch.int64)


def context_positions(like: torch.Tensor) -> torch.Tensor:
    """The injected context rows' positions ``[num_tokens]`` (int64)."""
    return torch.ops.tqops.dflash_context_positions(like)
