"""Tensor parallelism: head-, feature- and vocabulary-split layers over torch.distributed functional collectives."""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn


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


class ColumnParallelLinear(nn.Linear):
    """Output features ``[start, stop)`` of a full ``in_features -> full_out`` linear layer; no communication.

    ``forward``: ``[..., in_features]`` -> ``[..., stop - start]``.
    """

    def __init__(self, in_features: int, full_out: int, part: tuple[int, int], bias: bool):
        super().__init__(in_features, part[1] - part[0], bias=bias)
        shard = Shard(0, part[0], part[1], full_out)
        self.shards = {"weight": shard, "bias": shard} if bias else {"weight": shard}


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
        y = self.tp.all_reduce(F.linear(x, self.weight))
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


def column_linear(in_features: int, full_out: int, part: Optional[tuple[int, int]], bias: bool) -> nn.Linear:
    """``nn.Linear`` without tensor parallelism (``part`` None), else this rank's output features ``part``."""
    if part is None:
        return nn.Linear(in_features, full_out, bias=bias)
    return ColumnParallelLinear(in_features, full_out, part, bias)


def row_linear(full_in: int, out_features: int, part: Optional[tuple[int, int]], bias: bool,
               tp: Optional[TensorParallel], *, input_is_split: bool = True) -> nn.Linear:
    """``nn.Linear`` without tensor parallelism, else this rank's input features ``part`` and an all-reduce."""
    if tp is None:
        return nn.Linear(full_in, out_features, bias=bias)
    return RowParallelLinear(full_in, out_features, part, bias, tp, input_is_split=input_is_split)


def shard_rules(module: nn.Module) -> dict[str, Shard]:
    """Parameter name (as ``named_parameters``) -> its ``Shard``, for every split parameter; the rest are whole."""
    return {f"{prefix}.{name}" if prefix else name: shard
            for prefix, m in module.named_modules(remove_duplicate=False)
            for name, shard in getattr(m, "shards", {}).items()}


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
    """``(name, full) -> this rank's part`` for ``module``'s parameters: the ``shard`` hook of ``load_weights``."""
    rules = shard_rules(module)
    return lambda name, full: take_shard(name, full, rules.get(name))


@torch.no_grad()
def load_full_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's part of every full tensor in ``state`` (names as ``named_parameters``) into ``module``."""
    rules = shard_rules(module)
    for name, param in module.named_parameters(remove_duplicate=False):
        param.copy_(take_shard(name, state[name], rules.get(name)))


def shared_seed(tp: TensorParallel, device) -> int:
    """A seed drawn from rank 0's global generator and broadcast, so every rank seeds the same sampler."""
    import torch.distributed as dist

    seed = torch.randint(0, 2**62, (1,)).to(device)
    dist.broadcast(seed, group_src=0, group=tp.group)
    return int(seed.item())
