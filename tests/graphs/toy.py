"""A toy model and drafter built from tqops.graphs.Attention, plus a tiny paged-batch bookkeeper."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tqops.graphs import Attention, AttentionMetadata, ForwardContext, build_metadata, context_states

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4, 2, 64, 50


@dataclasses.dataclass
class LayerSpec:
    fmt: str = "bf16"
    causal: bool = True
    window: int | None = None
    sinks: bool = False
    group: int = 0


# The regression layout: bf16 boundary layers, TurboQuant in the middle, sliding-window odd layers in group 1.
MIXED_LAYERS = [
    LayerSpec("bf16"), LayerSpec("bf16", window=5, group=1),
    LayerSpec("turboquant_4bit_nc", causal=False), LayerSpec("turboquant_4bit_nc", window=5, group=1, sinks=True),
    LayerSpec("bf16"), LayerSpec("bf16", window=5, group=1),
]


class Block(nn.Module):
    def __init__(self, i: int, spec: LayerSpec, prefix: str):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.attn = Attention(HEADS, KV_HEADS, HEAD_DIM, name=f"{prefix}.layers.{i}", cache_format=spec.fmt,
                              causal=spec.causal, sliding_window=spec.window, sinks=spec.sinks, group=spec.group)
        if spec.sinks:
            nn.init.normal_(self.attn.sinks)

    def kv(self, x):
        _, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        return k.unflatten(-1, (KV_HEADS, HEAD_DIM)), v.unflatten(-1, (KV_HEADS, HEAD_DIM))

    def forward(self, x):
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        out = self.attn(q.unflatten(-1, (HEADS, HEAD_DIM)), k.unflatten(-1, (KV_HEADS, HEAD_DIM)),
                        v.unflatten(-1, (KV_HEADS, HEAD_DIM)))
        return x + self.o(out.flatten(1))


class ToyModel(nn.Module):
    def __init__(self, specs=MIXED_LAYERS, prefix="toy"):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(i, s, prefix) for i, s in enumerate(specs))

    def allocate(self, num_blocks, block_size, device=None):
        for layer in self.layers:
            layer.attn.allocate_cache(num_blocks, block_size, device)
            layer.attn.kv_cache.zero_()

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x


class ToyDrafter(ToyModel):
    """Projects injected context states to context K/V in every layer, then attends like the toy model."""

    CONTEXT_DIM = 2 * HIDDEN

    def __init__(self, specs, prefix="drafter"):
        super().__init__(specs, prefix)
        self.fc = nn.Linear(self.CONTEXT_DIM, HIDDEN, bias=False)

    def forward(self, input_ids):
        ctx = self.fc(context_states(input_ids, self.CONTEXT_DIM, self.fc.weight.dtype))
        x = self.embed(input_ids)
        for layer in self.layers:
            layer.attn.store_context(*layer.kv(ctx))
            x = layer(x)
        return x


class PagedBatch:
    """Per-sequence lengths and block tables for groups 0 and 1 (group 1 uses its own physical blocks)."""

    def __init__(self, batch, max_blocks, block_size, groups=(0, 1), device="cpu"):
        self.block_size, self.device, self.groups = block_size, device, groups
        self.seq_lens = torch.zeros(batch, dtype=torch.int32)
        perm = torch.randperm(len(groups) * batch * max_blocks, generator=torch.Generator().manual_seed(0))
        self.tables = {g: perm.view(len(groups), batch, max_blocks)[i].to(torch.int32) for i, g in enumerate(groups)}

    def step(self, query_lens, num_tokens=None, context=None):
        """Advance by ``query_lens`` tokens per sequence; returns the ForwardContext for this step."""
        query_lens = torch.tensor(query_lens, dtype=torch.int32)
        self.seq_lens += query_lens
        num_tokens = int(query_lens.sum()) if num_tokens is None else num_tokens
        meta = {g: build_metadata(query_lens.to(self.device), self.seq_lens.to(self.device),
                                  t.to(self.device), self.block_size, num_tokens) for g, t in self.tables.items()}
        return ForwardContext(meta, context_states=context)

    def rollback(self, rejected):
        self.seq_lens -= torch.tensor(rejected, dtype=torch.int32)


def with_context_slots(meta: AttentionMetadata, context_slot_mapping) -> AttentionMetadata:
    return dataclasses.replace(meta, context_slot_mapping=context_slot_mapping)
