"""Linear layers whose one-row inputs (a batch-1 decode step) run a bandwidth-bound Triton GEMV instead of cuBLAS."""
from .ops import linear

__all__ = ["linear"]
