"""Per-row key counts, the static block table and each step's slot mapping, kept as tensors updated in place."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class StepMetadata(NamedTuple):
    """What every layer's store and attention read in one forward step of ``batch`` rows of ``q_len`` tokens."""

    slot_mapping: torch.Tensor  # [batch * q_len] int64; -1 for padding tokens (not stored)
    block_table: torch.Tensor  # [batch, blocks_per_row] int32
    seq_lens: torch.Tensor  # [batch] int32: real keys per row, this step's included
    query_start_loc: torch.Tensor  # [batch + 1] int32: row b's queries are [b * q_len, (b + 1) * q_len)
    batch: int
    q_len: int
    seen_tokens: torch.Tensor  # 0-d int64: columns processed, this step's included


class SequenceState:
    """Row lengths of a paged cache shared by all its layers.

    Row ``b`` owns physical blocks ``[b * blocks_per_row, (b + 1) * blocks_per_row)`` (a static block table), enough
    for ``max_cache_len`` keys. ``seq_lens[b]`` counts the real (stored) keys of row b: padding tokens get slot -1,
    so a left-padded row holds exactly its real tokens, at the positions ``attention_mask.cumsum(-1) - 1`` that
    transformers' ``generate`` gives them. ``seen_tokens`` counts every column processed, padding included (what
    transformers calls the sequence length of a cache). Both are tensors changed in place, so a compiled step reads
    them without guarding on their values.
    """

    def __init__(self, max_batch_size: int, max_cache_len: int, block_size: int, device: torch.device):
        self.max_batch_size = max_batch_size
        self.max_cache_len = max_cache_len
        self.block_size = block_size
        self.blocks_per_row = -(-max_cache_len // block_size)
        self.num_blocks = max_batch_size * self.blocks_per_row
        self.block_table = torch.arange(self.num_blocks, dtype=torch.int32, device=device).view(
            max_batch_size, self.blocks_per_row)
        self.seq_lens = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
        self.seen_tokens = torch.zeros((), dtype=torch.int64, device=device)
        self.step: Optional[StepMetadata] = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.block_table, self.seq_lens, self.seen_tokens

    def begin_step(self, batch: int, q_len: int, real: Optional[torch.Tensor],
                   check_capacity: bool = False) -> StepMetadata:
        """Place this step's tokens; ``real`` ``[batch, q_len]`` bool marks the tokens to store (None: all). Real
        tokens must follow the padding within each row (left padding).

        The row lengths do not change here: the step's metadata carries the lengths after it, which its layers attend
        over, and ``commit_step`` stores them once the last layer is done. A forward that fails before then, anywhere
        (an attention, an MLP, a norm), leaves the cache's lengths as they were; the slots its earlier layers wrote lie
        past those lengths, where nothing reads them before a later step overwrites them.

        ``check_capacity`` (under compile or CUDA-graph capture, where the caller's eager check cannot read the length
        on the host): a step past ``max_cache_len`` fails a device-side assert naming it, and stores and advances
        nothing, with no host sync."""
        device = self.seq_lens.device
        old_lens = self.seq_lens[:batch]
        if real is None:
            offsets = torch.arange(q_len, device=device).expand(batch, q_len)
            new_tokens = torch.full((batch,), q_len, dtype=torch.int32, device=device)
            stored = torch.ones(batch, q_len, dtype=torch.bool, device=device)
        else:
            offsets = real.long().cumsum(1) - 1
            new_tokens = real.sum(1, dtype=torch.int32)
            stored = real
        seen_tokens = self.seen_tokens + q_len
        if check_capacity:
            fits = seen_tokens <= self.max_cache_len
            # no value in the message: a recompile for another cache size makes max_cache_len symbolic, and dynamo
            # cannot format a symbolic int into a string
            torch._assert_async(fits, "a compiled or captured PagedKVCache step brings the cache past its "
                                      "max_cache_len (padding included); create the PagedKVCache with a larger "
                                      "max_cache_len")
            stored = stored & fits
            new_tokens = torch.where(fits, new_tokens, 0)
            seen_tokens = torch.where(fits, seen_tokens, self.seen_tokens)
        positions = old_lens.long()[:, None] + offsets  # [batch, q_len]; garbage where not stored
        capacity = self.blocks_per_row * self.block_size
        # Never into another row's blocks (the capacity checks keep every position below max_cache_len <= capacity).
        stored = stored & (positions >= 0) & (positions < capacity)
        logical_block = (positions // self.block_size).clamp(0, self.blocks_per_row - 1)
        physical_block = torch.gather(self.block_table[:batch].long(), 1, logical_block)
        slots = torch.where(stored, physical_block * self.block_size + positions % self.block_size, -1)
        query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
        self.step = StepMetadata(slots.reshape(-1), self.block_table[:batch], old_lens + new_tokens, query_start_loc,
                                 batch, q_len, seen_tokens)
        return self.step

    def commit_step(self, step: StepMetadata) -> None:
        """``step``'s layers are all done: the row lengths and column count become the step's (in place, so a
        compiled step mutates the same tensors every time)."""
        self.seq_lens[:step.batch].copy_(step.seq_lens)
        self.seen_tokens.copy_(step.seen_tokens)
        self.step = None

    def crop(self, keep_columns: int) -> None:
        """Drop every column after the first ``keep_columns``. Padding precedes a row's real tokens, so the dropped
        columns are the row's last real ones (or padding, for a row with fewer real tokens)."""
        removed = int(self.seen_tokens) - keep_columns
        self.seq_lens.sub_(removed).clamp_(min=0)
        self.seen_tokens.fill_(keep_columns)
        self.step = None

    def rollback_rows(self, tokens_to_remove: torch.Tensor) -> None:
        """Drop the last ``tokens_to_remove[b]`` real tokens of row b (``[batch]`` int, batch <= max_batch_size);
        later rows keep theirs. Rows may then differ in length, so the column count becomes the longest row's (as if
        every row were left-padded to it): the max_cache_len check then counts what the longest row holds, not
        columns that no row holds. No host sync."""
        batch = tokens_to_remove.shape[0]
        self.seq_lens[:batch].sub_(tokens_to_remove.to(self.seq_lens.dtype)).clamp_(min=0)
        self.seen_tokens.copy_(self.seq_lens.max())
        self.step = None

    def reset(self) -> None:
        self.seq_lens.zero_()
        self.seen_tokens.zero_()
        self.step = None
