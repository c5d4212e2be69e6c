"""The forward context: per-step metadata that the attention ops read by KV-cache group."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import torch

from .metadata import AttentionMetadata, StateMetadata

# KV-cache groups: layers of one group share a step's metadata. Full-attention layers use group 0, sliding-window
# layers group 1; the models in tqops give both groups the same block table.
FULL_ATTENTION_GROUP, SLIDING_WINDOW_GROUP = 0, 1
KV_CACHE_GROUPS = (FULL_ATTENTION_GROUP, SLIDING_WINDOW_GROUP)


@dataclasses.dataclass
class ForwardContext:
    """What one model step's ops read besides their tensor arguments.

    attn_metadata:  KV-cache group id -> that group's AttentionMetadata.
    context_states: DFlash only, ``[num_tokens, context_dim]``: the target hidden states that become this step's
                    drafter context rows (row i pairs with query token i; rejected/padded rows have slot -1
                    in the group's ``context_slot_mapping``).
    context_positions: DFlash only, ``[num_tokens]`` int64: the sequence position of each context row (for RoPE).
    state_metadata: models with linear-attention layers only: each sequence's state row and what to commit first.
    """

    attn_metadata: dict[int, AttentionMetadata]
    context_states: Optional[torch.Tensor] = None
    context_positions: Optional[torch.Tensor] = None
    state_metadata: Optional[StateMetadata] = None


_CURRENT: list[ForwardContext] = []


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` the context for the ops run inside the ``with`` block (nests; restores on exit)."""
    if not isinstance(ctx, ForwardContext):
        raise TypeError(f"set_forward_context expects a ForwardContext, got {type(ctx).__name__}")
    _CURRENT.append(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.pop()


def get_forward_context() -> ForwardContext:
    if not _CURRENT:
        raise RuntimeError("no forward context is set: run the model inside `with set_forward_context(ctx):`")
    return _CURRENT[-1]


def group_metadata(layer_name: str, group: int) -> AttentionMetadata:
    """The metadata of ``group``, with an error naming the layer when it is missing."""
    if not _CURRENT:
        raise RuntimeError(
            f"attention layer {layer_name!r} (KV-cache group {group}) ran outside a forward context; "
            "wrap the step in `with tqops.graphs.set_forward_context(ctx):`"
        )
    meta = _CURRENT[-1].attn_metadata.get(group)
    if meta is None:
        have = sorted(_CURRENT[-1].attn_metadata)
        raise KeyError(
            f"attention layer {layer_name!r} needs metadata for KV-cache group {group}, "
            f"but the forward context only has groups {have}"
        )
    return meta
