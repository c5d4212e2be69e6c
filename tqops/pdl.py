"""Programmatic dependent launch (Hopper and later): a kernel launched early waits for the previous one in-kernel.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream is still running. It
must call ``pdl_wait`` before it touches memory that kernel may write or read (its inputs, and its outputs, which
the caching allocator may have handed over from a buffer that kernel reads); only loads of memory no kernel writes
(weights) may come before. ``pdl_launch_dependents`` lets the next such kernel start. ``TQOPS_PDL=0`` turns it off.

Launched this way: the one-row GEMVs (``tqops.linear``) and, at one row, the norm kernels, the cache store, the
Triton attention kernel and the split combiner: every kernel of a batch-1 decode layer but the turboquant_4bit_nc
CUDA attention kernel, which torch's NVRTC launcher starts without launch attributes. Also the skinny GEMM (2-16
rows against large weights) and the norm and activation kernels that feed it, whose neighbours are then Triton
kernels. Between cuBLAS and Inductor kernels (more rows, small weights), which neither start early nor let the next
kernel start early, it measured slower (docs/tuning.md, "Programmatic dependent launch"); ``pdl_launch_args`` makes
that choice for every launch.
"""
from __future__ import annotations

import functools
import os
from unittest import mock

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: CUDA at compute capability 9.0 or later, compiled kernels (not
    the interpreter), and ``TQOPS_PDL`` not 0."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if os.environ.get("TQOPS_PDL", "1") == "0":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def pdl_switched_off():
    """A context manager: ``TQOPS_PDL=0`` inside the block (launches and captures made there run without PDL), the
    environment as it was afterwards. For profiles that attribute time per kernel: an early-launched kernel's time
    counts its wait."""
    return mock.patch.dict(os.environ, {"TQOPS_PDL": "0"})


def pdl_launch_args(device: torch.device, one_row: bool = True) -> dict:
    """Keyword arguments of a launch of a kernel taking ``USE_PDL``: with PDL for a one-row call where
    ``pdl_enabled``, else without."""
    if one_row and pdl_enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible (a no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel, if launched with PDL, start its programs (they still wait for this one's completion)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
