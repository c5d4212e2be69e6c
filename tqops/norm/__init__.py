"""Fused RMSNorm ops of a decoder layer: residual add + RMSNorm, and per-head q/k RMSNorm + RoPE."""
from .ops import add_rms_norm, qk_norm_rope

__all__ = ["add_rms_norm", "qk_norm_rope"]
