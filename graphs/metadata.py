"""Per-KV-group attention metadata, built on the device without host syncs, in reusable buffers."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass
class AttentionMetadata:
    """One KV-cache group's view of a step (all int32 unless noted, all on the model's device).

    block_table:          ``[batch, max_blocks]`` physical block of each logical block of each sequence.
    seq_lens:             ``[batch]`` keys in the cache per sequence, this step's tokens included.
    query_start_loc:      ``[batch + 1]`` where each sequence's query tokens start in the packed batch.
    slot_mapping:         ``[num_tokens]`` int64 cache slot of each query token's K/V (-1: padding, not stored).
    context_slot_mapping: ``[num_tokens]`` int64, DFlash drafter only: slot of each injected context row (-1: skip).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    context_slot_mapping: Optional[torch.Tensor] = None


def slots_for_positions(
    positions: torch.Tensor, seq_index: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Cache slots ``[n]`` of logical ``positions`` ``[n]`` of sequences ``seq_index`` ``[n]`` (-1 where either is < 0)."""
    valid = (positions >= 0) & (seq_index >= 0)
    pos = positions.clamp_min(0).long()
    seq = seq_index.clamp(0, block_table.shape[0] - 1).long()
    logical = (pos // block_size).clamp_max(block_table.shape[1] - 1)
    block = block_table.long()[seq, logical]
    return torch.where(valid, block * block_size + pos % block_size, -1)


def build_metadata(
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_tokens: int,
    out: Optional[AttentionMetadata] = None,
) -> AttentionMetadata:
    """Metadata for a batch whose sequence b has ``query_lens[b]`` new tokens and ``seq_lens[b]`` keys after them.

    ``num_tokens`` (a Python int, >= sum(query_lens)) is the packed token count; tokens past the real ones are
    padding and get slot -1. No host sync: everything is tensor arithmetic on the inputs' device. With ``out``,
    results are written into its buffers in place (what a CUDA-graph runner refills before each replay).
    """
    device = seq_lens.device
    query_lens, seq_lens = query_lens.to(device=device, dtype=torch.int32), seq_lens.to(torch.int32)
    start_loc = torch.zeros(query_lens.shape[0] + 1, dtype=torch.int32, device=device)
    start_loc[1:] = torch.cumsum(query_lens, 0)
    token = torch.arange(num_tokens, device=device, dtype=torch.int32)
    seq_index = torch.searchsorted(start_loc[1:], token, right=True).to(torch.int32)
    real = seq_index < query_lens.shape[0]
    seq_c = seq_index.clamp_max(max(query_lens.shape[0] - 1, 0)).long()
    positions = seq_lens[seq_c] - query_lens[seq_c] + (token - start_loc[seq_c])
    slots = slots_for_positions(torch.where(real, positions, -1), torch.where(real, seq_index, -1), block_table,
                                block_size)
    meta = AttentionMetadata(block_table.to(torch.int32), seq_lens, start_loc, slots)
    if out is None:
        return meta
    out.block_table.copy_(meta.block_table)
    out.seq_lens.copy_(meta.seq_lens)
    out.query_start_loc.copy_(meta.query_start_loc)
    out.slot_mapping.copy_(meta.slot_mapping)
    return out
