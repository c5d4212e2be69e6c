"""The drafter's training text: the frozen target's own greedy continuations of corpus prompts.

At inference every token the drafter is asked to predict is the target's greedy choice after a context the target
itself accepted, so that is what it trains on (as DFlash and EAGLE regenerate their data with the target). The
corpus alone is a few million tokens: a drafter trained on it memorizes the text and learns a target it never
meets at inference.
"""
from __future__ import annotations

import inspect
import math
import time
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm


def prompt_windows(docs: Sequence[np.ndarray], count: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``[count, length]`` windows of the joined documents at random offsets (what a prompt looks like: any place in
    a file, documents separated by end-of-text as in training)."""
    stream = np.concatenate(list(docs))
    if len(stream) < length + 1:
        raise ValueError(f"the documents hold {len(stream)} tokens, fewer than one {length}-token prompt")
    starts = rng.integers(0, len(stream) - length, size=count)
    return np.stack([stream[s:s + length] for s in starts])


@torch.no_grad()
def greedy_continue(model: nn.Module, prompts: torch.Tensor, total_len: int) -> torch.Tensor:
    """``prompts`` ``[B, P]`` extended to ``[B, total_len]`` by the transformers causal LM ``model``'s greedy
    tokens (its own KV cache; end-of-text is a token like any other, as in the packed training stream)."""
    # transformers renamed past_key_values to cache (5.2x); take whichever this version has
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
    past, ids, new = getattr(out, name), [prompts], total_len - prompts.shape[1]
    for i in range(new):
        ids.append(out.logits[:, -1:].argmax(-1))
        if i + 1 < new:
            out = model(input_ids=ids[-1], use_cache=True, logits_to_keep=1, **{name: past})
    return torch.cat(ids, 1)


def greedy_sequences(model: nn.Module, docs: Sequence[np.ndarray], *, count: int, seq_len: int, new_tokens: int,
                     batch_size: int, seed: int, device, pad_id: int, minutes: Optional[float] = None,
                     desc: str = "greedy data") -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` sequences ``[n, seq_len]`` (int64, CPU): a corpus prompt, the target's ``new_tokens`` greedy
    tokens after it, then ``pad_id`` up to ``seq_len``; and each one's prompt length ``[n]``.

    Only the first tokens after a prompt are generated because that is where speculative decoding spends its
    drafts and where they are hard: further on, a small target settles into repeating itself, which any drafter
    learns at once. One prompt length per generation batch, uniform in ``[16, seq_len - new_tokens]``, so the
    drafter meets every context length the target takes. The padding is never a context row or a label of an
    anchor in ``greedy_anchor_range``. With ``minutes``, no batch starts after that much wall-clock time (at
    least one batch runs)."""
    if not 1 <= new_tokens < seq_len:
        raise ValueError(f"new_tokens must be in [1, seq_len) = [1, {seq_len}), got {new_tokens}")
    low, high = min(16, seq_len - new_tokens), seq_len - new_tokens
    rng = np.random.default_rng(seed)
    seqs, starts, deadline = [], [], time.perf_counter() + 60 * minutes if minutes else math.inf
    with tqdm(total=count, desc=desc, unit="seq") as bar:
        while sum(len(s) for s in seqs) < count and not (seqs and time.perf_counter() > deadline):
            n = min(batch_size, count - sum(len(s) for s in seqs))
            p = int(rng.integers(low, high + 1))
            prompts = torch.from_numpy(prompt_windows(docs, n, p, rng).astype(np.int64)).to(device)
            ids = greedy_continue(model, prompts, p + new_tokens).cpu()
            seqs.append(torch.cat([ids, torch.full((n, seq_len - ids.shape[1]), pad_id, dtype=ids.dtype)], 1))
            starts.append(torch.full((n,), p, dtype=torch.int64))
            bar.update(n)
    return torch.cat(seqs), torch.cat(starts)


def greedy_anchor_range(prompt_lens: torch.Tensor, new_tokens: int, block_size: int) -> torch.Tensor:
    """``[n, 2]`` each sequence's first and last anchor: from the prompt's last token (the first block after a
    prefill) to the block whose last label is the last generated token, so every label is a target greedy token."""
    return torch.stack([prompt_lens - 1, prompt_lens + new_tokens - block_size], 1)


class SequenceBatches:
    """Endless ``(input_ids [batch_size, S], prompt_lens [batch_size])`` batches of fixed sequences, reshuffled
    every epoch (seeded by ``seed`` and the epoch)."""

    def __init__(self, seqs: torch.Tensor, prompt_lens: torch.Tensor, batch_size: int, seed: int = 0):
        if len(seqs) < batch_size:
            raise ValueError(f"{len(seqs)} sequences cannot fill one batch of {batch_size}")
        self.seqs, self.prompt_lens, self.batch_size, self.seed = seqs, prompt_lens, batch_size, seed
        self.tokens = int(seqs.numel())
        self.epoch = 0.0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = 0
        while True:
            order = torch.from_numpy(np.random.default_rng([self.seed, epoch]).permutation(len(self.seqs)))
            per_epoch = len(order) // self.batch_size
            for b in range(per_epoch):
                self.epoch = epoch + (b + 1) / per_epoch
                rows = order[b * self.batch_size:(b + 1) * self.batch_size]
                yield self.seqs[rows], self.prompt_lens[rows]
            epoch += 1
