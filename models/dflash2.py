"""DFlash2 drafter (z-lab's ``DFlash2DraftModel``): DFlash plus a grouped dynamic causal convolution around each
layer's attention and MLP, and a candidate selector that walks the block's top-K candidates."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .dflash import ARCHITECTURES, DFlashDrafter, draft_value
from .qwen3 import Qwen3Config, Qwen3DecoderLayer

# The published checkpoints keep the selector's codebooks as bare tensors; transformers' save_pretrained of z-lab's
# class (nn.Embedding modules) writes them with a ``.weight`` suffix. Both spellings load.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def grouped_dynamic_causal_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                                block_size: int) -> torch.Tensor:
    """A causal convolution over each block of packed ``x`` ``[n = blocks * block_size, hidden]``, zero across the
    block boundary: ``out[t] = sum_o (base[o] + dynamic[t, o, g]) * x[t - o]`` for the taps ``o < kernel`` with
    ``t - o`` in ``t``'s block, where channel ``c`` is in group ``g = c // group_size``.

    ``dynamic`` ``[n, kernel, hidden // group_size]`` is the per-position correction (one value per group), ``base``
    ``[kernel, hidden]`` the per-channel kernel. Accumulates in float32; returns ``x``'s dtype."""
    torch._check(x.shape[0] % block_size == 0)
    kernel, hidden = base.shape
    groups = hidden // group_size
    blocks = x.float().unflatten(0, (-1, block_size)).unflatten(-1, (groups, group_size))  # [B, bs, G, gs]
    dyn = dynamic.float().unflatten(0, (-1, block_size))  # [B, bs, K, G]
    base = base.float().view(kernel, groups, group_size)
    out = torch.zeros_like(blocks)
    for o in range(min(kernel, block_size)):  # taps reaching before the block see zeros
        shifted = blocks if o == 0 else F.pad(blocks[:, :-o], (0, 0, 0, 0, o, 0))
        out = out + (base[o] + dyn[:, :, o, :, None]) * shifted
    return out.flatten(-2).flatten(0, 1).to(x.dtype)


class GroupedDynamicCausalConv(nn.Module):
    """z-lab's ``GroupedDynamicCausalConv`` on tqops' packed layout (``attention_conv`` / ``mlp_conv``).

    ``base_kernel`` ``[2, kernel, hidden]`` (the first for ``prepare``, the second for ``finish``) and
    ``kernel_projection`` ``hidden -> 2 * kernel * groups``. ``prepare(x)`` convolves the sublayer's input with the
    first base kernel plus the per-position correction projected from ``x`` itself, and returns the second
    correction, which ``finish`` applies with the second base kernel to the sublayer's output. Both convolve each
    block of ``block_size`` rows on its own (``grouped_dynamic_causal_conv``)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        if kernel_size < 1 or group_size < 1 or hidden_size % group_size:
            raise ValueError(f"DFlash2 conv needs conv_kernel_size >= 1 and conv_group_size dividing hidden_size "
                             f"({hidden_size}), got {kernel_size} and {group_size}")
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Both base kernels the identity (tap 0 ones, later taps zeros), so a drafter built without a checkpoint
        (``DFlash2Drafter(config, target=...)``) starts from its dynamic correction alone instead of whatever memory
        ``torch.empty`` held; ``kernel_projection`` keeps ``nn.Linear``'s init."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[n, hidden]`` -> (the convolved sublayer input, ``finish``'s correction ``[n, kernel, groups]``)."""
        dynamic = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))
        out = grouped_dynamic_causal_conv(x, dynamic[:, 0], self.base_kernel[0], self.group_size, self.block_size)
        return out, dynamic[:, 1]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """The sublayer's output ``[n, hidden]`` convolved with the second base kernel plus ``prepare``'s correction."""
        return grouped_dynamic_causal_conv(x, dynamic, self.base_kernel[1], self.group_size, self.block_size)


class SelectedDrafts(NamedTuple):
    """A DFlash2 drafter step's proposal: ``tokens`` ``[n, k]`` (``k = block_size - 1``), the walk's distribution
    over each position's candidates ``q`` ``[n, k, K]`` float32 (None when greedy), and the candidates ``[n, k, K]``."""

    tokens: torch.Tensor
    q: Optional[torch.Tensor]
    candidates: torch.Tensor


class CandidateSelector(nn.Module):
    """z-lab's ``CandidateSelector``: the top ``top_k`` candidates of each block position, adjacent pairs scored as
    the candidate's unary logit plus ``sum_r pred[prev, r] * h[pos, r] * succ[cand, r]`` (``pred``/``succ`` the
    rank-``rank`` codebooks, ``h = hidden_projection(hidden)`` the position's gate), walked from the anchor.

    ``walk`` loops over the block's positions in torch ops (no host sync), batched over rows, so it compiles with
    ``fullgraph=True`` and captures. Greedy takes each position's best candidate; at temperature > 0 it samples
    ``softmax(scores / temperature)`` by inverse CDF from given uniforms, so the caller's generator alone decides
    the draws (a captured step reads them from a static buffer). Candidates are in descending logit order."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        if rank < 1 or not 1 <= top_k <= vocab_size:
            raise ValueError(f"DFlash2 selector needs selector_rank >= 1 and 1 <= selector_top_k <= vocab_size "
                             f"({vocab_size}), got {rank} and {top_k}")
        self.rank, self.top_k = rank, top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Codebooks ~ N(0, 1), ``nn.Embedding``'s init (z-lab's class keeps them as embeddings): a drafter built
        without a checkpoint is random but defined, seeded by ``torch.manual_seed``."""
        nn.init.normal_(self.predecessor_codebook)
        nn.init.normal_(self.successor_codebook)

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor, temperature: float,
             uniforms: Optional[torch.Tensor] = None) -> SelectedDrafts:
        """``hidden`` ``[n, k, hidden]`` and ``logits`` ``[n, k, V]`` of the mask positions, ``anchors`` ``[n]`` (each
        block's first token), ``uniforms`` ``[n, k]`` in [0, 1) when ``temperature > 0``."""
        if temperature > 0 and uniforms is None:
            raise ValueError(f"uniforms is None at temperature={temperature}: the sampled walk reads one uniform per "
                             "mask position ([n, k] in [0, 1)), drawn by the caller from its generator")
        unary, candidates = torch.topk(logits.float(), self.top_k, dim=-1)  # [n, k, K]
        gate = self.hidden_projection(hidden).float()  # [n, k, r]
        succ = self.successor_codebook[candidates].float()  # [n, k, K, r]
        pred_table = self.predecessor_codebook
        prev, path, qs = anchors, [], []
        for j in range(logits.shape[1]):
            pair = pred_table[prev].float() * gate[:, j]  # [n, r]
            scores = unary[:, j] + (succ[:, j] @ pair[:, :, None])[..., 0]  # [n, K]
            if temperature > 0:
                q = torch.softmax(scores / temperature, -1)
                cdf = q.cumsum(-1)
                # the first index whose cdf exceeds u * total: never past the last candidate with q > 0
                index = (cdf <= uniforms[:, j, None] * cdf[:, -1:]).sum(-1)
                qs.append(q)
            else:
                index = scores.argmax(-1)
            prev = candidates[:, j].gather(-1, index[:, None])[:, 0]
            path.append(prev)
        return SelectedDrafts(torch.stack(path, 1), torch.stack(qs, 1) if qs else None, candidates)


class DFlash2DecoderLayer(Qwen3DecoderLayer):
    """A drafter layer with ``attention_conv`` around attention and ``mlp_conv`` around the MLP (z-lab's order:
    norm, ``prepare``, sublayer, ``finish``, residual add). The norms run unfused here, since the convolution sits
    between each norm and its projection; the interface is ``Qwen3DecoderLayer``'s, so ``run_layers`` runs it."""

    def __init__(self, cfg: Qwen3Config, i: int, *, kernel_size: int, group_size: int, block_size: int, **kwargs):
        super().__init__(cfg, i, **kwargs)
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, kernel_size, group_size, block_size)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, kernel_size, group_size, block_size)

    def forward(self, x, residual, positions, inv_freq):
        stream = x if residual is None else x + residual
        h, kernel = self.attention_conv.prepare(self.input_layernorm(stream))
        a = self.attention_conv.finish(self.self_attn(h, positions, inv_freq), kernel)
        residual = stream + a
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(residual))
        return self.mlp_conv.finish(self.mlp(h), kernel), residual, stream


class DFlash2Drafter(DFlashDrafter):
    """A DFlash2 drafter: ``DFlashDrafter`` (the same context injection, paged caches, block pass and loading
    rules) with ``DFlash2DecoderLayer``s and a ``candidate_selector``.

    A subclass rather than a config switch inside ``DFlashDrafter``: v1 keeps its fused layers and its step output
    (draft logits) untouched, and everything DFlash2 adds lives here. ``DFlashDrafter.from_pretrained`` builds this
    class for a config whose ``architectures`` names ``DFlash2DraftModel``; ``dflash_config`` (or the top level)
    gives ``conv_kernel_size``, ``conv_group_size``, ``selector_rank`` and ``selector_top_k``.

    ``propose`` (the drafter step's head, eager, compiled and captured alike) walks the selector inside the step and
    returns ``SelectedDrafts``; so the step depends on the temperature (``selects_in_step``), and at temperature > 0
    it takes one uniform per token (``generate`` draws them from its generator)."""

    selects_in_step = True

    def __init__(self, config: Qwen3Config, **kwargs):
        raw = config.raw
        self.conv_kernel_size = int(_required(raw, "conv_kernel_size"))
        self.conv_group_size = int(_required(raw, "conv_group_size"))
        super().__init__(config, **kwargs)
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size,
                                                    int(_required(raw, "selector_rank")),
                                                    int(_required(raw, "selector_top_k")))

    def make_layer(self, config: Qwen3Config, i: int, **kwargs) -> Qwen3DecoderLayer:
        return DFlash2DecoderLayer(config, i, kernel_size=self.conv_kernel_size, group_size=self.conv_group_size,
                                   block_size=self.block_size, **kwargs)

    def propose(self, hidden: torch.Tensor, input_ids: torch.Tensor, temperature: float = 0.0,
                uniforms: Optional[torch.Tensor] = None) -> SelectedDrafts:
        """``forward``'s ``hidden`` ``[n * bs, hidden]`` of blocks ``input_ids`` ``[n * bs]`` -> the selector's walk
        from each block's first token over the mask positions; ``uniforms`` ``[n * bs]`` (temperature > 0; each
        block's first is unused)."""
        bs = self.block_size
        torch._check(hidden.shape[0] % bs == 0)
        masks = hidden.unflatten(0, (-1, bs))[:, 1:]
        anchors = input_ids.unflatten(0, (-1, bs))[:, 0]
        u = None if uniforms is None else uniforms.unflatten(0, (-1, bs))[:, 1:]
        return self.candidate_selector.walk(masks, self.compute_logits(masks), anchors, temperature, u)

    def checkpoint_rules(self) -> dict:
        """``DFlashDrafter``'s rules, and the codebooks' ``.weight`` spelling (z-lab's ``save_pretrained``) read as the
        published bare names."""
        return dict(super().checkpoint_rules(),
                    rename=lambda n: n[:-7] if n.endswith(".weight") and n[:-7] in CODEBOOKS else n)


def _required(raw, name: str):
    value = draft_value(raw, name)
    if value is None:
        raise ValueError(f"DFlash2 config needs dflash_config.{name}")
    return value


ARCHITECTURES["DFlash2DraftModel"] = DFlash2Drafter
