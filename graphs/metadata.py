"""Per-KV-group attention metadata, built on the device without host syncs, in reusable buffers."""
from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

import torch

from tqops.attention.ops import check_attention_values
from tqops.checks import INDEX_DTYPES, check_slot_values, check_tensor, in_graph_region


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
    # The last (cache geometry, tensor versions) that check_metadata passed, so a step checks once, not per layer.
    _checked: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)
    # The same for check_context_slots (DFlash context rows against the block table).
    _context_checked: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass
class StateMetadata:
    """What a step's linear-attention layers read from the forward context.

    state_indices:   ``[batch]`` int: each sequence's row in every layer's state pools; negative (a padded sequence
                     of a CUDA-graph bucket) uses the pools' spare last row, which no real sequence owns.
    query_start_loc: ``[batch + 1]``: sequence b's tokens are rows ``[query_start_loc[b], query_start_loc[b + 1])``.
    pending_lens:    ``[batch]`` int or None: how many tokens of each row's stashed block (the last verify block) were
                     accepted; they are committed to the state before this step's tokens run. None: nothing pending.
    stash:           this step is a verify block of ``stash_len`` tokens per sequence: its tokens run from the
                     committed state, which they leave unchanged, and are stashed for the next step to commit.
    """

    state_indices: torch.Tensor
    query_start_loc: torch.Tensor
    pending_lens: Optional[torch.Tensor] = None
    stash: bool = False


def slots_for_positions(
    positions: torch.Tensor, seq_index: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Cache slots ``[n]`` of logical ``positions`` ``[n]`` of sequences ``seq_index`` ``[n]``.

    -1 (not stored) where the position or sequence is negative, the position lies past the block table, or its
    block-table entry is negative: a bad table never redirects a token into another token's slot.
    """
    max_blocks = block_table.shape[1]
    logical = positions.long().clamp_min(0) // block_size
    valid = (positions >= 0) & (seq_index >= 0) & (logical < max_blocks)
    seq = seq_index.clamp(0, block_table.shape[0] - 1).long()
    block = block_table.long()[seq, logical.clamp_max(max_blocks - 1)]
    valid &= block >= 0
    return torch.where(valid, block * block_size + positions.long() % block_size, -1)


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence ``[num_tokens]``, position ``[num_tokens]``) of each packed token: token i of a sequence with q_len
    queries sits at ``seq_len - q_len + i``; tokens past ``query_start_loc[-1]`` are padding, -1 in both. No host
    sync."""
    batch = seq_lens.shape[0]
    token = torch.arange(num_tokens, device=seq_lens.device, dtype=query_start_loc.dtype)
    seq = torch.searchsorted(query_start_loc[1:], token, right=True)
    real = seq < batch
    seq_c = seq.clamp_max(max(batch - 1, 0))
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    positions = seq_lens[seq_c] - q_lens[seq_c] + (token - query_start_loc[seq_c])
    return torch.where(real, seq, -1), torch.where(real, positions, -1)


def _versions(*tensors) -> tuple:
    try:
        return tuple((id(t), t._version) for t in tensors if t is not None)
    except RuntimeError:  # inference-mode tensors keep no version counter: check every time
        return (object(),)


def _meta_versions(meta: AttentionMetadata) -> tuple:
    return _versions(meta.block_table, meta.seq_lens, meta.query_start_loc, meta.slot_mapping,
                     meta.context_slot_mapping)


def check_metadata(meta: AttentionMetadata, num_blocks: int, block_size: int, device: torch.device,
                   where: str) -> None:
    """Eager-only: raise (naming ``where``) before any write if ``meta`` would store or read outside the
    sequences' own cache blocks. Skipped while compiling or capturing (it syncs the host); then the ops skip
    out-of-range slots and blocks instead. Each step's metadata is checked once per cache geometry."""
    if in_graph_region():
        return
    memo = (num_blocks, block_size) + _meta_versions(meta)
    if meta._checked == memo:
        return
    try:
        _check_metadata(meta, num_blocks, block_size, device)
    except (TypeError, ValueError, IndexError) as e:
        raise type(e)(f"{where}: {e}") from None
    meta._checked = memo


def check_context_slots(meta: AttentionMetadata, context_positions: Optional[torch.Tensor], block_size: int,
                        device: torch.device, where: str) -> None:
    """Eager-only, after ``check_metadata``: each stored DFlash context row's ``context_slot_mapping`` entry is the
    block table's slot for its ``context_positions`` entry in its token's sequence. Memoized apart from
    ``check_metadata``, so a drafter layer's context store and token store each check once per step."""
    if in_graph_region() or meta.context_slot_mapping is None or context_positions is None:
        return
    memo = (block_size,) + _meta_versions(meta) + _versions(context_positions)
    if meta._context_checked == memo:
        return
    try:
        _check_context_slots(meta, context_positions, block_size, device)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None
    meta._context_checked = memo


def _check_context_slots(meta: AttentionMetadata, context_positions: torch.Tensor, block_size: int,
                         device: torch.device) -> None:
    check_tensor("context_positions", context_positions, dtypes=INDEX_DTYPES, ndim=1, device=device)
    context, num_tokens = meta.context_slot_mapping.long(), meta.slot_mapping.shape[0]
    if context_positions.shape[0] != context.shape[0] or context.shape[0] != num_tokens:
        raise ValueError(f"context_slot_mapping has {context.shape[0]} entries and context_positions "
                         f"{context_positions.shape[0]}; expected one per token ({num_tokens})")
    # context row i belongs to token i's sequence
    seq, _ = token_positions(meta.query_start_loc.long(), meta.seq_lens.long(), num_tokens)
    expected = slots_for_positions(context_positions, seq, meta.block_table, block_size)
    wrong = (context >= 0) & (context != expected)
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0, 0])
        raise ValueError(f"context_slot_mapping[{i}] = {int(context[i])}, but context row {i} (sequence "
                         f"{int(seq[i])}, position {int(context_positions[i])}) belongs in slot {int(expected[i])} "
                         "per block_table; expected the block table's slot or -1")


def _check_metadata(meta: AttentionMetadata, num_blocks: int, block_size: int, device: torch.device) -> None:
    for name in ("block_table", "seq_lens", "query_start_loc", "slot_mapping", "context_slot_mapping"):
        t = getattr(meta, name)
        if t is not None or name != "context_slot_mapping":
            check_tensor(name, t, dtypes=INDEX_DTYPES, ndim=2 if name == "block_table" else 1, device=device)
    batch, num_tokens = meta.seq_lens.shape[0], meta.slot_mapping.shape[0]
    if meta.block_table.shape[0] != batch or meta.query_start_loc.shape[0] != batch + 1:
        raise ValueError(f"block_table has {meta.block_table.shape[0]} rows and query_start_loc "
                         f"{meta.query_start_loc.shape[0]} entries; expected batch = len(seq_lens) = {batch} and "
                         f"batch + 1")
    check_attention_values(meta.block_table, meta.seq_lens, meta.query_start_loc, num_tokens, num_blocks, block_size,
                           padded=True)
    num_slots = num_blocks * block_size
    check_slot_values("slot_mapping", meta.slot_mapping, num_slots)
    if meta.context_slot_mapping is not None:
        check_slot_values("context_slot_mapping", meta.context_slot_mapping, num_slots)
    # Each stored token's slot must be the one the block table gives its position, so attention reads it back
    # and no other sequence's key is overwritten; padding tokens must not store.
    seq, positions = token_positions(meta.query_start_loc.long(), meta.seq_lens.long(), num_tokens)
    expected = slots_for_positions(positions, seq, meta.block_table, block_size)
    stored = meta.slot_mapping.long() >= 0
    wrong = stored & (meta.slot_mapping.long() != expected)
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0, 0])
        got = int(meta.slot_mapping[i])
        if int(seq[i]) < 0:
            raise ValueError(f"slot_mapping[{i}] = {got}, but token {i} is padding (past query_start_loc[-1] = "
                             f"{int(meta.query_start_loc[-1])}); expected -1")
        raise ValueError(f"slot_mapping[{i}] = {got}, but token {i} (sequence {int(seq[i])}, position "
                         f"{int(positions[i])}) belongs in slot {int(expected[i])} per block_table; expected the "
                         "block table's slot or -1")


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
    for arg, value, low in (("block_size", block_size, 1), ("num_tokens", num_tokens, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"build_metadata: {arg} must be an int >= {low}, got {value!r}")
    device = seq_lens.device
    query_lens, seq_lens = query_lens.to(device=device, dtype=torch.int32), seq_lens.to(torch.int32)
    start_loc = torch.zeros(query_lens.shape[0] + 1, dtype=torch.int32, device=device)
    start_loc[1:] = torch.cumsum(query_lens, 0)
    seq_index, positions = token_positions(start_loc, seq_lens, num_tokens)
    slots = slots_for_positions(positions, seq_index, block_table, block_size)
    meta = AttentionMetadata(block_table.to(torch.int32), seq_lens, start_loc, slots)
    if out is None:
        return meta
    out.block_table.copy_(meta.block_table)
    out.seq_lens.copy_(meta.seq_lens)
    out.query_start_loc.copy_(meta.query_start_loc)
    out.slot_mapping.copy_(meta.slot_mapping)
    return out
