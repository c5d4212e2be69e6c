"""Benchmarks: ``python -m tqops.bench {store,attention,e2e,quality}`` (quality also runs on CPU)."""
