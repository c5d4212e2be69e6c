"""Cache allocation and the kernels' device constants (rotation signs, codebooks, SM counts) made with it.

The kernels read a few small tensors that are made once per device and kept in ``functools.lru_cache``s. Made
lazily by the first launch, they would be made inside whatever runs that launch: under
``torch.compile(mode="reduce-overhead")`` the first run of a step is a cudagraph-trees warm-up that allocates from
the graph's private memory pool, and a tensor made there and kept alive by the cache is "not tracked as an output",
which fails the pool check ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs"). So
``allocate_kv_cache`` makes them eagerly, on the cache's own device (its index set, as the launches' lookups key it).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .attention import cuda_paged, cuda_verify, triton_paged
from .checks import check_device
from .formats import CacheFormat, get_format
from .kv import triton_store


def prepare(fmt: Union[str, CacheFormat], head_dim: int, device: Union[str, torch.device],
            num_kv_heads: Optional[int] = None) -> None:
    """Make every device constant that stores into and attention over a ``fmt`` cache on ``device`` read (CUDA
    only: the interpreter's CPU launches allocate nothing that a graph could capture); ``num_kv_heads``, where
    known, picks the attention kernels' copy variants."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    fmt = get_format(fmt)
    triton_store.device_constants(fmt, head_dim, device)
    triton_paged.device_constants(fmt, head_dim, device)
    cuda_paged.device_constants(fmt, head_dim, device, num_kv_heads)
    cuda_verify.device_constants(fmt, head_dim, device)


def clear() -> None:
    """Drop every cached device constant (tests use it to start as a fresh process does)."""
    triton_store.clear_device_constants()
    triton_paged.clear_device_constants()
    cuda_paged.clear_device_constants()
    cuda_verify.clear_device_constants()


def allocate_kv_cache(fmt: Union[str, CacheFormat], num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """One uint8 tensor ``[num_blocks, block_size, num_kv_heads, slot_bytes]``; slot = block * block_size + offset.
    Then the device constants its kernels read (``prepare``), so the first step over it may run under a graph.

    The memory is left uninitialized, as in vLLM: kernels read only slots below seq_lens.
    """
    fmt = get_format(fmt)
    for arg, val in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads)):
        if not isinstance(val, int) or val <= 0:
            raise ValueError(f"{arg} must be a positive int, got {val!r}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if device is not None:
        device = check_device("device", device)
    cache = torch.empty((num_blocks, block_size, num_kv_heads, fmt.slot_bytes(head_dim)), dtype=torch.uint8,
                        device=device)
    prepare(fmt, head_dim, cache.device, num_kv_heads)
    return cache
