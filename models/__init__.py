"""Qwen3 target, DFlash drafter and the speculative decoding loop (issue 5; not built yet)."""
