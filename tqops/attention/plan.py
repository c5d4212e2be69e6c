"""The plan of a paged_attention call: which backend runs it and with which launch, made once per call from shapes,
strides, the format object and device properties (never tensor values), as FlashInfer's plan/run wrappers and
vLLM's attention metadata builders split the work.

Because nothing in it reads a tensor's values, a plan is the same during a CUDA-graph capture and every replay, and
the same on meta tensors given the device's properties. Each backend's ``run`` (``triton_paged.run``,
``cuda_paged.run``, ``cuda_verify.run``, the reference in ``ops.run_attention``) takes the plan and launches what it
says.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Union

import torch

from ..checks import INT32_MAX, narrow_int32
from ..formats import CacheFormat
from . import constants as dc
from . import cuda_launch
from .cuda_launch import PagedLaunch, VerifyLaunch
from .launch import TritonLaunch, mean_query_len, triton_launch

BACKENDS = ("cuda_verify", "cuda_paged", "triton", "reference")


@dataclasses.dataclass(frozen=True)
class DeviceProps:
    """What the launch rules read of the device a call runs on. ``interpreted``: the Triton kernel runs under
    ``TRITON_INTERPRET=1`` (decided when it was decorated), which launch rules treat as a 132-SM GPU."""
    cuda: bool
    index: Optional[int]
    sm_count: int
    capability: Optional[tuple]
    nvrtc: bool  # torch builds CUDA kernels with NVRTC (torch >= 2.8)
    interpreted: bool


def interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from .kernel import _paged_attention_kernel

    return isinstance(_paged_attention_kernel, InterpretedFunction)


def device_props(device: torch.device) -> DeviceProps:
    """The properties of ``device`` (CUDA queries only for a CUDA device or a compiled kernel; the SM count and
    capability are cached by constants and torch)."""
    interp, cuda = interpreted(), device.type == "cuda"
    index = dc.device_index(device) if cuda or not interp else None
    return DeviceProps(cuda=cuda, index=index, sm_count=132 if interp else dc.sm_count(index),
                       capability=tuple(torch.cuda.get_device_capability(device)) if cuda else None,
                       nvrtc=hasattr(torch.cuda, "_compile_kernel"), interpreted=interp)


@dataclasses.dataclass(frozen=True)
class CallShape:
    """The shapes, strides and dtypes of a call's tensors that a plan reads: query ``[num_tokens, num_q_heads,
    head_dim]``, cache ``[num_blocks, block_size, num_kv_heads, slot bytes]`` (its byte strides, and its pointer's
    offset past a 16-byte boundary), block table ``[batch, max_blocks]``."""
    num_tokens: int
    num_q_heads: int
    head_dim: int
    query_dtype: torch.dtype
    num_blocks: int
    block_size: int
    num_kv_heads: int
    cache_strides: tuple
    cache_align: int
    batch: int
    max_blocks: int

    @classmethod
    def of(cls, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor) -> CallShape:
        num_tokens, num_q_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        batch, max_blocks = block_table.shape
        return cls(num_tokens, num_q_heads, head_dim, query.dtype, num_blocks, block_size, num_kv_heads,
                   kv_cache.stride()[:3], kv_cache.data_ptr() % 16, batch, max_blocks)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def mean_q_len(self) -> int:
        return mean_query_len(self.num_tokens, self.batch)

    @property
    def table_keys(self) -> int:
        """Keys over the block table: batch x max_blocks x block_size."""
        return self.batch * self.max_blocks * self.block_size

    @property
    def empty(self) -> bool:
        return self.num_tokens == 0 or self.batch == 0


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How one call runs: ``backend`` (one of ``BACKENDS``) and its launch (None for the reference, and for a call
    with no tokens or no sequences, whose output is zeros), for a call of ``shape`` over a ``fmt`` cache."""
    backend: str
    fmt: CacheFormat
    shape: CallShape
    causal: bool
    sliding_window: Optional[int]
    has_sinks: bool
    launch: Union[TritonLaunch, PagedLaunch, VerifyLaunch, None]

    def check(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
              sinks: Optional[torch.Tensor]) -> None:
        """Raise ValueError unless the tensors are those of the call the plan was made for."""
        shape = CallShape.of(query, kv_cache, block_table)
        if shape != self.shape or (sinks is not None) != self.has_sinks:
            raise ValueError(f"the plan was made for {self.shape} ({'with' if self.has_sinks else 'no'} sinks); "
                             f"got {shape} ({'with' if sinks is not None else 'no'} sinks)")


def accepts(backend: str, shape: CallShape, fmt: CacheFormat, sliding_window: Optional[int],
            device: DeviceProps) -> bool:
    """Whether a CUDA backend's rules take a call (``cuda_launch.verify_eligible`` / ``paged_eligible``, on a CUDA
    device with NVRTC, ``TQOPS_CUDA_ATTENTION`` not 0), whichever the plan then picks."""
    if not (cuda_launch.enabled() and device.cuda and device.nvrtc):
        return False
    block_stride, slot_stride, _ = shape.cache_strides
    args = (fmt, shape.head_dim, shape.query_dtype, shape.group, sliding_window, shape.cache_align, block_stride,
            slot_stride, device.capability, shape.mean_q_len, shape.table_keys)
    if backend == "cuda_verify":
        return cuda_launch.verify_eligible(*args, shape.block_size)
    if backend == "cuda_paged":
        return cuda_launch.paged_eligible(*args)
    raise ValueError(f"backend {backend!r}: expected cuda_verify or cuda_paged")


def choose_backend(shape: CallShape, fmt: CacheFormat, sliding_window: Optional[int], device: DeviceProps) -> str:
    """The verify kernel where it takes the call, else the decode kernel, else Triton; the reference off CUDA."""
    if not device.cuda:
        return "reference"
    return next((backend for backend in ("cuda_verify", "cuda_paged")
                 if accepts(backend, shape, fmt, sliding_window, device)), "triton")


def _launch(backend: str, shape: CallShape, fmt: CacheFormat, device: DeviceProps, overrides: Mapping):
    s = shape
    if backend == "triton":
        return triton_launch(s.num_tokens, s.batch, s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size,
                             s.max_blocks, device.sm_count, fmt, s.query_dtype, device.interpreted, **overrides)
    block_stride, slot_stride, _ = s.cache_strides
    common = (s.num_tokens, s.batch, s.num_q_heads, s.num_kv_heads, s.block_size, s.max_blocks, s.cache_align,
              block_stride, slot_stride)
    if backend == "cuda_paged":
        return cuda_launch.paged_launch(*common, fmt, s.query_dtype, device.sm_count, device.capability,
                                        device.index, **overrides)
    return cuda_launch.verify_launch(*common, fmt, s.query_dtype, device.sm_count, device.index, **overrides)


def plan_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, fmt: CacheFormat,
                   causal: bool, sliding_window: Optional[int], sinks: Optional[torch.Tensor], *,
                   backend: Optional[str] = None, device: Optional[DeviceProps] = None,
                   overrides: Optional[Mapping[str, object]] = None) -> AttentionPlan:
    """The plan of a call with these tensors (their shapes, strides, dtypes and device only) over a ``fmt`` cache.

    ``backend`` forces one (the backends' own entry points, with their launch ``overrides``) instead of
    ``choose_backend``; ``device`` stands in for the properties of the query's device (``device_props``).
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if overrides and backend in (None, "reference"):
        raise ValueError("launch overrides need a backend with a launch (triton, cuda_paged or cuda_verify)")
    shape = CallShape.of(query, kv_cache, block_table)
    if device is None and (backend not in (None, "reference") or query.device.type == "cuda"):
        device = device_props(query.device)
    if backend is None:
        backend = "reference" if device is None else choose_backend(shape, fmt, sliding_window, device)
    launch = (None if backend == "reference" or shape.empty
              else _launch(backend, shape, fmt, device, overrides or {}))
    return AttentionPlan(backend, fmt, shape, causal, sliding_window, sinks is not None, launch)


def int32_indices(block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels read int32 indices; int64 ones (torch.tensor's default) are narrowed here without wrapping (a plain
    cast reads 2**32 + 1 as 1), so a value past int32 is out of range as the CPU op treats it: a block entry becomes
    -1 (its keys are dropped), seq_lens are clamped to [0, 2**31 - 1] (past every block table; a negative one sees no
    key, as 0 does) and query_start_loc saturates at the int32 bounds (past every token). A no-op for int32; no host
    sync, so it runs inside captured graphs."""
    seq_lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.clamp(0, INT32_MAX).to(torch.int32)
    return narrow_int32(block_table, out_of_range=-1), seq_lens, narrow_int32(query_start_loc)


def cuda_indices(plan: AttentionPlan, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A CUDA backend's indices for a call ``plan`` was made for: asserts the cache alignment and the device match
    the plan's (what the launch was sized for), then ``int32_indices``."""
    assert kv_cache.data_ptr() % 16 == plan.shape.cache_align, "the plan was made for another cache"
    assert dc.device_index(query.device) == plan.launch.device_index, "the plan was made for another device"
    return int32_indices(block_table, seq_lens, query_start_loc)
