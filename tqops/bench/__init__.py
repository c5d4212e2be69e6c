"""Benchmarks, run as ``python -m tqops.bench {store,attention}`` on a CUDA device."""
