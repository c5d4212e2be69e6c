"""Randomized normalized Walsh-Hadamard rotation R = H diag(signs) / sqrt(d)."""
from __future__ import annotations

import functools

import torch

_SIGN_SEED = 0x7A0_5EED


@functools.lru_cache(maxsize=None)
def rotation_signs(head_dim: int) -> torch.Tensor:
    """The +-1 ``signs`` of R = H diag(signs) / sqrt(d), float64 ``[head_dim]`` on CPU: what the Walsh-Hadamard
    butterfly kernels multiply by before their stages."""
    if head_dim <= 0 or head_dim & (head_dim - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, got {head_dim}")
    gen = torch.Generator().manual_seed(_SIGN_SEED + head_dim)
    return torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.float64) * 2 - 1


@functools.lru_cache(maxsize=None)
def _rotation_cpu(head_dim: int) -> torch.Tensor:
    signs = rotation_signs(head_dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    rot = h * signs[None, :] / head_dim**0.5  # R, rows are output coordinates
    return rot.t().contiguous().to(torch.float32)  # R^T, so that y = x @ R^T for row vectors


def rotation_matrix(head_dim: int, device=None) -> torch.Tensor:
    """``R^T`` as float32 ``[head_dim, head_dim]``: rotate row vectors with ``x @ R^T``, undo with ``y @ R``."""
    rot_t = _rotation_cpu(head_dim)
    return rot_t if device is None else _rotation_on(head_dim, torch.device(device))


@functools.lru_cache(maxsize=None)
def _rotation_on(head_dim: int, device: torch.device) -> torch.Tensor:
    return _rotation_cpu(head_dim).to(device)
