"""Capture and replay of whole model steps as CUDA graphs, with static buffers refilled before each replay."""
from .buffers import StepBuffers, pick_bucket
from .runner import CaptureError, CudaGraphRunner

__all__ = ["CaptureError", "CudaGraphRunner", "StepBuffers", "pick_bucket"]
