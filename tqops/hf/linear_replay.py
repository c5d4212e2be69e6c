"""Rollback of a transformers Gated DeltaNet layer: its step's inputs recorded by hooks, the kept tokens replayed."""
from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch
from torch import nn

from ..graphs import run_block

# The parts of transformers' Qwen3_5GatedDeltaNet (Qwen3.5, Qwen3.5-MoE) a replay reads.
GATED_DELTANET_PARTS = ("in_proj_qkv", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias", "num_k_heads",
                        "head_k_dim", "layer_idx")


class StepInputs(NamedTuple):
    """What one Gated DeltaNet layer was given in a step: the module and its input ``[batch, tokens, hidden]`` (padding
    rows already zeroed, as the module zeroes them)."""

    module: nn.Module
    hidden: torch.Tensor


def gated_deltanet_modules(model: nn.Module, layer_ids) -> dict[int, nn.Module]:
    """``{layer index: Gated DeltaNet module}`` of ``model`` for ``layer_ids``; a ValueError names a layer whose module
    is not transformers' Qwen3.5 Gated DeltaNet (another linear attention has other parts)."""
    found = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if idx in layer_ids and hasattr(module, "in_proj_qkv") and hasattr(module, "A_log"):
            found[idx] = module
    missing = sorted(set(layer_ids) - set(found))
    if missing:
        raise ValueError(f"layers {missing} of {type(model).__name__} have no Gated DeltaNet module with "
                         f"{GATED_DELTANET_PARTS}; PagedKVCache rolls back transformers' Qwen3.5 Gated DeltaNet only")
    return found


@contextlib.contextmanager
def recording(model: nn.Module, layers: dict) -> Iterator[None]:
    """Inside the block, each forward of a Gated DeltaNet module of ``model`` hands its input to its cache layer
    (``layers``: layer index -> ``LinearAttentionCacheLayer``), which keeps the last committed step's inputs and the
    states before it, so that ``PagedKVCache.rollback_rows`` and ``crop`` can take back part of that step."""
    modules = gated_deltanet_modules(model, set(layers))
    handles = []
    for idx, module in modules.items():
        def hook(mod, args, kwargs, layer=layers[idx]):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            if mask is not None and mask.dim() == 2:  # transformers zeroes padding tokens' inputs the same way
                hidden = (hidden * mask[:, -hidden.shape[1]:, None]).to(hidden.dtype)
            layer.record(StepInputs(mod, hidden.detach()))
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        for layer in layers.values():
            layer.recording = True
        yield
    finally:
        for h in handles:
            h.remove()
        for layer in layers.values():
            layer.recording = False


@torch.no_grad()
def replay(inputs: StepInputs, conv_before: torch.Tensor, recurrent_before: torch.Tensor,
           keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The states after only the first ``keep[b]`` tokens of row b of the recorded step, from the states before it:
    conv ``[batch, C, W]`` (transformers' layout: the last W inputs) and recurrent ``[batch, Hv, dk, dv]``."""
    m, hidden = inputs.module, inputs.hidden
    batch, tokens, _ = hidden.shape
    mixed, a, b = m.in_proj_qkv(hidden), m.in_proj_a(hidden), m.in_proj_b(hidden)  # [batch, tokens, *]
    weight = m.conv1d.weight.squeeze(1)  # [C, W]
    width = weight.shape[1]
    qsl = torch.arange(batch + 1, device=hidden.device, dtype=torch.int32) * tokens
    keep = keep.to(hidden.device).long()
    rows = torch.arange(batch, device=hidden.device)
    recurrent = recurrent_before.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    run_block(mixed.flatten(0, 1), a.flatten(0, 1), b.flatten(0, 1), weight, m.A_log, m.dt_bias,
              conv_before[..., 1:].contiguous(), recurrent, rows, qsl, m.num_k_heads, m.head_k_dim, keep=keep,
              output=False)  # the conv pool is a copy: only the recurrent states are kept
    # transformers keeps the last W inputs: row b's are columns [keep, keep + W) of (state before, step's inputs).
    timeline = torch.cat([conv_before, mixed.transpose(1, 2).to(conv_before.dtype)], dim=-1)  # [batch, C, W + T]
    columns = keep[:, None] + torch.arange(width, device=hidden.device)
    conv = timeline.gather(2, columns[:, None, :].expand(-1, timeline.shape[1], -1))
    return conv, recurrent
