"""Linear layers whose one-row inputs (a batch-1 decode step) run a bandwidth-bound Triton GEMV instead of cuBLAS,
with the residual add + RMSNorm or the SwiGLU activation before it fused in, and whose 2-16-row inputs against large
weights (a batch-8 decode step of an 8B model) run a skinny Triton GEMM."""
from .ops import add_rms_norm_linear, linear, silu_mul_linear

__all__ = ["add_rms_norm_linear", "linear", "silu_mul_linear"]
