"""Token streams of a corpus split: documents joined by end-of-text, packed into fixed-length sequences."""
from __future__ import annotations

import itertools

from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer

from . import corpus


def encode_documents(tok: Tokenizer, texts: Sequence[str], eos_id: int) -> list[np.ndarray]:
    """Each text's token ids followed by ``eos_id`` (the document separator), as int32 arrays."""
    return [np.array(e.ids + [eos_id], dtype=np.int32) for e in tok.encode_batch(list(texts))]


def eval_sequences(docs: Sequence[np.ndarray], seq_len: int) -> list[torch.Tensor]:
    """All tokens of ``docs`` in order, cut into ``seq_len`` sequences (the last may be shorter; none of 1 token)."""
    stream = np.concatenate(list(docs)) if docs else np.zeros(0, np.int32)
    return [torch.from_numpy(stream[i:i + seq_len].astype(np.int64)) for i in range(0, len(stream), seq_len)
            if len(stream[i:i + seq_len]) > 1]


def eval_batches(docs: Sequence[np.ndarray], seq_len: int, batch_size: int) -> list[torch.Tensor]:
    """``eval_sequences`` stacked ``batch_size`` at a time (the shorter last sequence in a batch of its own)."""
    seqs = eval_sequences(docs, seq_len)
    full = [s for s in seqs if len(s) == seq_len]
    batches = [torch.stack(full[i:i + batch_size]) for i in range(0, len(full), batch_size)]
    return batches + [s[None] for s in seqs if len(s) != seq_len]


class PackedBatches:
    """Endless ``[batch_size, seq_len]`` int64 batches: each epoch shuffles the documents (seeded by ``seed`` and
    the epoch), joins them, cuts ``seq_len`` sequences (dropping the remainder) and deals them out in random order.
    """

    def __init__(self, docs: Sequence[np.ndarray], seq_len: int, batch_size: int, seed: int = 0):
        self.docs, self.seq_len, self.batch_size, self.seed = list(docs), seq_len, batch_size, seed
        self.tokens = int(sum(len(d) for d in self.docs))
        if self.tokens < seq_len * batch_size:
            raise ValueError(f"{self.tokens} tokens cannot fill one batch of {batch_size} x {seq_len}")
        self.epoch = 0.0  # epochs consumed so far, fractional

    def __iter__(self) -> Iterator[torch.Tensor]:
        epoch = 0
        while True:
            rng = np.random.default_rng([self.seed, epoch])
            stream = np.concatenate([self.docs[i] for i in rng.permutation(len(self.docs))])
            seqs = stream[:len(stream) // self.seq_len * self.seq_len].reshape(-1, self.seq_len)
            seqs = seqs[rng.permutation(len(seqs))]
            per_epoch = len(seqs) // self.batch_size
            for b in range(per_epoch):
                self.epoch = epoch + (b + 1) / per_epoch
                yield torch.from_numpy(seqs[b * self.batch_size:(b + 1) * self.batch_size].astype(np.int64))
            epoch += 1


def corpus_splits(tok: Tokenizer, eos: int, train_files: Optional[int] = None,
                  eval_files: Optional[int] = None) -> dict:
    """Token documents (``"docs"``) and sizes of the local train and validation splits and of the committed held-out
    texts; ``train_files`` / ``eval_files`` keep only the first files (tests)."""
    texts = {
        "train": [f.text for f in itertools.islice(corpus.iter_sources("train"), train_files)],
        "valid": [f.text for f in itertools.islice(corpus.iter_sources("valid"), eval_files)],
        "heldout": [f.text for f in corpus.read_heldout()[:eval_files]],
    }
    docs = {k: encode_documents(tok, v, eos) for k, v in texts.items()}
    return {"docs": docs, "chars": {k: sum(map(len, v)) for k, v in texts.items()},
            "bytes": {k: sum(len(t.encode()) for t in v) for k, v in texts.items()},
            "files": {k: len(v) for k, v in texts.items()},
            "tokens": {k: int(sum(len(d) for d in v)) for k, v in docs.items()}}
