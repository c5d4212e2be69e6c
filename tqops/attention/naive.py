"""Pure-torch paged attention: the CPU implementation and the oracle for the Triton kernel."""
from __future__ import annotations

from typing import Optional

import torch

from ..formats import CacheFormat
from ..kv.naive import decode_slots
from ..quant import rotation_matrix

# Bound the float32 score matrix of one chunk of queries (elements), so q_len 4096 prefill fits anywhere.
_MAX_SCORE_ELEMS = 1 << 26


def visible_mask(
    q_pos: torch.Tensor, seq_len: int, causal: bool, sliding_window: Optional[int]
) -> torch.Tensor:
    """``[q, seq_len]`` bool: key j is visible from query position ``q_pos[i]``."""
    j = torch.arange(seq_len, device=q_pos.device)
    rel = q_pos[:, None] - j[None, :]  # pos - j
    mask = torch.ones_like(rel, dtype=torch.bool)
    if causal:
        mask &= rel >= 0
    if sliding_window is not None:
        mask &= rel < sliding_window
        if not causal:
            mask &= -rel < sliding_window
    return mask


def _tree_visible(bits: torch.Tensor, num_keys: int, first_node: int) -> torch.Tensor:
    """``[q, num_keys]`` bool: context keys (before ``first_node``) for every query, tree row t where bit t is set."""
    t = torch.arange(num_keys, device=bits.device) - first_node
    in_tree = t >= 0
    set_bit = ((bits[:, None] >> t.clamp(0, 63)[None, :]) & 1).bool()
    return ~in_tree[None, :] | set_bit


def paged_attention_naive(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    fmt: CacheFormat,
    causal: bool,
    sliding_window: Optional[int],
    sinks: Optional[torch.Tensor],
    scale: float,
    k_scale: float,
    v_scale: float,
    tree_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense masked float32 softmax per sequence over the dequantized cache; returns ``query``'s shape and dtype.

    query ``[num_tokens, num_q_heads, head_dim]``, kv_cache ``[num_blocks, block_size, num_kv_heads, slot_bytes]``,
    block_table ``[batch, max_blocks]``, seq_lens ``[batch]``, query_start_loc ``[batch + 1]``, sinks ``[num_q_heads]``.

    ``tree_mask`` ``[num_tokens]`` int64 (draft-tree verification; the reference only, the op does not take it yet):
    a sequence's queries are the nodes of a tree whose rows are its last ``q_len`` (<= 64) keys; every query sees
    the keys before them, and the tree row t only where bit t of its mask is set (its ancestors and itself:
    ``models.tree.tree_mask_bits``), instead of ``causal``'s rule; ``sliding_window`` still applies.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=query.device)
    q_all = query.float()
    if fmt.key_mode == "mse":
        # Score in the rotated space, as the kernel does: <R q, R k_hat> = <q, k_hat>.
        q_all = q_all @ rotation_matrix(head_dim, query.device)
    sink_logits = None if sinks is None else sinks.float().view(num_kv_heads, group, 1, 1)
    max_blocks = block_table.shape[1]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q0, q1 = max(0, starts[b]), min(num_tokens, starts[b + 1])
        q_len = starts[b + 1] - starts[b]
        # Keys past the block table, or in a block outside the cache, are dropped (never read), as in the kernel.
        num_keys = min(seq_len, max_blocks * block_size)
        if q1 <= q0 or num_keys <= 0:
            continue
        n_blk = -(-num_keys // block_size)
        table = block_table[b, :n_blk].long()
        key_ok = ((table >= 0) & (table < num_blocks)).repeat_interleave(block_size)[:num_keys]
        slots = kv_cache[table.clamp(0, num_blocks - 1)].flatten(0, 1)[:num_keys]  # [L, Hkv, slot_bytes]
        key, value = decode_slots(slots, fmt, head_dim, k_scale, v_scale, rotated_keys=True)
        value = torch.where(key_ok[:, None, None], value, 0.0)
        key, value = key.transpose(0, 1), value.transpose(0, 1)  # [Hkv, L, d]
        chunk = max(1, _MAX_SCORE_ELEMS // (num_q_heads * num_keys))
        for c0 in range(q0, q1, chunk):
            c1 = min(q1, c0 + chunk)
            q = q_all[c0:c1].view(c1 - c0, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, g, q, d]
            s = torch.einsum("hgqd,hkd->hgqk", q, key) * scale
            q_pos = torch.arange(c0, c1, device=query.device) - starts[b] + seq_len - q_len
            mask = visible_mask(q_pos, num_keys, causal and tree_mask is None, sliding_window) & key_ok
            if tree_mask is not None:
                mask &= _tree_visible(tree_mask[c0:c1], num_keys, seq_len - q_len)
            s = s.masked_fill(~mask, float("-inf"))
            m = s.amax(-1, keepdim=True)
            if sink_logits is not None:
                m = torch.maximum(m, sink_logits)
            # Rows that see nothing (and no sink) have max -inf: shift by 0 so they come out 0. A NaN max stays NaN,
            # so a NaN that a row attends to makes the row NaN, as in the kernel.
            m = m.masked_fill(m == float("-inf"), 0.0)
            p = torch.exp(s - m)
            denom = p.sum(-1, keepdim=True)
            if sink_logits is not None:
                denom = denom + torch.exp(sink_logits - m)
            o = torch.einsum("hgqk,hkd->hgqd", p, value) / denom.clamp_min(1e-30)
            out[c0:c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, num_q_heads, head_dim)
    return out.to(query.dtype)
