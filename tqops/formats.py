"""Cache formats: names and per-slot byte layout (``tqops.allocate_kv_cache`` allocates a cache of one)."""
from __future__ import annotations

import dataclasses
import numbers
from typing import Mapping, Optional, Union

import torch

FORMATS = (
    "bf16",
    "fp16",
    "fp8_e4m3",
    "fp8_e5m2",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
)

# TurboQuant needs a power-of-two head_dim for the Walsh-Hadamard rotation, and 16 | head_dim for 3-bit packing
# (16-code chunks).
TURBOQUANT_HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class CacheFormat:
    """How one token of one KV head is laid out in a cache slot.

    A slot is ``slot_bytes(head_dim)`` bytes: the key region followed by the value region.

    key_mode:   "dense" (bf16/fp16 bits), "fp8" (one fp8 byte per element, times k_scale) or
                "mse" (packed Lloyd-Max codes of the rotated unit vector, then an fp16 norm).
    value_mode: "dense", "fp8" (times v_scale) or "uniform" (packed b-bit codes, then fp16 scale
                and fp16 zero point: v = zero + code * scale).
    """

    name: str
    key_mode: str
    key_bits: int
    value_mode: str
    value_bits: int
    norm_correction: bool = False

    # ---- dtypes -------------------------------------------------------------------------
    @property
    def dense_dtype(self) -> Optional[torch.dtype]:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    @property
    def fp8_dtype(self) -> Optional[torch.dtype]:
        if self.name == "fp8_e5m2":
            return torch.float8_e5m2
        if self.key_mode == "fp8" or self.value_mode == "fp8":
            return torch.float8_e4m3fn
        return None

    @property
    def is_turboquant(self) -> bool:
        return self.name.startswith("turboquant")

    # ---- byte layout (all offsets in bytes from the start of the slot) ---------------------
    def key_code_bytes(self, head_dim: int) -> int:
        return head_dim * self.key_bits // 8

    def key_bytes(self, head_dim: int) -> int:
        return self.key_code_bytes(head_dim) + (2 if self.key_mode == "mse" else 0)

    def key_norm_offset(self, head_dim: int) -> int:
        """Offset of the fp16 key norm (mse keys only); always even."""
        return self.key_code_bytes(head_dim)

    def value_offset(self, head_dim: int) -> int:
        return self.key_bytes(head_dim)

    def value_code_bytes(self, head_dim: int) -> int:
        return head_dim * self.value_bits // 8

    def value_bytes(self, head_dim: int) -> int:
        return self.value_code_bytes(head_dim) + (4 if self.value_mode == "uniform" else 0)

    def value_scale_offset(self, head_dim: int) -> int:
        """Offset of the fp16 value scale (uniform values only); the fp16 zero point follows it."""
        return self.value_offset(head_dim) + self.value_code_bytes(head_dim)

    def slot_bytes(self, head_dim: int) -> int:
        """Bytes per token per KV head, K and V together."""
        self.check_head_dim(head_dim)
        return self.key_bytes(head_dim) + self.value_bytes(head_dim)

    def check_head_dim(self, head_dim: int) -> None:
        if self.is_turboquant:
            if head_dim not in TURBOQUANT_HEAD_DIMS:
                raise ValueError(
                    f"head_dim={head_dim} is not supported by cache format {self.name!r}; "
                    f"expected one of {TURBOQUANT_HEAD_DIMS}"
                )
        elif not (isinstance(head_dim, int) and head_dim > 0 and head_dim % 8 == 0):
            raise ValueError(f"head_dim={head_dim} must be a positive multiple of 8 for format {self.name!r}")


_SPECS = {
    "bf16": CacheFormat("bf16", "dense", 16, "dense", 16),
    "fp16": CacheFormat("fp16", "dense", 16, "dense", 16),
    "fp8_e4m3": CacheFormat("fp8_e4m3", "fp8", 8, "fp8", 8),
    "fp8_e5m2": CacheFormat("fp8_e5m2", "fp8", 8, "fp8", 8),
    "turboquant_k8v4": CacheFormat("turboquant_k8v4", "fp8", 8, "uniform", 4),
    "turboquant_4bit_nc": CacheFormat("turboquant_4bit_nc", "mse", 4, "uniform", 4, norm_correction=True),
    "turboquant_k3v4_nc": CacheFormat("turboquant_k3v4_nc", "mse", 3, "uniform", 4, norm_correction=True),
    "turboquant_3bit_nc": CacheFormat("turboquant_3bit_nc", "mse", 3, "uniform", 3, norm_correction=True),
}
assert tuple(_SPECS) == FORMATS


def get_format(fmt: Union[str, CacheFormat]) -> CacheFormat:
    """Return the CacheFormat for a name (or pass a CacheFormat through)."""
    if isinstance(fmt, CacheFormat):
        return fmt
    if not isinstance(fmt, str) or fmt not in _SPECS:
        raise ValueError(f"unknown cache format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return _SPECS[fmt]


def layer_formats(num_layers: int, cache_format: Union[str, CacheFormat],
                  overrides: Optional[Mapping[int, Union[str, CacheFormat]]]) -> list:
    """Per-layer cache formats (as given, names or CacheFormats): ``cache_format`` everywhere but ``overrides``
    ``{layer index (negative from the end): format}``, the models' and ``tqops.hf.PagedKVCache``'s
    ``layer_cache_formats``."""
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(f"layer_cache_formats must be a dict {{layer index: format}} or None, got "
                        f"{type(overrides).__name__}")
    formats, seen = [cache_format] * num_layers, {}
    for i, fmt in (overrides or {}).items():
        # Int keys only: this is a Python argument, not read from a config file, so a JSON-loaded dict is converted
        # by its caller ({int(k): v}) rather than guessed at here.
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise ValueError(f"layer_cache_formats keys must be int layer indices, got {i!r}")
        if not -num_layers <= i < num_layers:
            raise IndexError(f"layer_cache_formats has key {i}, but the model has {num_layers} layers")
        # e.g. 0 and -n with different formats: one would silently win (the same format twice is fine: "the first
        # two and the last two layers" overlap on a model of fewer than four)
        if i % num_layers in seen and get_format(formats[i]) != get_format(fmt):
            raise ValueError(f"layer_cache_formats keys {seen[i % num_layers]} and {i} both name layer "
                             f"{i % num_layers}, with different formats ({formats[i]!r}, {fmt!r})")
        seen.setdefault(i % num_layers, i)
        formats[i] = fmt
    return formats
