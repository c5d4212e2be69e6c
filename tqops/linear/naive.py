"""Torch references of the linear ops: ``F.linear``, and the SwiGLU activation as the unfused module computes it."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def linear_naive(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [..., in_features]`` -> ``x @ weight.T + bias``, ``[..., out_features]``."""
    return F.linear(x, weight, bias)


def silu_mul_naive(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * width]`` (gate, then up) -> ``silu(gate) * up`` ``[..., width]``, each op rounded to the dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
