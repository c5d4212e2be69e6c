"""DFlash2 drafter for training: the v1 dense forward with DFlash2's convolutions, and its candidate selector's loss.

The modules are ``tqops.models.dflash2``'s own ``GroupedDynamicCausalConv`` and ``CandidateSelector`` (pure torch,
differentiable), so the parameter names, shapes and arithmetic are the inference drafter's by construction; what
this file adds is the dense layout around them and the selector's training objective.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..models.dflash import DFLASH2_ARCHITECTURE, draft_value
from ..models.dflash2 import CandidateSelector, GroupedDynamicCausalConv
from ..models.qwen3 import Qwen3Config
from .dflash import DenseDecoderLayer, DenseDFlashDrafter, block_labels, drafter_config, weighted_mean

ARCHITECTURE = DFLASH2_ARCHITECTURE
ARCHES = ("dflash", "dflash2")  # the drafter stage's --arch: z-lab's DFlashDraftModel, DFlash2DraftModel
SELECTOR_LOSS_WEIGHT = 1.0  # the selector's cross entropy counts as much as the block loss by default


@dataclasses.dataclass
class DFlash2Settings:
    """The ``dflash_config`` fields DFlash2 adds. Defaults for the shipped target (hidden 384, vocab 4096): a 4-tap
    convolution (Mamba's causal-conv width) with one dynamic tap weight per 16 channels (24 groups), and a rank-32
    selector over each position's 8 best candidates; together they add about 0.6M parameters to a 2-layer drafter."""

    conv_kernel_size: int = 4
    conv_group_size: int = 16
    selector_rank: int = 32
    selector_top_k: int = 8


# A DFlash2 drafter for the shipped target no larger than its v1 drafter (7,183,816 bytes of bf16 safetensors): v1's
# 2 layers and hidden size, its MLP 896 wide instead of the target's 1024 (DrafterOptions.intermediate_size), which
# pays for a 4-tap convolution with one dynamic tap weight per 64 channels (6 groups) around each sublayer and a
# rank-24 selector over 8 candidates: 3,587,584 parameters against v1's 3,590,656, 7,178,864 bytes saved.
SHIPPED_SETTINGS = DFlash2Settings(conv_kernel_size=4, conv_group_size=64, selector_rank=24, selector_top_k=8)
SHIPPED_INTERMEDIATE_SIZE = 896


def dflash2_config(target: dict, settings: DFlash2Settings, **kwargs) -> dict:
    """``drafter_config(target, **kwargs)`` declaring ``DFlash2DraftModel``, with ``settings`` in ``dflash_config``
    (where ``tqops.models.DFlash2Drafter`` and z-lab's class read them)."""
    cfg = drafter_config(target, **kwargs)
    cfg["architectures"] = [ARCHITECTURE]
    cfg["dflash_config"].update(dataclasses.asdict(settings))
    return cfg


def conv_around(conv: GroupedDynamicCausalConv, sublayer, x: torch.Tensor) -> torch.Tensor:
    """``conv.prepare``, ``sublayer``, ``conv.finish`` over rows ``x`` ``[B, S, H]`` whose ``S`` is whole blocks in
    order (the conv works on the packed ``[n, H]`` layout, each ``block_size`` rows one block) -> ``[B, S, H]``."""
    h, kernel = conv.prepare(x.flatten(0, 1))
    return conv.finish(sublayer(h.view_as(x)).flatten(0, 1), kernel).view_as(x)


class DenseDFlash2DecoderLayer(DenseDecoderLayer):
    """``DenseDecoderLayer`` with ``attention_conv`` around attention and ``mlp_conv`` around the MLP, in
    ``DFlash2DecoderLayer``'s order: norm, ``prepare``, sublayer, ``finish``, residual add."""

    def __init__(self, cfg: Qwen3Config, *, kernel_size: int, group_size: int, block_size: int):
        super().__init__(cfg)
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, kernel_size, group_size, block_size)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, kernel_size, group_size, block_size)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        x = x + conv_around(self.attention_conv, lambda h: self.self_attn(h, cos, sin, ctx_k, ctx_v, mask),
                            self.input_layernorm(x))
        return x + conv_around(self.mlp_conv, self.mlp, self.post_attention_layernorm(x))


class DenseDFlash2Drafter(DenseDFlashDrafter):
    """The train-time twin of ``tqops.models.DFlash2Drafter``: ``DenseDFlashDrafter``'s forward (``[B, K, bs, H]``
    hidden of K blocks per sequence in one pass) through ``DenseDFlash2DecoderLayer``s, and a ``candidate_selector``
    whose ``losses`` add ``selector_loss`` and whose ``drafts`` are the selector's greedy picks.

    ``state_dict()`` names are the DFlash2 checkpoint's (the codebooks as bare tensors, as published)."""

    def __init__(self, raw_config: dict):
        self.conv_kernel_size = int(_required(raw_config, "conv_kernel_size"))
        self.conv_group_size = int(_required(raw_config, "conv_group_size"))
        super().__init__(raw_config)
        cfg = self.config
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size,
                                                    int(_required(raw_config, "selector_rank")),
                                                    int(_required(raw_config, "selector_top_k")))

    def make_layer(self, cfg: Qwen3Config) -> nn.Module:
        return DenseDFlash2DecoderLayer(cfg, kernel_size=self.conv_kernel_size, group_size=self.conv_group_size,
                                        block_size=self.block_size)

    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        """v1's initialization, then: each convolution the identity (base tap 0 all ones, other taps and the dynamic
        projection zero), so training starts from a v1 drafter and every tap still gets a gradient from the shifted
        rows; the successor codebook zero, so the pair term starts at 0 and the first walks pick by logit, while the
        predecessor codebook ~ N(0, 1) (an embedding's scale) and the gate's projection give it a gradient at once."""
        super().init_weights(generator)
        with torch.no_grad():
            for layer in self.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.zero_()
                    conv.base_kernel[:, 0] = 1.0
                    conv.kernel_projection.weight.zero_()
            selector = self.candidate_selector
            selector.predecessor_codebook.normal_(0.0, 1.0, generator=generator)
            selector.successor_codebook.zero_()

    def losses(self, hidden, logits, input_ids, anchors, weights) -> dict[str, torch.Tensor]:
        """v1's ``{"block": ...}`` plus ``"selector"``: ``selector_loss`` with the gold predecessors."""
        labels = block_labels(input_ids, anchors, self.block_size)
        return {**super().losses(hidden, logits, input_ids, anchors, weights),
                "selector": selector_loss(self.candidate_selector, hidden, logits, labels,
                                          block_predecessors(input_ids, anchors, self.block_size), weights)}

    def drafts(self, hidden, logits, input_ids, anchors) -> torch.Tensor:
        return selector_drafts(self.candidate_selector, hidden, logits,
                               block_predecessors(input_ids, anchors, self.block_size))


def block_predecessors(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, K, bs - 1]``: the tokens at ``anchor .. anchor + bs - 2``, each mask position's gold predecessor (the
    anchor, then the label before it): what the greedy walk conditions on whenever its drafts so far are right."""
    offsets = torch.arange(block_size - 1, device=anchors.device)
    return input_ids.gather(1, (anchors[..., None] + offsets).flatten(1)).view(*anchors.shape, block_size - 1)


def candidate_sets(logits: torch.Tensor, labels: torch.Tensor, top_k: int):
    """The selector's training candidates: each position's top ``top_k`` tokens of ``logits`` ``[..., V]`` in
    descending order (the walk's), and the gold ``labels`` ``[...]`` as one more column -> ``(candidates [..., K +
    1], gold index [...], valid [..., K + 1] bool)``. The extra column is valid only where the gold token is not
    among the top K, so the gold token is always a candidate exactly once and the loss can always name it."""
    top = logits.detach().topk(top_k, -1).indices
    present = top == labels[..., None]
    found = present.any(-1)
    candidates = torch.cat([top, labels[..., None]], -1)
    valid = torch.cat([torch.ones_like(present), ~found[..., None]], -1)
    gold = torch.where(found, present.int().argmax(-1), torch.full_like(labels, top_k))
    return candidates, gold, valid


def pair_scores(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, candidates: torch.Tensor,
                predecessors: torch.Tensor) -> torch.Tensor:
    """``CandidateSelector.walk``'s scores for all positions at once, float32 ``[..., C]``: ``candidates`` ``[..., C]``
    scored as their ``logits`` ``[..., V]`` plus ``sum_r pred[prev, r] * h[r] * succ[cand, r]``, ``h`` the
    ``hidden_projection`` of ``hidden`` ``[..., H]`` and ``prev`` the ``predecessors`` ``[...]``."""
    unary = logits.float().gather(-1, candidates)
    pair = selector.predecessor_codebook[predecessors].float() * selector.hidden_projection(hidden).float()
    return unary + (selector.successor_codebook[candidates].float() @ pair[..., None])[..., 0]


def selector_loss(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                  predecessors: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Position-weighted cross entropy of the pair scores (``pair_scores`` over ``candidate_sets``) picking the gold
    candidate, with ``hidden`` ``[B, K, bs - 1, H]``, ``logits`` ``[B, K, bs - 1, V]``, ``labels`` and
    ``predecessors`` ``[B, K, bs - 1]``, ``weights`` ``[bs - 1]``. The gradient reaches the selector and, through the
    unary term, the logits (the drafter learns to rank its candidates as well as to put the gold one among them)."""
    candidates, gold, valid = candidate_sets(logits, labels, selector.top_k)
    scores = pair_scores(selector, hidden, logits, candidates, predecessors).masked_fill(~valid, float("-inf"))
    ce = F.cross_entropy(scores.flatten(0, -2), gold.flatten(), reduction="none").view(labels.shape)
    return weighted_mean(ce, weights)


def selector_drafts(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor,
                    predecessors: torch.Tensor) -> torch.Tensor:
    """``[...]``: each position's best top-K candidate after its gold predecessor, what the greedy walk drafts there
    whenever its drafts before it are right (``draft_accuracy`` then counts the walk's acceptance exactly)."""
    candidates = logits.detach().topk(selector.top_k, -1).indices
    scores = pair_scores(selector, hidden, logits, candidates, predecessors)
    return candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]


def _required(raw: dict, name: str):
    value = draft_value(raw, name)
    if value is None:
        raise ValueError(f"DFlash2 config needs dflash_config.{name}")
    return value
