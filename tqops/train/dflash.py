"""DFlash drafter for training: one dense forward over many blocks of a sequence, with the z-lab parameter names."""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..models.dflash import draft_value
from ..models.parallel import keep_checkpoint_names
from ..models.qwen3 import Qwen3Config, Qwen3MLP, RMSNorm, qkv_linear, rope_cos_sin
from ..norm.naive import apply_rope

ARCHITECTURE = "DFlashDraftModel"
# Fields a drafter copies from its target's config.json (it runs in the target's hidden space and vocabulary).
SHARED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "hidden_act", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
                 "attention_bias", "initializer_range")


def spread_layer_ids(num_target_layers: int, count: int = 3) -> list[int]:
    """``count`` target layers spread evenly from layer 1 to the last (e.g. [1, 3, 5] of 6)."""
    last = num_target_layers - 1
    first = min(1, last)
    return sorted({round(first + i * (last - first) / max(1, count - 1)) for i in range(count)})


def drafter_config(target: dict, *, num_layers: int, target_layer_ids: Sequence[int], mask_token_id: int,
                   block_size: int = 16) -> dict:
    """A z-lab style DFlash ``config.json`` dict for a drafter of ``num_layers`` full-attention layers."""
    cfg = {k: target[k] for k in SHARED_FIELDS if k in target}
    cfg.update(architectures=[ARCHITECTURE], model_type="qwen3", num_hidden_layers=num_layers,
               layer_types=["full_attention"] * num_layers, tie_word_embeddings=False, use_cache=False,
               block_size=block_size, num_target_layers=target["num_hidden_layers"], dtype="bfloat16",
               dflash_config={"target_layer_ids": [int(i) for i in target_layer_ids],
                              "mask_token_id": int(mask_token_id)})
    return cfg


def positions_rope(positions: torch.Tensor, cfg: Qwen3Config) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for ``positions`` of any shape -> cos, sin ``[*positions.shape, head_dim]`` (fp32)."""
    cos, sin = rope_cos_sin(positions.flatten(), cfg.head_dim, cfg.rope_theta, torch.float32)
    return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` (the inference models' reference RoPE) on ``x`` ``[B, S, heads, head_dim]`` with cos/sin
    ``[B, S, head_dim]``."""
    return apply_rope(x.flatten(0, 1), cos.flatten(0, 1), sin.flatten(0, 1)).unflatten(0, x.shape[:2])


class DenseSelfAttention(nn.Module):
    """Projections (``qkv_proj``, one GEMM, and ``o_proj``) and q/k norms named as in ``Qwen3SelfAttention``;
    attention over given context K/V."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        h, hd, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nkv, hd
        self.qkv_proj = qkv_linear(cfg)
        self.o_proj = nn.Linear(nq * hd, h, bias=cfg.attention_bias)
        self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)
        keep_checkpoint_names(self)

    def kv_heads(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projected keys and values ``[B, S, num_kv_heads * head_dim]`` -> rotated, normed keys and values
        ``[B, S, num_kv_heads, head_dim]``."""
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))
        return rotate(k, cos, sin), v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated, normed keys and values ``[B, S, num_kv_heads, head_dim]`` of rows ``x`` ``[B, S, hidden]``."""
        return self.kv_heads(*self.qkv_proj.forward_parts(x, first=1), cos, sin)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        """Block rows ``x`` ``[B, Q, hidden]`` attend to ``[ctx_k; own keys]`` where ``mask`` ``[B, 1, Q, C + Q]``."""
        q, k, v = self.qkv_proj.forward_parts(x)
        q = rotate(self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim))), cos, sin)
        k, v = self.kv_heads(k, v, cos, sin)
        k, v = torch.cat([ctx_k, k.to(ctx_k.dtype)], 1), torch.cat([ctx_v, v.to(ctx_v.dtype)], 1)
        rep = self.num_heads // self.num_kv_heads
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, rows, head_dim]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DenseDecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.self_attn = DenseSelfAttention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """``[B, 1, K * bs, context_len + K * bs]`` bool (True: attend) for blocks at ``anchors`` ``[B, K]``: a row of
    block k sees context rows ``j < anchors[:, k]`` and the rows of block k, nothing else."""
    B, K = anchors.shape
    ctx = torch.arange(context_len, device=anchors.device)[None, None, :] < anchors[:, :, None]
    ctx = ctx.repeat_interleave(block_size, dim=1)
    block = torch.arange(K * block_size, device=anchors.device) // block_size
    own = (block[:, None] == block[None, :]).expand(B, -1, -1)
    return torch.cat([ctx, own], -1)[:, None]


class DenseDFlashDrafter(nn.Module):
    """``forward(target_states [B, T, C], input_ids [B, T], anchors [B, K], embed)`` -> hidden ``[B, K, bs, H]``.

    Computes what ``tqops.models.DFlashDrafter`` computes at inference for a block whose first token sits at position
    ``anchor``: the context rows are the target's states at positions ``0 .. anchor - 1``; each layer projects the
    same ``hidden_norm(fc(states))`` rows to K/V (k_norm, RoPE at the row's position, no input layernorm); the block's
    rows (``[token at anchor, mask x (bs - 1)]`` at positions ``anchor .. anchor + bs - 1``) project their own K/V
    from the layer input; every block row attends to all of its context and its whole block (non-causal). The K
    blocks of a sequence share one SDPA call through a boolean mask over ``[context rows; block rows]``.

    ``state_dict()`` names are the z-lab checkpoint names (``fc``, ``hidden_norm``, ``layers.N.*``, ``norm``); the
    target's embedding and lm_head are passed in, never owned.
    """

    def __init__(self, raw_config: dict):
        super().__init__()
        self.raw_config = dict(raw_config)
        cfg = self.config = Qwen3Config.from_dict(raw_config)
        self.target_layer_ids = tuple(int(i) for i in draft_value(raw_config, "target_layer_ids", ()))
        self.mask_token_id = int(draft_value(raw_config, "mask_token_id"))
        self.block_size = int(draft_value(raw_config, "block_size", 16))
        self.input_embedding_scale = float(draft_value(raw_config, "input_embedding_scale", 1.0))
        if any(t != "full_attention" for t in cfg.layer_types) or draft_value(raw_config, "is_causal"):
            raise ValueError("the dense drafter models non-causal full-attention layers only")
        self.fc = nn.Linear(len(self.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.make_layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_layer(self, cfg: Qwen3Config) -> nn.Module:
        """One decoder layer (a subclass's hook: DFlash2's layers add their convolutions)."""
        return DenseDecoderLayer(cfg)

    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        """Matrices ~ N(0, initializer_range) as transformers initializes Qwen3; norm gains 1."""
        std = float(self.raw_config.get("initializer_range", 0.02))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, std, generator=generator)
                elif name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()

    def block_ids(self, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """``[B, K, bs]``: the token at each anchor, then mask tokens."""
        ids = torch.full((*anchors.shape, self.block_size), self.mask_token_id, dtype=input_ids.dtype,
                         device=input_ids.device)
        ids[..., 0] = input_ids.gather(1, anchors)
        return ids

    def forward(self, target_states: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        B, T = input_ids.shape
        K, bs = anchors.shape[1], self.block_size
        ctx = self.hidden_norm(self.fc(target_states.to(self.fc.weight.dtype)))
        # the residual stream in the drafter's own dtype (fp32 master weights in training), not the embedding's
        x = embed(self.block_ids(input_ids, anchors)).flatten(1, 2).to(self.fc.weight.dtype)
        if self.input_embedding_scale != 1.0:
            x = x * self.input_embedding_scale
        ctx_cos, ctx_sin = positions_rope(torch.arange(T, device=anchors.device).expand(B, T), self.config)
        cos, sin = positions_rope((anchors[..., None] + torch.arange(bs, device=anchors.device)).flatten(1),
                                  self.config)
        mask = block_mask(anchors, T, bs)
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.kv(ctx, ctx_cos, ctx_sin)
            x = layer(x, cos, sin, ctx_k, ctx_v, mask)
        return self.norm(x).unflatten(1, (K, bs))

    def losses(self, hidden: torch.Tensor, logits: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
               weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named training losses of the mask rows' ``hidden`` ``[B, K, bs - 1, H]`` and ``logits`` ``[B, K,
        bs - 1, V]`` for blocks at ``anchors`` ``[B, K]`` of ``input_ids`` ``[B, T]``: here ``{"block": ...}``."""
        return {"block": block_loss(logits, block_labels(input_ids, anchors, self.block_size), weights)}

    def drafts(self, hidden: torch.Tensor, logits: torch.Tensor, input_ids: torch.Tensor,
               anchors: torch.Tensor) -> torch.Tensor:
        """``[B, K, bs - 1]``: the tokens a greedy step drafts after the gold prefix (v1: each position's argmax)."""
        return logits.argmax(-1)


def sample_anchors(batch: int, seq_len: int, count: int, block_size: int, device=None,
                   generator: Optional[torch.Generator] = None, bounds: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[batch, count]`` distinct sorted anchors per row in ``[1, seq_len - block_size]``: every block has at least
    one context row (a prompt has at least one token) and its last label inside the sequence. ``bounds``
    ``[batch, 2]`` (optional) narrows each row to its own ``[first, last]`` anchors (see
    ``distill.greedy_anchor_range``)."""
    choices = seq_len - block_size
    if not 1 <= count <= choices:
        raise ValueError(f"{count} blocks of {block_size} do not fit distinct anchors in {seq_len} tokens")
    scores = torch.rand(batch, choices, generator=generator, device=generator.device if generator else device)
    if bounds is not None:
        first, last = bounds.to(scores.device).clamp(1, choices).unbind(-1)
        if int((last - first).min()) + 1 < count:
            raise ValueError(f"{count} blocks do not fit distinct anchors between {bounds.tolist()}")
        positions = torch.arange(1, choices + 1, device=scores.device)[None]
        outside = (positions < first[:, None]) | (positions > last[:, None])
        scores = scores.masked_fill(outside, 2.0)  # sorted after every allowed anchor
    return (scores.argsort(-1)[:, :count].sort(-1).values + 1).to(device)


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, K, bs - 1]``: the tokens at ``anchor + 1 .. anchor + bs - 1``, what the mask rows should predict."""
    offsets = torch.arange(1, block_size, device=anchors.device)
    return input_ids.gather(1, (anchors[..., None] + offsets).flatten(1)).view(*anchors.shape, block_size - 1)


def position_weights(block_size: int, decay: float, device=None) -> torch.Tensor:
    """Loss weight of prediction k = 1 .. bs - 1: ``exp(-(k - 1) / decay)`` (DFlash's decay toward early positions:
    a draft only counts if all before it are accepted); uniform when ``decay <= 0``."""
    k = torch.arange(block_size - 1, dtype=torch.float32, device=device)
    return torch.exp(-k / decay) if decay > 0 else torch.ones_like(k)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over blocks of the ``weights``-weighted mean over positions of ``values`` ``[B, K, bs - 1]``."""
    return (values * weights).sum() / (weights.sum() * math.prod(values.shape[:2]))


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Position-weighted cross entropy of ``logits`` ``[B, K, bs - 1, V]`` against ``labels`` ``[B, K, bs - 1]``."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none").view(labels.shape)
    return weighted_mean(ce, weights)


def draft_accuracy(drafts: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accuracy per position ``[bs - 1]``, mean accepted length per block counting the bonus token) of ``drafts``
    ``[B, K, bs - 1]`` when the verifier's choices are ``labels``. A draft counts only after a right prefix, so
    ``drafts`` made after the gold prefix (teacher forcing) give the greedy loop's acceptance exactly."""
    hit = (drafts == labels).float()
    return hit.flatten(0, 1).mean(0), hit.cumprod(-1).sum(-1).mean() + 1


def block_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``draft_accuracy`` of the argmax drafts of ``logits`` ``[B, K, bs - 1, V]``."""
    return draft_accuracy(logits.argmax(-1), labels)
