"""Benchmarks: ``python -m tqops.bench {store,attention,e2e,hf,kernels,linear,programs,quality,acceptance}`` (quality
and acceptance also run on CPU); ``python -m tqops.bench.tp`` under torchrun."""
