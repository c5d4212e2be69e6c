"""Drop-in paged attention layer: its own cache buffer and per-layer format, window, causality and sinks."""
from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import nn

import tqops
from tqops.attention.ops import ATTENTION_HEAD_DIMS
from tqops.checks import (FLOAT_DTYPES, check_device, check_has_data, check_same_size, check_scale,
                          check_tensor)

from . import ops  # noqa: F401  (registers the tqops::layer_* ops)


class Attention(nn.Module):
    """``forward(q, k, v)``: store k/v into this layer's paged cache, then attend.

    q ``[num_tokens, num_heads, head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]`` -> ``[num_tokens,
    num_heads, head_dim]``. Per-step metadata comes from the forward context, keyed by ``group``.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        name: str,
        cache_format="bf16",
        causal: bool = True,
        sliding_window: Optional[int] = None,
        sinks: bool = False,
        scale: Optional[float] = None,
        group: int = 0,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ):
        super().__init__()
        if not isinstance(name, str) or not name:
            raise ValueError("Attention needs a non-empty name (it appears in errors and metadata lookups)")
        for arg, val in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(val, bool) or not isinstance(val, numbers.Integral):
                raise TypeError(f"layer {name!r}: {arg} must be an int, got {type(val).__name__} {val!r}")
        if num_kv_heads <= 0 or num_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"layer {name!r}: num_heads={num_heads} must be a positive multiple of "
                             f"num_kv_heads={num_kv_heads}")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window <= 0):
            raise ValueError(f"layer {name!r}: sliding_window must be a positive int or None, got {sliding_window!r}")
        if isinstance(group, bool) or not isinstance(group, numbers.Integral):
            raise TypeError(f"layer {name!r}: group must be a KV-cache group id (an int >= 0), got "
                            f"{type(group).__name__} {group!r}")
        if group < 0:
            raise ValueError(f"layer {name!r}: group must be a KV-cache group id (an int >= 0), got {group}")
        if head_dim not in ATTENTION_HEAD_DIMS:
            raise ValueError(f"layer {name!r}: head_dim={head_dim}; paged attention supports {ATTENTION_HEAD_DIMS}")
        self.fmt = tqops.get_format(cache_format)
        self.fmt.slot_bytes(head_dim)  # validates head_dim for the format
        for arg, val in (("scale", scale), ("k_scale", k_scale), ("v_scale", v_scale)):
            if val is not None:
                check_scale(f"layer {name!r}: {arg}", val)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.name, self.causal, self.sliding_window, self.group = name, bool(causal), sliding_window, int(group)
        self.scale = float(scale) if scale is not None else head_dim**-0.5
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32)) if sinks else None
        # A buffer, so module.to() moves it and CUDA graphs see its in-place mutation; not saved in checkpoints.
        self.register_buffer("kv_cache", torch.zeros(0, dtype=torch.uint8), persistent=False)

    def allocate_cache(self, num_blocks: int, block_size: int, device=None) -> torch.Tensor:
        """Allocate the paged cache; an existing cache of the same geometry is kept (captured graphs point at it)."""
        # Checked here, not at the first forward: by then the step's K/V would already be stored
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, numbers.Integral) or num_blocks < 1:
            raise ValueError(f"layer {self.name!r}: num_blocks must be an int >= 1, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 16 or \
                block_size & (block_size - 1):
            raise ValueError(f"layer {self.name!r}: block_size must be a power of two >= 16 (paged attention's key "
                             f"tiles), got {block_size!r}")
        device = check_device(f"layer {self.name!r}: device", device) if device is not None else self.kv_cache.device
        shape = (num_blocks, block_size, self.num_kv_heads, self.fmt.slot_bytes(self.head_dim))
        same_device = self.kv_cache.device.type == device.type and (
            device.index is None or self.kv_cache.device.index == device.index)
        if tuple(self.kv_cache.shape) != shape or not same_device:
            self.kv_cache = tqops.allocate_kv_cache(self.fmt, num_blocks, block_size, self.num_kv_heads,
                                                    self.head_dim, device=device)
        return self.kv_cache

    def _check_tensor(self, arg: str, t, dtypes=None) -> None:
        """``t`` is a tensor of one of ``dtypes`` on the cache's device (which holds data: ``_require_cache``)."""
        try:
            check_tensor(arg, t, dtypes=dtypes)
            if t.device != self.kv_cache.device:
                check_has_data(arg, t)  # a meta tensor is named as one
                check_tensor(arg, t, device=self.kv_cache.device)
        except (TypeError, ValueError) as e:
            raise type(e)(f"layer {self.name!r}: {e}") from None

    def _check(self, t: torch.Tensor, arg: str, heads: int) -> None:
        self._check_tensor(arg, t, FLOAT_DTYPES)
        if t.dim() != 3 or t.shape[1] != heads or t.shape[2] != self.head_dim:
            raise ValueError(f"layer {self.name!r}: {arg} has shape {tuple(t.shape)}; expected "
                             f"[num_tokens, {heads}, {self.head_dim}]")

    def _counts_message(self, **tensors: torch.Tensor) -> str:
        """The error of token counts that differ. Compiled steps mark the token dim unbacked, and formatting (or even
        type-testing) such a size would specialize it, an error under compile: the counts are named in eager only."""
        names = " and ".join(tensors)
        if not torch.compiler.is_compiling():
            names = ", ".join(f"{arg} {t.shape[0]}" for arg, t in tensors.items())
        return f"layer {self.name!r}: {names} must have one token count (rows of dim 0)"

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check(k, "k", self.num_kv_heads)
        self._check(v, "v", self.num_kv_heads)
        check_same_size(k.shape[0] == v.shape[0], self._counts_message(k=k, v=v))

    def store_context(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store DFlash context rows at the group's ``context_slot_mapping`` (rows with slot -1 are skipped); the
        forward context must hold their ``context_positions``, against which the slots are checked."""
        self._require_cache()
        self._check_kv(k, v)
        torch.ops.tqops.layer_kv_store(k, v, self.kv_cache, self.name, self.group, self.fmt.name,
                                       self.k_scale, self.v_scale, True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Everything attention checks of q is checked before the store: a rejected step leaves the cache as it was.
        self._require_cache()
        self._check(q, "q", self.num_heads)
        self._check(k, "k", self.num_kv_heads)
        self._check(v, "v", self.num_kv_heads)
        counts = self._counts_message(q=q, k=k, v=v)
        check_same_size(q.shape[0] == k.shape[0], counts)
        check_same_size(q.shape[0] == v.shape[0], counts)
        torch.ops.tqops.layer_kv_store(k, v, self.kv_cache, self.name, self.group, self.fmt.name,
                                       self.k_scale, self.v_scale, False)
        return self._attend(q)

    def forward_qkv(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, positions: torch.Tensor,
                    inv_freq: torch.Tensor, eps: float) -> torch.Tensor:
        """``forward`` from a fused projection's output ``qkv`` ``[num_tokens, (num_heads + 2 * num_kv_heads) *
        head_dim]`` with Qwen3's per-head q/k RMSNorm (weights ``[head_dim]``, ``eps``) and RoPE (``positions``
        ``[num_tokens]``, fp32 ``inv_freq`` ``[head_dim // 2]``) in front: the norms, the rotation and the cache store
        run as one op (``tqops.kv.ops.qk_norm_rope_store``), then attention."""
        self._require_cache()
        for arg, t in (("qkv", qkv), ("q_weight", q_weight), ("k_weight", k_weight), ("positions", positions),
                       ("inv_freq", inv_freq)):
            self._check_tensor(arg, t)
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if qkv.dim() != 2 or qkv.shape[1] != width:
            raise ValueError(f"layer {self.name!r}: qkv has shape {tuple(qkv.shape)}; expected [num_tokens, {width}]")
        if inv_freq.dim() != 1 or 2 * inv_freq.shape[0] != self.head_dim:
            raise ValueError(f"layer {self.name!r}: inv_freq has shape {tuple(inv_freq.shape)}; expected "
                             f"[{self.head_dim // 2}]")
        q = torch.ops.tqops.layer_qk_norm_rope_store(
            qkv, q_weight, k_weight, positions, inv_freq, self.num_heads, self.num_kv_heads, float(eps),
            self.kv_cache, self.name, self.group, self.fmt.name, self.k_scale, self.v_scale)
        return self._attend(q)

    def _attend(self, q: torch.Tensor) -> torch.Tensor:
        return torch.ops.tqops.layer_attention(
            q, self.kv_cache, self.name, self.group, self.fmt.name, self.causal, self.sliding_window,
            self.sinks, self.scale, self.k_scale, self.v_scale,
        )

    def _require_cache(self) -> None:
        if self.kv_cache.dim() != 4:
            raise RuntimeError(f"layer {self.name!r} has no KV cache yet: call allocate_cache(num_blocks, block_size)")
        try:
            check_has_data("kv_cache", self.kv_cache)
        except ValueError as e:
            raise ValueError(f"layer {self.name!r}: {e}") from None

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, heads={self.num_heads}/{self.num_kv_heads}, head_dim={self.head_dim}, "
                f"format={self.fmt.name}, causal={self.causal}, window={self.sliding_window}, "
                f"sinks={self.sinks is not None}, group={self.group}")
