"""Torch references of the Gated DeltaNet ops: per-sequence loops in fp32, transformers' Qwen3.5 arithmetic."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x * x) + eps)`` over the last dim, as transformers' (and FLA's) ``l2norm``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, query_start_loc: torch.Tensor, scale: Optional[float] = None,
                           use_qk_l2norm: bool = True):
    """q, k ``[n, Hk, dk]``, v ``[n, Hv, dv]``, g, beta ``[n, Hv]`` fp32, state ``[batch, Hv, dk, dv]`` fp32 ->
    (o ``[n, Hv, dv]`` in v's dtype, final state ``[batch, Hv, dk, dv]`` fp32). One token at a time, each step
    written as ``torch_recurrent_gated_delta_rule`` writes it; rows that no sequence covers are 0."""
    n, hv, dv = v.shape
    dtype = v.dtype
    q, k = (x.float().repeat_interleave(hv // x.shape[1], dim=1) for x in (q, k))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    # transformers divides by sqrt(dk); a given scale multiplies, as FLA's kernels do.
    q = q / (q.shape[-1] ** 0.5) if scale is None else q * scale
    v = v.float()
    o = torch.zeros(n, hv, dv, device=v.device)
    final = state.clone(memory_format=torch.contiguous_format)
    bounds = query_start_loc.tolist()
    for b in range(len(bounds) - 1):
        s = state[b:b + 1].float()  # [1, Hv, dk, dv]: the batch dim kept, as in transformers
        for t in range(bounds[b], bounds[b + 1]):
            q_t, k_t, v_t = q[t:t + 1], k[t:t + 1], v[t:t + 1]
            s = s * g[t:t + 1].exp()[..., None, None]
            kv_mem = (s * k_t.unsqueeze(-1)).sum(dim=-2)
            delta = (v_t - kv_mem) * beta[t:t + 1].unsqueeze(-1)
            s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
            o[t] = (s * q_t.unsqueeze(-1)).sum(dim=-2)[0]
        final[b] = s[0]
    return o.to(dtype), final


def causal_conv1d_naive(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                        query_start_loc: torch.Tensor, activation: Optional[str] = "silu"):
    """x ``[n, C]``, weight ``[C, W]``, conv_state ``[batch, C, W - 1]`` -> (y ``[n, C]`` in x's dtype, the new conv
    state ``[batch, C, W - 1]``). Per sequence, ``F.conv1d`` over ``cat(conv_state[b], x_b)`` in fp32 (the arithmetic
    of transformers' ``causal_conv1d_update``); rows that no sequence covers are 0."""
    n, c = x.shape
    w1 = weight.shape[1] - 1
    y = torch.zeros(n, c, dtype=x.dtype, device=x.device)
    new_state = conv_state.clone(memory_format=torch.contiguous_format)
    bounds = query_start_loc.tolist()
    for b in range(len(bounds) - 1):
        lo, hi = bounds[b], bounds[b + 1]
        seq = torch.cat((conv_state[b], x[lo:hi].t()), dim=1)  # [C, W - 1 + L]
        new_state[b] = seq[:, seq.shape[1] - w1:]
        if hi > lo:
            out = F.conv1d(seq[None].float(), weight.float()[:, None], groups=c)[0]  # [C, L]
            y[lo:hi] = (F.silu(out) if activation == "silu" else out).t().to(x.dtype)
    return y, new_state


def keep_mask_naive(query_start_loc: torch.Tensor, keep: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[num_tokens]`` bool: token i of sequence b is kept iff its offset in b is below ``keep[b]``."""
    mask = torch.zeros(num_tokens, dtype=torch.bool, device=keep.device)
    bounds = query_start_loc.tolist()
    for b, kept in enumerate(keep.tolist()):
        lo, hi = bounds[b], bounds[b + 1]
        mask[lo:min(hi, lo + max(kept, 0))] = True
    return mask


def conv_state_after_naive(x: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                           keep: torch.Tensor) -> torch.Tensor:
    """The conv state ``[batch, C, W - 1]`` after only the first ``keep[b]`` tokens of each sequence."""
    w1 = conv_state.shape[2]
    out = conv_state.clone(memory_format=torch.contiguous_format)
    bounds = query_start_loc.tolist()
    for b, kept in enumerate(keep.tolist()):
        lo, hi = bounds[b], bounds[b + 1]
        seq = torch.cat((conv_state[b], x[lo:min(hi, lo + max(kept, 0))].t()), dim=1)
        out[b] = seq[:, seq.shape[1] - w1:]
    return out
