"""Paged attention over compressed KV caches: causal or not, windowed, with sinks, GQA."""
from .ops import paged_attention

__all__ = ["paged_attention"]
