"""DFlash drafter (z-lab layout): Qwen3 layers over injected target context, one non-causal pass per block."""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import nn

from ..formats import layer_formats
from ..graphs import Attention, context_positions, context_states

from .loading import build_empty, load_weights, read_config
from .parallel import TensorParallel, row_linear, shard_hook
from .qwen3 import Qwen3Config, Qwen3DecoderLayer, RMSNorm, RotaryFrequencies, run_layers


def draft_value(raw: Mapping, name: str, default=None):
    """A DFlash setting: ``dflash_config[name]``, else the top-level ``name``, else ``default``."""
    value = (raw.get("dflash_config") or {}).get(name, raw.get(name))
    return default if value is None else value


DFLASH2_ARCHITECTURE = "DFlash2DraftModel"


# Drafter classes by the architecture a checkpoint's config.json declares, besides DFlashDrafter itself; a subclass's
# module registers it (models/__init__.py imports them all), so from_pretrained dispatches without importing them.
ARCHITECTURES: dict[str, type] = {}


def is_dflash2(raw: Mapping) -> bool:
    """Whether a drafter ``config.json`` declares z-lab's DFlash2 (``architectures: ["DFlash2DraftModel"]``)."""
    return DFLASH2_ARCHITECTURE in (raw.get("architectures") or ())


class DFlashDrafter(nn.Module):
    """``forward(input_ids [n], positions [n])`` -> hidden ``[n, hidden]`` of a packed batch of query blocks.

    Each step's context rows come from the forward context (``context_states`` ``[n, len(target_layer_ids) *
    hidden]``, ``context_positions`` ``[n]``, the group's ``context_slot_mapping``): every layer projects
    ``hidden_norm(fc(states))`` to K/V (k_norm, RoPE at the rows' positions) and stores them in its own paged cache,
    then the block attends to all context plus itself (non-causal; sliding layers causal unless ``is_causal`` says
    otherwise). ``embed_tokens`` and ``lm_head`` are the target's modules, shared.

    Tensor parallelism (``tp_group``, by default the target's): the layers split as the target's, and ``fc`` is
    row-parallel over the context features (each rank projects its slice of the replicated context states, then one
    all-reduce), so every rank feeds the same ``hidden_norm`` input to its own KV heads.

    ``propose`` is the drafter step's head (``models.steps.drafter_step``): here the draft logits of the mask
    positions, from which ``generate`` picks the drafts. DFlash2 checkpoints load as ``DFlash2Drafter``
    (``models/dflash2.py``), whose step walks its candidate selector instead (``selects_in_step``).
    """

    #: whether ``propose`` chooses the drafts itself (DFlash2: its step depends on the temperature), or returns
    #: logits for the loop to pick from (v1: one step for every temperature)
    selects_in_step = False

    def __init__(self, config: Qwen3Config, *, cache_format: str = "bf16",
                 layer_cache_formats: Optional[Mapping[int, str]] = None, target: Optional[nn.Module] = None,
                 tp_group=None):
        super().__init__()
        raw = config.raw
        if is_dflash2(raw) and not self.selects_in_step:
            raise ValueError(f"the config declares {DFLASH2_ARCHITECTURE}: build it with tqops.models.DFlash2Drafter "
                             f"or load it with DFlashDrafter.from_pretrained")
        self.config = config
        target_tp = getattr(target, "tp", None)
        self.tp = TensorParallel.of(tp_group) if tp_group is not None else target_tp
        self.target_layer_ids = tuple(int(i) for i in draft_value(raw, "target_layer_ids", ()))
        if not self.target_layer_ids:
            raise ValueError("DFlash config needs dflash_config.target_layer_ids")
        if draft_value(raw, "mask_token_id") is None:
            raise ValueError("DFlash config needs dflash_config.mask_token_id")
        self.mask_token_id = int(draft_value(raw, "mask_token_id"))
        self.block_size = int(draft_value(raw, "block_size", 16))
        if self.block_size < 2:  # a block is the last token plus at least one mask token to draft
            raise ValueError(f"DFlash config block_size must be >= 2, got {self.block_size}")
        self.input_embedding_scale = float(draft_value(raw, "input_embedding_scale", 1.0))
        self.output_multiplier = float(draft_value(raw, "output_multiplier", 1.0))
        self.final_logit_softcapping = float(draft_value(raw, "final_logit_softcapping", 0.0))
        self.context_dim = len(self.target_layer_ids) * config.hidden_size
        is_causal = draft_value(raw, "is_causal")
        formats = layer_formats(config.num_hidden_layers, cache_format, layer_cache_formats)
        self.layers = nn.ModuleList(
            self.make_layer(config, i, name=f"dflash.layers.{i}.self_attn", cache_format=fmt,
                            causal=(t == "sliding_attention") if is_causal is None else bool(is_causal), tp=self.tp)
            for i, (fmt, t) in enumerate(zip(formats, config.layer_types))
        )
        fc_part = self.tp.features(self.context_dim) if self.tp is not None else None
        self.fc = row_linear(self.context_dim, config.hidden_size, fc_part, bias=False, tp=self.tp,
                             input_is_split=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryFrequencies(config.head_dim, config.rope_theta)
        self.register_module("embed_tokens", None)
        self.register_module("lm_head", None)
        if target is not None:
            self.share_target(target)

    def make_layer(self, config: Qwen3Config, i: int, **kwargs) -> Qwen3DecoderLayer:
        """Decoder layer ``i`` (a subclass's hook: DFlash2's layers add their convolutions)."""
        return Qwen3DecoderLayer(config, i, **kwargs)

    def share_target(self, target: nn.Module) -> None:
        """Use the target's ``embed_tokens`` and ``lm_head`` (shared modules, not copies)."""
        tcfg = target.config
        if tcfg.hidden_size != self.config.hidden_size or tcfg.vocab_size != self.config.vocab_size:
            raise ValueError(f"drafter (hidden {self.config.hidden_size}, vocab {self.config.vocab_size}) does not fit "
                             f"the target (hidden {tcfg.hidden_size}, vocab {tcfg.vocab_size})")
        if max(self.target_layer_ids) >= tcfg.num_hidden_layers or min(self.target_layer_ids) < 0:
            raise ValueError(f"target_layer_ids {self.target_layer_ids} out of range for a "
                             f"{tcfg.num_hidden_layers}-layer target")
        if not 0 <= self.mask_token_id < tcfg.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary ({tcfg.vocab_size})")
        target_tp = getattr(target, "tp", None)
        if self.tp != target_tp:
            raise ValueError(f"drafter is split over {self.tp.size if self.tp else 1} rank(s), the target over "
                             f"{target_tp.size if target_tp else 1} (or another group): use the target's tp_group")
        self.embed_tokens, self.lm_head = target.model.embed_tokens, target.lm_head

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def allocate_cache(self, num_blocks: int, block_size: int, device=None) -> None:
        for attn in self.attention_layers:
            attn.allocate_cache(num_blocks, block_size, device)

    def _store_context(self, like: torch.Tensor) -> None:
        """Project this step's injected context rows to K/V and store them in every layer's cache."""
        ctx = self.hidden_norm(self.fc(context_states(like, self.context_dim, self.fc.weight.dtype)))
        positions = context_positions(like)
        for layer in self.layers:
            layer.self_attn.attn.store_context(*layer.self_attn.kv(ctx, positions, self.rotary_emb.inv_freq))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``positions`` ``[n]``: per sequence its last token, then mask tokens -> ``[n, hidden]``."""
        torch._check(positions.shape[0] == input_ids.shape[0])
        self._store_context(input_ids)
        x = self.embed_tokens(input_ids)
        if self.input_embedding_scale != 1.0:
            x = x * self.input_embedding_scale
        return run_layers(self.layers, self.norm, x, positions, self.rotary_emb.inv_freq)[0]

    def prefill_context(self, like: torch.Tensor) -> None:
        """Store ``like.shape[0]`` context rows (a prompt's target states) without running any queries."""
        self._store_context(like)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., vocab]`` through the shared lm_head, output multiplier and softcap."""
        logits = self.lm_head(hidden)
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        if self.final_logit_softcapping > 0:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

    def propose(self, hidden: torch.Tensor, input_ids: torch.Tensor, temperature: float = 0.0,
                uniforms: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``forward``'s ``hidden`` ``[n * bs, hidden]`` -> draft logits ``[n, bs - 1, V]`` float32 of the mask
        positions (``temperature`` and ``uniforms`` are unused here: ``generate`` picks the drafts from them)."""
        torch._check(hidden.shape[0] % self.block_size == 0)  # the token dim may be unbacked under compile
        return self.compute_logits(hidden.unflatten(0, (-1, self.block_size))[:, 1:]).float()

    def checkpoint_rules(self) -> dict:
        """``load_weights``' ``ignore`` and ``optional`` for a DFlash checkpoint: ``rotary_emb.inv_freq`` is made
        here; the embedding and lm_head come from the target (``share_target``), not the checkpoint."""
        return dict(ignore=lambda n: n.endswith("rotary_emb.inv_freq"), optional=())

    @classmethod
    def from_pretrained(cls, path, *, target: nn.Module, cache_format: str = "bf16", layer_cache_formats=None,
                        dtype: Optional[torch.dtype] = None, device=None) -> "DFlashDrafter":
        """Load a z-lab DFlash checkpoint (no ``model.`` prefix); dtype and device default to the target's. A
        tensor-parallel target gives the drafter its group, and each rank reads only its part of the weights. A
        config declaring ``DFlash2DraftModel`` builds a ``DFlash2Drafter`` (from either class)."""
        if not isinstance(target, nn.Module):
            raise TypeError(f"target must be the target model (an nn.Module whose embed_tokens and lm_head the drafter "
                            f"shares), got {type(target).__name__}")
        raw = read_config(path)
        if is_dflash2(raw) and not cls.selects_in_step:
            cls = ARCHITECTURES["DFlash2DraftModel"]
        config = Qwen3Config.from_dict(raw)
        ref = target.lm_head.weight
        tp = getattr(target, "tp", None)
        drafter = build_empty(lambda: cls(config, cache_format=cache_format, layer_cache_formats=layer_cache_formats,
                                          tp_group=tp.group if tp is not None else None),
                              dtype or ref.dtype, device or ref.device)
        load_weights(drafter, path, **drafter.checkpoint_rules(), shard=shard_hook(drafter) if tp is not None else None)
        drafter.share_target(target)
        return drafter.eval()
