"""The torch reference of ``tqops.linear``: ``F.linear``."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def linear_naive(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [..., in_features]`` -> ``x @ weight.T + bias``, ``[..., out_features]``."""
    return F.linear(x, weight, bias)
