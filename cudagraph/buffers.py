"""Static step buffers: padded to a batch bucket and refilled in place before each replay."""
from __future__ import annotations

import bisect
from typing import Optional, Sequence

import torch

from ..graphs import AttentionMetadata, ForwardContext, StateMetadata, slots_for_positions


def pick_bucket(buckets: Sequence[int], batch: int) -> Optional[int]:
    """Smallest bucket >= batch, or None when the batch is larger than every bucket (run eagerly)."""
    i = bisect.bisect_left(sorted(buckets), batch)
    return sorted(buckets)[i] if i < len(buckets) else None


class StepBuffers:
    """Persistent inputs of a step with ``q_len`` query tokens per sequence, for up to ``max_batch`` sequences.

    Padded sequences get seq_len 0 (they see no key, so attention returns zeros) and their tokens slot -1 (never
    stored). query_start_loc is ``arange(bucket + 1) * q_len`` and never changes, so each bucket's views are fixed.

    ``state_mode`` (models with linear-attention layers): "commit" steps write their sequences' states, "stash" steps
    (verify blocks) stash their tokens and commit the previous block's accepted ``pending_lens`` first; both carry
    each sequence's ``state_indices`` (padded sequences -1: the state pools' spare row).

    ``uniforms`` (a step that samples inside the graph: a DFlash2 drafter at temperature > 0): one float32 uniform
    per token, refilled each call and given to the step as its third argument.
    """

    def __init__(self, *, q_len: int, max_batch: int, max_blocks: int, block_size: int, groups: Sequence[int],
                 device, context_dim: Optional[int] = None, context_dtype: torch.dtype = torch.float32,
                 state_mode: Optional[str] = None, uniforms: bool = False):
        if state_mode not in (None, "commit", "stash"):
            raise ValueError(f"state_mode must be None, 'commit' or 'stash', got {state_mode!r}")
        self.q_len, self.max_batch, self.block_size, self.groups = q_len, max_batch, block_size, tuple(groups)
        tokens = max_batch * q_len
        z = dict(device=device)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, **z)
        self.positions = torch.zeros(tokens, dtype=torch.int64, **z)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, **z)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, **z) * q_len
        self.block_tables = {g: torch.zeros(max_batch, max_blocks, dtype=torch.int32, **z) for g in self.groups}
        self.slot_mappings = {g: torch.full((tokens,), -1, dtype=torch.int64, **z) for g in self.groups}
        self.state_mode = state_mode
        self.state_indices = torch.full((max_batch,), -1, dtype=torch.int64, **z)
        self.pending_lens = torch.zeros(max_batch, dtype=torch.int32, **z)
        self.uniforms = torch.zeros(tokens, dtype=torch.float32, **z) if uniforms else None
        self.context_states = self.context_positions = None
        self.context_slot_mappings = {}
        if context_dim is not None:
            self.context_states = torch.zeros(tokens, context_dim, dtype=context_dtype, **z)
            self.context_positions = torch.zeros(tokens, dtype=torch.int64, **z)
            self.context_slot_mappings = {g: torch.full((tokens,), -1, dtype=torch.int64, **z) for g in self.groups}

    def forward_context(self, bucket: int) -> ForwardContext:
        """Views of the buffers sized for ``bucket`` sequences: what a captured graph reads on every replay."""
        n = bucket * self.q_len
        meta = {
            g: AttentionMetadata(self.block_tables[g][:bucket], self.seq_lens[:bucket],
                                 self.query_start_loc[: bucket + 1], self.slot_mappings[g][:n],
                                 self.context_slot_mappings[g][:n] if self.context_slot_mappings else None)
            for g in self.groups
        }
        ctx_states = None if self.context_states is None else self.context_states[:n]
        ctx_pos = None if self.context_positions is None else self.context_positions[:n]
        states = None
        if self.state_mode is not None:
            stash = self.state_mode == "stash"
            states = StateMetadata(self.state_indices[:bucket], self.query_start_loc[: bucket + 1],
                                   self.pending_lens[:bucket] if stash else None, stash)
        return ForwardContext(meta, context_states=ctx_states, context_positions=ctx_pos, state_metadata=states)

    def fill(self, bucket: int, input_ids, positions, seq_lens, block_tables: dict, *, context_states=None,
             context_positions=None, context_slot_mappings: Optional[dict] = None, state_indices=None,
             pending_lens=None, uniforms=None) -> None:
        """Copy one step's real inputs into the buffers and pad up to ``bucket`` sequences. No host sync.

        input_ids/positions ``[batch * q_len]``, seq_lens ``[batch]``, block_tables {group: ``[batch, blocks]``},
        context_states ``[batch * q_len, context_dim]``, context slot mappings {group: ``[batch * q_len]``};
        with a ``state_mode``, state_indices ``[batch]`` and (stash steps) pending_lens ``[batch]``; with
        ``uniforms`` buffers, uniforms ``[batch * q_len]``.
        """
        batch = seq_lens.shape[0]
        n, padded = batch * self.q_len, bucket * self.q_len
        if not batch <= bucket <= self.max_batch:
            raise ValueError(f"batch {batch} does not fit bucket {bucket} (max_batch {self.max_batch})")
        if input_ids.shape[0] != n or positions.shape[0] != n:
            raise ValueError(f"expected {n} tokens ({batch} sequences x q_len {self.q_len}), got {input_ids.shape[0]}")
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:padded].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:padded].zero_()
        self.seq_lens[:batch].copy_(seq_lens)
        self.seq_lens[batch:bucket].zero_()
        seq_index = torch.arange(padded, device=self.seq_lens.device) // self.q_len
        for g in self.groups:
            table = block_tables[g]
            if table.dim() != 2 or table.shape[0] != batch or table.shape[1] > self.block_tables[g].shape[1]:
                raise ValueError(f"block_tables[{g}] has shape {tuple(table.shape)}; expected [batch = {batch}, at most "
                                 f"max_blocks = {self.block_tables[g].shape[1]}]")
            self.block_tables[g][:batch, : table.shape[1]].copy_(table)
            # Columns past a narrower table still hold an earlier step's blocks: -1 (out of range: nothing stored or
            # read there, and the eager check names the entry) keeps a too-long seq_len out of another sequence's.
            self.block_tables[g][:batch, table.shape[1]:].fill_(-1)
            self.block_tables[g][batch:bucket].zero_()
            real_pos = torch.where(seq_index < batch, self.positions[:padded], -1)
            self.slot_mappings[g][:padded].copy_(
                slots_for_positions(real_pos, seq_index, self.block_tables[g][:bucket], self.block_size))
        if self.state_mode is not None:
            if state_indices is None or (self.state_mode == "stash" and pending_lens is None):
                raise ValueError(f"a {self.state_mode!r} step needs state_indices"
                                 f"{' and pending_lens' if self.state_mode == 'stash' else ''}")
            self.state_indices[:batch].copy_(state_indices)
            self.state_indices[batch:bucket].fill_(-1)
            if pending_lens is not None:
                self.pending_lens[:batch].copy_(pending_lens)
                self.pending_lens[batch:bucket].zero_()
        if self.uniforms is not None:
            if uniforms is None:
                raise ValueError("this step samples inside its graph: it needs uniforms")
            self.uniforms[:n].copy_(uniforms)
            self.uniforms[n:padded].zero_()
        if self.context_states is not None:
            if context_states is None or context_positions is None or context_slot_mappings is None:
                raise ValueError("a drafter step needs context_states, context_positions and context_slot_mappings")
            self.context_states[:n].copy_(context_states)
            self.context_states[n:padded].zero_()
            self.context_positions[:n].copy_(context_positions)
            self.context_positions[n:padded].zero_()
            for g in self.groups:
                self.context_slot_mappings[g][:n].copy_(context_slot_mappings[g])
                self.context_slot_mappings[g][n:padded].fill_(-1)
