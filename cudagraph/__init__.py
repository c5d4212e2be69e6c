"""Capture and replay of whole speculative steps as CUDA graphs (issue 6; not built yet)."""
