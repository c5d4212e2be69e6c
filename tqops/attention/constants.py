"""The device constants every attention backend reads: SM counts, rotation signs, codebooks and their byte pairs.

Each is made once per device and kept in an ``lru_cache``; ``tqops.device_constants.prepare`` makes them when a cache
is allocated, so none is first made inside a captured step.
"""
from __future__ import annotations

import functools

import torch

from ..quant import lloyd_max, rotation_signs as _signs
from ..quant.rotation import _rotation_on

LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: scores are scaled by log2(e)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def centroids(bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Lloyd-Max levels in the score operand's dtype (fp16 on GPU), so a gather needs no conversion."""
    return lloyd_max(bits)[0].to(dtype).to(device)


@functools.lru_cache(maxsize=None)
def rotation_signs(head_dim: int, device: torch.device) -> torch.Tensor:
    """float32 [head_dim] on ``device``: the +-1 signs the in-kernel query rotation multiplies by."""
    return _signs(head_dim).to(torch.float32).to(device)


@functools.lru_cache(maxsize=None)
def centroid_pairs(key_bits: int, device: torch.device) -> torch.Tensor:
    """int32 [256]: entry b holds the fp16 centroid of its low nibble's code in its low half and that of its high
    nibble's in its high half; 3-bit codes are a nibble's low 3 bits (bit 3 belongs to another code)."""
    bits = lloyd_max(key_bits)[0].to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    byte, mask = torch.arange(256), (1 << key_bits) - 1
    return (bits[byte & mask] | (bits[(byte >> 4) & mask] << 16)).to(torch.int32).to(device)


def device_index(device: torch.device) -> int:
    """The CUDA device's index (the current device for a bare "cuda"), as the caches above are keyed."""
    return device.index if device.index is not None else torch.cuda.current_device()


def clear() -> None:
    """Drop every cached constant (tests use it to start as a fresh process does)."""
    for made in (sm_count, centroids, rotation_signs, centroid_pairs, _rotation_on):
        made.cache_clear()
