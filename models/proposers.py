"""Draft proposers other than the DFlash drafter: an oracle that is right for exactly k tokens per block."""
from __future__ import annotations

from typing import Sequence

import torch


class OracleProposer:
    """Proposes the first ``k`` tokens of each block from a known continuation, then guaranteed-wrong tokens.

    ``reference[b]``: the target's own greedy continuation of prompt b (e.g. from a plain ``generate``).
    ``proposer(seq_ids, generated)`` -> ``[len(seq_ids), block_size - 1]`` draft tokens, where ``generated[i]`` is
    what sequence ``seq_ids[i]`` has produced so far (its last token starts the block).
    """

    def __init__(self, reference: Sequence[Sequence[int]], k: int, block_size: int, vocab_size: int):
        if block_size < 2:
            raise ValueError("block_size must be >= 2")
        self.reference = [list(r) for r in reference]
        self.k, self.block_size, self.vocab_size = k, block_size, vocab_size

    def __call__(self, seq_ids: Sequence[int], generated: Sequence[Sequence[int]]) -> torch.Tensor:
        drafts = torch.zeros(len(seq_ids), self.block_size - 1, dtype=torch.long)
        for row, (b, done) in enumerate(zip(seq_ids, generated)):
            ref = self.reference[b]
            for i in range(self.block_size - 1):
                j = len(done) + i  # index in ref of draft token i
                true = ref[j] if j < len(ref) else 0
                drafts[row, i] = true if i < self.k and j < len(ref) else (true + 1) % self.vocab_size
        return drafts
