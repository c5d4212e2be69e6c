"""Held-out windows for the acceptance study, and the target's next-token loss through its own paged cache.

Prompts. Each prompt is a window of one held-out file (``tqops.train.corpus.read_heldout``, encoded whole, as
training encodes a document). A file's cut is its first line break at or after token ``max(contexts)``; the
prompt of context ``C`` is the ``C`` tokens before the cut and the reference continuation the ``new_tokens`` after
it. Every context length thus continues at the same place of the same file and only sees more or less of that file
before it, so acceptance against context measures context, not document boundaries; files too short for the
longest context plus the continuation are skipped rather than padded with other documents joined by end-of-text
(with the defaults 17 of the 26 committed held-out files are long enough). A prompt starts mid-file at position 0,
as the target's packed training sequences do; prompt + new tokens must fit the target's max_position_embeddings.
The cut moves with the longest context asked for, so compare numbers within one run (one set of contexts).

Loss. The target's next-token cross entropy on the reference continuation given each context (teacher forced), from
one packed prefill over a fresh paged cache in the layout's target format. The prefill needs no chunking to read the
format: every ``Attention`` layer stores the step's K/V into its cache first and then attends over the stored cache
(``tqops::layer_kv_store``, then ``tqops::layer_attention`` over ``kv_cache`` alone), so each query already sees
every key and value, its own included, quantized and dequantized, as a decode step does.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from tqops.graphs import set_forward_context
from tqops.models.generate import CACHE_BLOCK_SIZE, step_context
from tqops.models.loading import read_config
from tqops.train.corpus import read_heldout


@dataclasses.dataclass(frozen=True)
class Window:
    """One held-out file around its cut: ``ids`` are the ``cut`` tokens before it (the longest context) then the
    reference continuation; ``continuation_bytes`` is the UTF-8 size of the continuation's text."""

    path: str
    ids: tuple
    cut: int
    continuation_bytes: int

    def prompt(self, context: int) -> list[int]:
        """The ``context`` tokens before the cut."""
        return list(self.ids[self.cut - context:self.cut])

    def sequence(self, context: int) -> list[int]:
        """The prompt of ``context`` tokens, then the reference continuation."""
        return list(self.ids[self.cut - context:])


def heldout_windows(tok, count: int, longest: int, new_tokens: int) -> list[Window]:
    """Up to ``count`` windows, from the held-out files in path order that have a line break at or after token
    ``longest`` with ``new_tokens`` tokens after it (the module docstring says why one cut serves every context)."""
    windows = []
    for f in read_heldout():
        enc = tok.encode(f.text)
        ids, offsets = enc.ids, enc.offsets
        # cut before a token that starts a line: the continuation opens a fresh line with its indentation
        cut = next((i for i in range(longest, len(ids) - new_tokens + 1)
                    if f.text[offsets[i][0]:offsets[i][1]].startswith("\n")), None)
        if cut is None:
            continue
        end = cut + new_tokens
        text = f.text[offsets[cut][0]:offsets[end - 1][1]]
        windows.append(Window(f.path, tuple(ids[cut - longest:end]), longest, len(text.encode("utf-8"))))
        if len(windows) == count:
            break
    return windows


def position_limit(target_dir) -> Optional[int]:
    """The target's ``max_position_embeddings`` (None when its config names none)."""
    return read_config(target_dir).get("max_position_embeddings")


@torch.no_grad()
def token_losses(target, sequences: Sequence[Sequence[int]], scored: int) -> torch.Tensor:
    """Next-token cross entropy in nats ``[len(sequences), scored]`` of the last ``scored`` tokens of each sequence
    (each longer than ``scored``), from one packed prefill of ``target`` from position 0 over a fresh paged cache in
    its own formats (the prefill attends over the stored cache: see the module docstring)."""
    device = target.lm_head.weight.device
    lens = torch.tensor([len(s) for s in sequences], dtype=torch.int32, device=device)
    per_seq = -(-int(lens.max()) // CACHE_BLOCK_SIZE)
    table = torch.arange(len(sequences) * per_seq, dtype=torch.int32, device=device).view(len(sequences), per_seq)
    target.allocate_cache(table.numel(), CACHE_BLOCK_SIZE, device)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(int(n), device=device) for n in lens])
    with set_forward_context(step_context(lens, lens, table)):
        hidden = target(ids, pos)
    # the rows that predict each sequence's last `scored` tokens: [len(sequences), scored]
    rows = lens.long().cumsum(0)[:, None] - scored - 1 + torch.arange(scored, device=device)
    logits = target.compute_logits(hidden[rows.flatten()]).float()
    return F.cross_entropy(logits, ids[rows.flatten() + 1], reduction="none").view(rows.shape)
