"""Tensor parallelism: head-, feature- and vocabulary-split layers over torch.distributed functional collectives, and
the merged column projections (q/k/v, gate/up) with the checkpoint names of their parts."""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..linear import linear


@dataclasses.dataclass(frozen=True)
class Shard:
    """This rank's part of a full tensor: indices ``[start, stop)`` of dim ``dim``, whose full size is ``full``.
    Indices at or past ``full`` (vocabulary padding) are zeros."""

    dim: int
    start: int
    stop: int
    full: int


def _collectives():
    # The functional ops (not dist.all_reduce) so torch.compile(fullgraph=True) traces them into the graph.
    return torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A tensor-parallel process group as the layers see it: this rank, the group size and its collectives."""

    group: object  # torch.distributed.ProcessGroup; forward code reads only ``name``, ``rank`` and ``size``
    name: str
    rank: int
    size: int

    @classmethod
    def of(cls, group) -> Optional["TensorParallel"]:
        """None for ``group=None`` (one process, no collectives), else the group's rank, size and name."""
        if group is None:
            return None
        import torch.distributed as dist

        return cls(group, group.group_name, dist.get_rank(group), dist.get_world_size(group))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``x`` over the group (same shape), on every rank."""
        c = _collectives()
        return c.wait_tensor(c.all_reduce(x, "sum", self.name))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` from every rank -> ``[..., size * d]``, rank r's part at ``[r * d, (r + 1) * d)``."""
        c = _collectives()
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        gathered = c.wait_tensor(c.all_gather_into_tensor(rows, self.size, self.name))  # [size * rows, d]
        n, d = rows.shape
        return gathered.view(self.size, n, d).permute(1, 0, 2).reshape(*x.shape[:-1], self.size * d)

    def heads(self, n: int, what: str) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``n`` heads; ``n`` must divide evenly."""
        if n % self.size:
            raise ValueError(f"tensor parallelism over {self.size} ranks needs {what} ({n}) divisible by {self.size}")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def features(self, n: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``n`` features split as evenly as possible (the first ``n % size`` ranks
        take one more): for a column/row-parallel pair, whose all-reduce does not care about equal parts."""
        per, extra = divmod(n, self.size)
        start = self.rank * per + min(self.rank, extra)
        return start, start + per + (self.rank < extra)

    def vocab(self, n: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of a vocabulary of ``n`` padded to ``size * ceil(n / size)`` entries: the
        all-gather of logits needs equal parts; padded entries lie at or past ``n``."""
        per = -(-n // self.size)
        return self.rank * per, (self.rank + 1) * per


class Linear(nn.Linear):
    """``nn.Linear`` computed by ``tqops.linear`` (a GEMV kernel for one-row inputs on CUDA); same parameters and
    state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedColumnLinear(Linear):
    """Column linears of one input run as one GEMM, as vLLM's QKVParallelLinear / MergedColumnParallelLinear do.

    ``forward``: ``[..., in_features]`` -> ``[..., sum(sizes)]``, the parts' outputs side by side in order.

    ``parts`` maps each part's checkpoint module name (a sibling of this module: ``q_proj``, ``k_proj``, ...) to its
    full output size and this rank's ``[start, stop)`` of it (None: all of it). The weight and bias stack the parts'
    rows; under tensor parallelism each part contributes only this rank's slice, so a rank's q, k and v stay together.
    The owning module calls ``keep_checkpoint_names`` so that its state dict holds the parts, not the merged tensors.
    """

    def __init__(self, in_features: int, parts: Mapping[str, tuple[int, Optional[tuple[int, int]]]], bias: bool):
        shards = tuple(None if split is None else Shard(0, split[0], split[1], full) for full, split in parts.values())
        sizes = tuple(full if s is None else s.stop - s.start for (full, _), s in zip(parts.values(), shards))
        super().__init__(in_features, sum(sizes), bias=bias)
        self.parts, self.sizes, self.part_shards = tuple(parts), sizes, shards

    def forward_rows(self, x: torch.Tensor, first: int = 0) -> torch.Tensor:
        """The outputs of parts ``first`` onward side by side, ``[..., sum(sizes[first:])]``, from one GEMM over only
        their rows: e.g. keys and values of DFlash context rows, which need no queries."""
        start = sum(self.sizes[:first])
        bias = None if self.bias is None else self.bias[start:]
        return linear(x, self.weight[start:], bias)

    def forward_parts(self, x: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, ...]:
        """``forward_rows`` split into the parts' outputs, ``[..., sizes[i]]`` each (views)."""
        return self.forward_rows(x, first).split(self.sizes[first:], dim=-1)

    def checkpoint_names(self, prefix: str, kind: str) -> list[str]:
        """The parts' names of ``kind`` (``weight`` or ``bias``) under the owner's state-dict ``prefix``."""
        return [f"{prefix}{part}.{kind}" for part in self.parts]

    def checkpoint_params(self, prefix: str) -> dict[str, tuple[torch.Tensor, Optional[Shard]]]:
        """Each part's name under the owner's ``prefix`` -> (its rows of the weight or bias, a view; this rank's
        ``Shard`` of the full part, or None)."""
        return {name: (rows, shard) for kind, p in self.named_parameters(recurse=False)
                for name, rows, shard in zip(self.checkpoint_names(prefix, kind), p.detach().split(self.sizes),
                                             self.part_shards)}


def _merged_children(module: nn.Module) -> list[tuple[str, MergedColumnLinear]]:
    return [(name, m) for name, m in module.named_children() if isinstance(m, MergedColumnLinear)]


def _split_merged_state(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    for name, merged in _merged_children(module):
        for kind, _ in merged.named_parameters(recurse=False):
            tensor = state.pop(f"{prefix}{name}.{kind}")
            state.update(zip(merged.checkpoint_names(prefix, kind), tensor.split(merged.sizes)))


def _merge_state_parts(module: nn.Module, state: dict, prefix: str, *args) -> None:
    for name, merged in _merged_children(module):
        for kind, _ in merged.named_parameters(recurse=False):
            names = merged.checkpoint_names(prefix, kind)
            if all(n in state for n in names):  # else the load reports the missing and unexpected names
                state[f"{prefix}{name}.{kind}"] = torch.cat([state.pop(n) for n in names])


def keep_checkpoint_names(module: nn.Module) -> None:
    """Make ``module``'s ``state_dict`` and ``load_state_dict`` use its ``MergedColumnLinear`` children's part names
    (``q_proj.weight``, ...), as checkpoints do. The hooks sit on the owner: a child's own load hook sees only keys
    under the child's name, never its siblings'."""
    module.register_state_dict_post_hook(_split_merged_state)
    module.register_load_state_dict_pre_hook(_merge_state_parts)


class RowParallelLinear(nn.Linear):
    """Input features ``[start, stop)`` of a full ``full_in -> out_features`` linear layer; one all-reduce sums the
    ranks' partial products, and the bias (kept whole) is added once, after the sum.

    ``forward``: ``[..., stop - start]`` (``input_is_split``) or the full ``[..., full_in]`` (this rank takes its
    slice, free for an input every rank holds) -> ``[..., out_features]`` on every rank.
    """

    def __init__(self, full_in: int, out_features: int, part: tuple[int, int], bias: bool, tp: TensorParallel, *,
                 input_is_split: bool = True):
        super().__init__(part[1] - part[0], out_features, bias=bias)
        self.tp, self.start, self.input_is_split = tp, part[0], input_is_split
        self.shards = {"weight": Shard(1, part[0], part[1], full_in)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_split:
            x = x.narrow(-1, self.start, self.in_features)
        y = self.tp.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, stop)`` of a ``vocab x hidden`` embedding (padded to equal parts); ``forward``: ids ``[n]`` ->
    ``[n, hidden]`` on every rank: each rank looks up the ids it holds, zeros for the rest, and one all-reduce sums
    them (every id is held by exactly one rank, so the sum is exact)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        start, stop = tp.vocab(vocab_size)
        super().__init__(stop - start, hidden_size)
        self.tp, self.start, self.vocab_size = tp, start, vocab_size
        self.shards = {"weight": Shard(0, start, stop, vocab_size)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        held = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(held, local, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(~held[..., None], 0))


class VocabParallelLMHead(nn.Linear):
    """Rows ``[start, stop)`` of a ``vocab x hidden`` LM head (the embedding's split); ``forward``: ``[..., hidden]``
    -> full logits ``[..., vocab]`` on every rank (each rank's slice, all-gathered, the padding cut off)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel):
        start, stop = tp.vocab(vocab_size)
        super().__init__(hidden_size, stop - start, bias=False)
        self.tp, self.vocab_size = tp, vocab_size
        self.shards = {"weight": Shard(0, start, stop, vocab_size)}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(hidden, self.weight))[..., :self.vocab_size]


def row_linear(full_in: int, out_features: int, part: Optional[tuple[int, int]], bias: bool,
               tp: Optional[TensorParallel], *, input_is_split: bool = True) -> nn.Linear:
    """``Linear`` without tensor parallelism, else this rank's input features ``part`` and an all-reduce."""
    if tp is None:
        return Linear(full_in, out_features, bias=bias)
    return RowParallelLinear(full_in, out_features, part, bias, tp, input_is_split=input_is_split)


def checkpoint_params(module: nn.Module) -> dict[str, tuple[torch.Tensor, Optional[Shard]]]:
    """Checkpoint (HF) name -> (the parameter it fills, or a merged projection's rows of one; this rank's ``Shard``
    of the full tensor, or None when held whole), for every parameter of ``module``, shared ones under every name."""
    out = {}
    for name, m in module.named_modules(remove_duplicate=False):
        if name and isinstance(m, MergedColumnLinear):
            continue  # its owner names its parts
        prefix = f"{name}." if name else ""
        shards = getattr(m, "shards", {})
        out.update((prefix + n, (p, shards.get(n))) for n, p in m.named_parameters(recurse=False))
        for _, merged in _merged_children(m):
            out.update(merged.checkpoint_params(prefix))
    return out


def take_shard(name: str, full, shard: Optional[Shard]) -> torch.Tensor:
    """This rank's part of ``full`` (a tensor, or a lazily read checkpoint tensor: ``.shape`` and indexing), read
    whole when ``shard`` is None; vocabulary padding past the full size comes back as zeros."""
    if shard is None:
        return full[...]
    if full.shape[shard.dim] != shard.full:
        raise ValueError(f"{name} has {full.shape[shard.dim]} entries along dim {shard.dim}; the model (before its "
                         f"tensor-parallel split) expects {shard.full}")
    lo, hi = min(shard.start, shard.full), min(shard.stop, shard.full)
    part = full[(slice(None),) * shard.dim + (slice(lo, hi),)]
    missing = shard.stop - shard.start - (hi - lo)
    if missing:
        pad = list(part.shape)
        pad[shard.dim] = missing
        part = torch.cat([part, part.new_zeros(pad)], dim=shard.dim)
    return part


def shard_hook(module: nn.Module) -> Callable[[str, object], torch.Tensor]:
    """``(name, full) -> this rank's part`` for ``module``'s checkpoint tensors: the ``shard`` hook of
    ``load_weights``."""
    shards = {name: shard for name, (_, shard) in checkpoint_params(module).items()}
    return lambda name, full: take_shard(name, full, shards.get(name))


@torch.no_grad()
def load_full_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's part of every full tensor in ``state`` (checkpoint names, as ``state_dict``) into ``module``."""
    for name, (param, shard) in checkpoint_params(module).items():
        param.copy_(take_shard(name, state[name], shard))


def shared_seed(tp: TensorParallel, device) -> int:
    """A seed drawn from rank 0's global generator and broadcast, so every rank seeds the same sampler."""
    import torch.distributed as dist

    seed = torch.randint(0, 2**62, (1,)).to(device)
    dist.broadcast(seed, group_src=0, group=tp.group)
    return int(seed.item())
