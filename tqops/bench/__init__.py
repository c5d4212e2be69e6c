"""Benchmarks: ``python -m tqops.bench {store,attention,quality}`` (quality also runs on CPU)."""
