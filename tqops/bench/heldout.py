"""The target's next-token loss on held-out continuations through its own paged cache, for the acceptance study.

The target's next-token cross entropy on the reference continuation given each context (teacher forced, on the
windows of ``tqops.train.heldout.heldout_windows``), from one packed prefill over a fresh paged cache in the layout's
target format. The prefill needs no chunking to read the format: every ``Attention`` layer stores the step's K/V into
its cache first and then attends over the stored cache (``tqops::layer_kv_store``, then ``tqops::layer_attention``
over ``kv_cache`` alone), so each query already sees every key and value, its own included, quantized and
dequantized, as a decode step does.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from tqops.graphs import set_forward_context
from tqops.models.generate import CACHE_BLOCK_SIZE, step_context
from tqops.models.loading import read_config


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
