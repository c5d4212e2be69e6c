"""The ``tqops::linear``, ``tqops::add_rms_norm_linear`` and ``tqops::silu_mul_linear`` custom ops: registration,
fake impls, validation and dispatch.

On CUDA a one-row input in 16-bit floats runs ``gemv_triton``: at a batch-1 decode step cuBLAS picks split-K or
small-tile GEMMs for these shapes that reach a third of the bandwidth or less (docs/tuning.md, "Linear"), and the
GEMV makes its input row itself (residual add + RMSNorm, or SiLU-and-multiply), one launch instead of two. Every
other input runs the unfused ops (the Triton norm or activation kernel on CUDA, then the projection): 2-16 rows
against a weight of at least 16 MB (a batch-8 decode step of an 8B model) project with ``skinny_gemm_triton``,
everything else with ``F.linear``. Every other device runs the torch references, so CPU results are the unfused
modules' bit for bit. ``linear`` has autograd (the
training model's projections use it); the fused two are inference ops, as the norm ops are.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..checks import FLOAT_DTYPES, check_same_size, check_tensor
from ..norm import add_rms_norm
from ..norm.ops import check_add_rms_norm_args
from .naive import linear_naive, silu_mul_naive

GEMV_DTYPES = (torch.bfloat16, torch.float16)


def _check_projection(weight, x: torch.Tensor, in_features, what: str, bias=None) -> None:
    """``weight [out_features, in_features]`` (and ``bias [out_features]``) in x's dtype, on x's device."""
    check_tensor("weight", weight, dtypes=(x.dtype,), ndim=2)
    check_same_size(weight.shape[1] == in_features,
                    f"weight has shape {tuple(weight.shape)}; expected [out_features, {in_features}] ({what})")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, but x is on {x.device}; expected the same device")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(x.dtype,), ndim=1)
        check_same_size(bias.shape[0] == weight.shape[0],
                        f"bias has shape {tuple(bias.shape)}; expected [{weight.shape[0]}] (weight's out_features)")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device}, but x is on {x.device}; expected the same device")


def check_linear_args(x, weight, bias) -> None:
    """Shapes, dtypes and devices only (no tensor values), so the op and its fake impl both run it."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES + (torch.float64,))
    if x.dim() < 1:
        raise ValueError("x is a scalar; expected [..., in_features]")
    _check_projection(weight, x, x.shape[-1], "x's last dim", bias)


def _triton_rows(x: torch.Tensor, weight: torch.Tensor) -> int:
    """The rows of ``x`` the Triton kernels could take: 16-bit rows on CUDA with unit stride along them (the fused
    ops' checks require that of their other row inputs too), against a weight with unit stride along K; else 0."""
    if x.is_cuda and x.dtype in GEMV_DTYPES and x.stride(-1) == 1 and weight.stride(1) == 1:
        return math.prod(x.shape[:-1])
    return 0


def _runs_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The GEMV case of every linear op: one such row."""
    return _triton_rows(x, weight) == 1


def _runs_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The skinny-GEMM case of every linear op: 2 to ``MAX_ROWS`` such rows against a weight of at least
    ``MIN_WEIGHT_BYTES``."""
    rows = _triton_rows(x, weight)
    if rows < 2:
        return False
    from . import triton_skinny  # only here: triton is needed on CUDA alone

    return (rows <= triton_skinny.MAX_ROWS
            and weight.numel() * weight.element_size() >= triton_skinny.MIN_WEIGHT_BYTES)


def _project(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [..., in_features] @ weight.T + bias`` for the inputs the GEMV does not take: the skinny GEMM where it
    applies, else ``F.linear``."""
    if _runs_skinny(x, weight):
        from .triton_skinny import skinny_gemm_triton

        return skinny_gemm_triton(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return linear_naive(x, weight, bias)


@torch.library.custom_op("tqops::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    check_linear_args(x, weight, bias)
    if _runs_gemv(x, weight):
        from .triton_gemv import gemv_triton

        return gemv_triton(x.reshape(1, -1), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return _project(x, weight, bias)


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
    Triton GEMV for one-row 16-bit inputs on CUDA and a skinny Triton GEMM for 2-16 rows against large weights.

    Inside an autocast region on x's device it runs in autocast's dtype, as ``F.linear`` does (a custom op is
    outside autocast's lists, so the cast happens here): x, weight and bias in float32 or a 16-bit float are cast
    to it; float64 is left as it is, as autocast leaves it."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight, bias = (_autocast(t, dtype) for t in (x, weight, bias))
    return torch.ops.tqops.linear(x, weight, bias)


def _autocast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    if t is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


def check_add_rms_norm_linear_args(x, residual, norm_weight, eps, weight, bias) -> None:
    check_add_rms_norm_args(x, residual, norm_weight, eps)
    _check_projection(weight, x, x.shape[1], "x's hidden size", bias)


@torch.library.custom_op("tqops::add_rms_norm_linear", mutates_args=())
def _add_rms_norm_linear_op(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, bias: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    check_add_rms_norm_linear_args(x, residual, norm_weight, eps, weight, bias)
    if _runs_gemv(x, weight):
        from .triton_gemv import ADD_RMS_NORM, gemv_triton

        return gemv_triton(x, weight, bias, residual=residual, norm_weight=norm_weight, eps=eps,
                           prologue=ADD_RMS_NORM)
    if _runs_skinny(x, weight):  # the norm kernel launches the GEMM early (PDL), as the GEMV's neighbours do
        from ..norm.triton_norm import add_rms_norm_triton

        normed, total = add_rms_norm_triton(x, residual, norm_weight, eps, pdl=True)
        return _project(normed, weight, bias), total
    normed, total = add_rms_norm(x, residual, norm_weight, eps)
    return _project(normed, weight, bias), total


@_add_rms_norm_linear_op.register_fake
def _(x, residual, norm_weight, eps, weight, bias=None):
    check_add_rms_norm_linear_args(x, residual, norm_weight, eps, weight, bias)
    return x.new_empty((x.shape[0], weight.shape[0])), torch.empty_like(x, memory_format=torch.contiguous_format)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
    """``x``, ``residual`` ``[num_tokens, hidden]`` -> ``(rms_norm(x + residual) * norm_weight @ weight.T + bias,
    x + residual)``, ``[num_tokens, out_features]`` and ``[num_tokens, hidden]``: a pre-norm layer's residual add,
    norm and the projection after it (``tqops.norm.add_rms_norm`` then ``linear``)."""
    return torch.ops.tqops.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)


def check_silu_mul_linear_args(gate_up, weight) -> None:
    check_tensor("gate_up", gate_up, dtypes=FLOAT_DTYPES, ndim=2)
    torch._check_value(gate_up.shape[1] % 2 == 0, lambda: f"gate_up has shape {tuple(gate_up.shape)}; expected "
                       "[num_tokens, 2 * intermediate] (the gate, then the up projection)")
    if gate_up.stride(-1) != 1:
        raise ValueError("gate_up must be contiguous in its last dim (stride(-1) == 1)")
    _check_projection(weight, gate_up, gate_up.shape[1] // 2, "half of gate_up's width")


@torch.library.custom_op("tqops::silu_mul_linear", mutates_args=())
def _silu_mul_linear_op(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    check_silu_mul_linear_args(gate_up, weight)
    if _runs_gemv(gate_up, weight):
        from .triton_gemv import SILU_MUL, gemv_triton

        return gemv_triton(gate_up, weight, prologue=SILU_MUL)
    if gate_up.is_cuda:
        from .triton_gemv import silu_mul_triton

        return _project(silu_mul_triton(gate_up, pdl=_runs_skinny(gate_up, weight)), weight)
    return linear_naive(silu_mul_naive(gate_up), weight)


@_silu_mul_linear_op.register_fake
def _(gate_up, weight):
    check_silu_mul_linear_args(gate_up, weight)
    return gate_up.new_empty((gate_up.shape[0], weight.shape[0]))


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``gate_up`` ``[num_tokens, 2 * intermediate]`` (the gate, then the up projection) -> ``(silu(gate) * up) @
    weight.T`` ``[num_tokens, out_features]``: a SwiGLU MLP's activation and down projection."""
    return torch.ops.tqops.silu_mul_linear(gate_up, weight)
