"""The forward context: per-step metadata that the attention ops read by KV-cache group."""
from __future__ import annotations

import contextlib
import contextvars
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

    Each field's type is checked here (a ``TypeError`` naming it); the tensors' values are checked by the ops.
    """

    attn_metadata: dict[int, AttentionMetadata]
    context_states: Optional[torch.Tensor] = None
    context_positions: Optional[torch.Tensor] = None
    state_metadata: Optional[StateMetadata] = None

    def __post_init__(self):
        if not isinstance(self.attn_metadata, dict):
            raise TypeError(f"ForwardContext: attn_metadata must be a dict of KV-cache group id -> AttentionMetadata, "
                            f"got {type(self.attn_metadata).__name__}")
        for group, meta in self.attn_metadata.items():
            if isinstance(group, bool) or not isinstance(group, int):
                raise TypeError(f"ForwardContext: attn_metadata has key {group!r}; expected int KV-cache group ids")
            if not isinstance(meta, AttentionMetadata):
                raise TypeError(f"ForwardContext: attn_metadata[{group}] must be an AttentionMetadata, got "
                                f"{type(meta).__name__}")
        for name in ("context_states", "context_positions"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"ForwardContext: {name} must be a torch.Tensor or None, got {type(value).__name__}")
        if self.state_metadata is not None and not isinstance(self.state_metadata, StateMetadata):
            raise TypeError(f"ForwardContext: state_metadata must be a StateMetadata or None, got "
                            f"{type(self.state_metadata).__name__}")


class _Entry:
    """One ``set_forward_context`` block's place in the stack (its own object, so the same context entered twice is
    two entries)."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: ForwardContext):
        self.ctx = ctx


# The contexts set in this thread or asyncio task, innermost last: an immutable tuple in a ContextVar, so every thread
# (which starts with none) and every asyncio task (which starts with a copy of its creator's) has its own stack.
_STACK: contextvars.ContextVar[tuple[_Entry, ...]] = contextvars.ContextVar("tqops_forward_context", default=())


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` the context for the ops run inside the ``with`` block, in this thread or asyncio task only.

    Blocks nest: on exit the context current before the block is current again. A block exited while a block entered
    inside it is still open (possible with generators or ``ExitStack``) removes only its own context, so the inner
    block's context stays current and this one is never current again, and raises ``RuntimeError`` saying so; the
    inner block's exit then restores what was current before both."""
    if not isinstance(ctx, ForwardContext):
        raise TypeError(f"set_forward_context expects a ForwardContext, got {type(ctx).__name__}")
    entry = _Entry(ctx)
    _STACK.set(_STACK.get() + (entry,))
    try:
        yield ctx
    finally:
        stack = _STACK.get()
        if stack and stack[-1] is entry:
            _STACK.set(stack[:-1])
        else:
            if entry not in stack:
                raise RuntimeError("a set_forward_context block exited in another thread or asyncio task than the one "
                                   "that entered it; enter and exit each block in one thread or task")
            _STACK.set(tuple(e for e in stack if e is not entry))
            raise RuntimeError("a set_forward_context block exited while a block entered inside it was still open; "
                               "its context is no longer current, the inner block's still is: exit the inner block "
                               "first")


def _current() -> Optional[ForwardContext]:
    """The innermost context of this thread or task: what every op reads at run time (the one accessor)."""
    stack = _STACK.get()
    return stack[-1].ctx if stack else None


def get_forward_context() -> ForwardContext:
    ctx = _current()
    if ctx is None:
        raise RuntimeError("no forward context is set: run the model inside `with set_forward_context(ctx):` (in the "
                           "thread or asyncio task that runs it)")
    return ctx


def group_metadata(layer_name: str, group: int) -> AttentionMetadata:
    """The metadata of ``group``, with an error naming the layer when it is missing."""
    ctx = _current()
    if ctx is None:
        raise RuntimeError(
            f"attention layer {layer_name!r} (KV-cache group {group}) ran outside a forward context; "
            "wrap the step in `with tqops.graphs.set_forward_context(ctx):` (in the thread or asyncio task that runs "
            "it)"
        )
    meta = ctx.attn_metadata.get(group)
    if meta is None:
        have = sorted(ctx.attn_metadata)
        raise KeyError(
            f"attention layer {layer_name!r} needs metadata for KV-cache group {group}, "
            f"but the forward context only has groups {have}"
        )
    return meta
