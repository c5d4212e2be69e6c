"""Test setup: the gpu skip, the smoke tier's scope, hypothesis profiles, and NaN poisoning of library allocations."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

if not torch.cuda.is_available():
    # Triton decides at @triton.jit time whether to interpret, so this must precede every tqops kernel import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "ci", max_examples=20, derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "deep", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The smoke tier (`python -m pytest -m smoke -n 6`, at most 6 minutes on an H200) is marked on the tests themselves
# (`@pytest.mark.smoke`, a module's `pytestmark`, or `pytest.param(..., marks=pytest.mark.smoke)`): every op x format x
# {causal, non-causal} (test_gpu_ops.py, the store kernel's reference test, the attention semantics on CUDA), the fused
# norm ops and the store fused with them, the one-row GEMV and the skinny GEMM, the model against transformers on CUDA,
# a compiled and captured decode step for two formats, speculative == greedy, a transformers model's decode step on the
# tqops cache captured as a CUDA graph, and the hybrid (Gated DeltaNet) target's ops and its compiled, captured DFlash
# loop (the chunked prefill kernels' cold autotuning is left out). No test is duplicated for it.


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- NaN poisoning ------------------------------------------------------------------------
# Memory from torch.empty* in library code is filled with NaN (floats) or 0xFF bytes (ints; 0xFF is
# NaN in every cache format's fp16/bf16/fp8 fields), so a kernel that reads what it never wrote fails.

_EMPTY_FNS = ("empty", "empty_like", "empty_strided")


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        t.view(torch.uint8).fill_(0xFF) if t.is_contiguous() and t.numel() else t.fill_(-1)
    return t


def _called_from_library(depth: int = 2) -> bool:
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name == "tqops" or name.startswith("tqops.")


def _wrap(fn):
    def poisoned(*args, **kwargs):
        out = fn(*args, **kwargs)
        if torch.compiler.is_compiling() or isinstance(out, torch._subclasses.FakeTensor):
            return out
        capturing = out.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and _called_from_library():
            _poison(out)
        return out

    poisoned.__wrapped__ = fn
    return poisoned


@pytest.fixture(autouse=True)
def nan_poison(monkeypatch):
    for name in _EMPTY_FNS:
        monkeypatch.setattr(torch, name, _wrap(getattr(torch, name)))
    orig_new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: _new_empty(orig_new_empty, self, *a, **k))
    yield


def _new_empty(orig, self, *args, **kwargs):
    out = orig(self, *args, **kwargs)
    if not torch.compiler.is_compiling() and not isinstance(out, torch._subclasses.FakeTensor) and _called_from_library(3):
        _poison(out)
    return out
