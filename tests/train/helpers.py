"""Paged (tqops inference) runs of a target prefill and of one DFlash draft block, as generate() sets them up."""
import torch

from tqops.models.generate import CACHE_BLOCK_SIZE, step_context
from tqops.graphs import set_forward_context


def _table(tokens: int) -> torch.Tensor:
    return torch.arange(-(-tokens // CACHE_BLOCK_SIZE), dtype=torch.int32)[None]


def paged_prefill(target, ids: torch.Tensor, layer_ids=None):
    """The tqops target over ``ids`` ``[n]`` from position 0: hidden ``[n, H]`` (and ``[n, C]`` states)."""
    n = torch.tensor([len(ids)], dtype=torch.int32)
    table = _table(len(ids))
    target.allocate_cache(table.shape[1], CACHE_BLOCK_SIZE)
    with set_forward_context(step_context(n, n, table)):
        return target(ids, torch.arange(len(ids)), layer_ids=layer_ids)


def paged_block_logits(drafter, states: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Draft logits ``[bs - 1, V]`` of ``block`` ``[bs]`` placed right after the context rows ``states`` ``[a, C]``:
    the rows are stored as a prefill stores a prompt, then the block runs as a draft step with no new rows."""
    a, bs = states.shape[0], block.shape[0]
    table = _table(a + bs)
    drafter.allocate_cache(table.shape[1], CACHE_BLOCK_SIZE)
    lens = torch.tensor([a], dtype=torch.int32)
    with set_forward_context(step_context(lens, lens, table, states, torch.arange(a))):
        drafter.prefill_context(torch.zeros(a, dtype=torch.long))
    q_lens, k_lens = torch.tensor([bs], dtype=torch.int32), torch.tensor([a + bs], dtype=torch.int32)
    none = torch.full((bs,), -1)  # this step brings no context rows: slot -1, never stored
    with set_forward_context(step_context(q_lens, k_lens, table, torch.zeros(bs, states.shape[1]), none)):
        hidden = drafter(block, torch.arange(a, a + bs))
    return drafter.compute_logits(hidden[1:])
