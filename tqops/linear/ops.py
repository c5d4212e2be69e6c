"""The ``tqops::linear`` custom op: registration, fake impl, autograd, validation and dispatch.

On CUDA a one-row input in 16-bit floats runs ``gemv_triton``: at a batch-1 decode step cuBLAS picks split-K or
small-tile GEMMs for these shapes that reach a third of the bandwidth or less (docs/tuning.md, "Linear"). Every
other input, and every other device, runs ``F.linear``, so CPU results are the unfused module's bit for bit.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..checks import FLOAT_DTYPES, check_same_size, check_tensor
from .naive import linear_naive

GEMV_DTYPES = (torch.bfloat16, torch.float16)


def check_linear_args(x, weight, bias) -> None:
    """Shapes, dtypes and devices only (no tensor values), so the op and its fake impl both run it."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES + (torch.float64,))
    if x.dim() < 1:
        raise ValueError("x is a scalar; expected [..., in_features]")
    check_tensor("weight", weight, dtypes=(x.dtype,), ndim=2)
    check_same_size(weight.shape[1] == x.shape[-1],
                    f"weight has shape {tuple(weight.shape)}; expected [out_features, {x.shape[-1]}] (x's last dim)")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, but x is on {x.device}; expected the same device")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(x.dtype,), ndim=1)
        check_same_size(bias.shape[0] == weight.shape[0],
                        f"bias has shape {tuple(bias.shape)}; expected [{weight.shape[0]}] (weight's out_features)")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device}, but x is on {x.device}; expected the same device")


def _runs_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in GEMV_DTYPES and math.prod(x.shape[:-1]) == 1 and x.stride(-1) == 1
            and weight.stride(1) == 1)


@torch.library.custom_op("tqops::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    check_linear_args(x, weight, bias)
    if _runs_gemv(x, weight):
        from .triton_gemv import gemv_triton

        return gemv_triton(x.reshape(1, -1), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return linear_naive(x, weight, bias)


@_linear_op.register_fake
def _(x, weight, bias):
    check_linear_args(x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    flat_grad, flat_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_w = flat_grad.t() @ flat_x if ctx.needs_input_grad[1] else None
    grad_b = flat_grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


_linear_op.register_autograd(_backward, setup_context=_setup_context)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [..., in_features]`` -> ``x @ weight.T + bias``, ``[..., out_features]`` (``F.linear``'s contract), with a
    Triton GEMV for one-row 16-bit inputs on CUDA."""
    return torch.ops.tqops.linear(x, weight, bias)
