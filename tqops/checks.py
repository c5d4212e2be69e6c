"""Argument validation shared by the ops: clear Python errors before any kernel launches."""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
# The kernels index with int32: an index value outside this range is out of range on every path.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def check_tensor(name: str, t, *, dtypes=None, ndim=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        expected = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {expected}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, but the cache is on {device}; expected the same device")


def check_has_data(name: str, t) -> None:
    """Eager wrappers and layers: a tensor on the meta device has shapes but no values to check, store or read, so
    it is rejected by name here (torch would fail inside a value check, or the op would dispatch to its fake impl and
    return nothing). Fake tensors (``torch.compile``, ``FakeTensorMode``) report their real device and pass."""
    if isinstance(t, torch.Tensor) and not torch.compiler.is_compiling() and t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (no data); expected a tensor with data (CPU or CUDA)")


def check_cache(kv_cache, fmt, head_dim: int) -> None:
    check_tensor("kv_cache", kv_cache, dtypes=(torch.uint8,), ndim=4)
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (allocate it with tqops.allocate_kv_cache)")
    # Under compile's dynamic shapes head_dim may be symbolic; it is a kernel constant, so specialize on it.
    head_dim = int(head_dim) if isinstance(head_dim, torch.SymInt) else head_dim
    fmt.check_head_dim(head_dim)
    expected = fmt.slot_bytes(head_dim)
    if kv_cache.shape[3] != expected:
        raise ValueError(
            f"kv_cache has {kv_cache.shape[3]} bytes per slot; format {fmt.name!r} at head_dim={head_dim} "
            f"expects {expected}"
        )


def check_scale(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
    value = float(value)
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"{name} must be a positive finite float, got {value}")
    return value


def in_graph_region() -> bool:
    """True while tracing for torch.compile or capturing a CUDA graph: value checks would sync the host."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_same_size(cond, message: str) -> None:
    """A shape equality that may involve symbolic sizes: under compile it becomes a runtime assert, not a guard. A
    plain bool raises here (torch 2.11's dynamo cannot trace ``torch._check_value`` with a message callable then)."""
    if isinstance(cond, bool):
        if not cond:
            raise ValueError(message)
        return
    torch._check_value(cond, lambda: message)


def check_int32_values(name: str, t) -> None:
    """Eager-only: every value of the index tensor ``t`` fits int32 (the kernels' index type), else an IndexError
    naming the entry. int32 tensors pass without a look at their values."""
    if t.dtype == torch.int32 or t.numel() == 0 or in_graph_region():
        return
    lo, hi = (int(x) for x in torch.aminmax(t))
    if lo < INT32_MIN or hi > INT32_MAX:
        where = tuple(int(i) for i in ((t < INT32_MIN) | (t > INT32_MAX)).nonzero()[0])
        index = ", ".join(map(str, where))
        raise IndexError(f"{name}[{index}] = {int(t[where])} does not fit int32, the kernels' index type; expected "
                         f"values in [{INT32_MIN}, {INT32_MAX}]")


def narrow_int32(t: torch.Tensor, out_of_range: Optional[int] = None) -> torch.Tensor:
    """An index tensor as int32 for a kernel, without wrapping (a plain cast maps 2**32 + 1 to 1): int64 values
    outside int32 become ``out_of_range`` (e.g. -1, which the kernels skip), or saturate at the int32 bounds when it
    is None. No host sync, so it runs inside captured graphs; a no-op for int32."""
    if t.dtype == torch.int32:
        return t
    if out_of_range is None:
        return t.clamp(INT32_MIN, INT32_MAX).to(torch.int32)
    return torch.where((t >= INT32_MIN) & (t <= INT32_MAX), t, out_of_range).to(torch.int32)


def check_slot_values(name: str, slot_mapping, num_slots: int, *, distinct: bool = True) -> None:
    """Eager-only: ``slot_mapping`` values must fit int32, be < num_slots (negative means skip) and, for a store, be
    distinct."""
    if slot_mapping.numel() == 0 or in_graph_region():
        return
    check_int32_values(name, slot_mapping)
    top = int(slot_mapping.max())
    if top >= num_slots:
        i = int((slot_mapping >= num_slots).nonzero()[0, 0])
        raise IndexError(
            f"{name}[{i}] = {int(slot_mapping[i])}, but the cache has only {num_slots} slots "
            f"(num_blocks * block_size); expected values < {num_slots} or negative to skip"
        )
    if distinct:
        stored = slot_mapping[slot_mapping >= 0].sort().values
        same = stored[1:] == stored[:-1]
        if bool(same.any()):
            slot = int(stored[1:][same][0])
            where = (slot_mapping == slot).nonzero()[:, 0].tolist()
            raise ValueError(
                f"{name} stores slot {slot} more than once (entries {where}); expected distinct slots in one call "
                "(two writes to one slot race on the GPU)"
            )


def check_temperature(temperature) -> float:
    """A sampling temperature: a real number, finite and >= 0 (0: greedy), as a float."""
    # bool subclasses int, but a True temperature is a mistake, not 1
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__} {temperature!r}")
    # A negative temperature samples the least likely tokens, NaN fails inside multinomial, inf is uniform noise.
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    return float(temperature)


def check_top_k(top_k) -> int:
    """A top-k filter: an int >= 0 (0: off, as vLLM's)."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int (0: off), got {type(top_k).__name__} {top_k!r}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {top_k!r}")
    return int(top_k)


def check_top_p(top_p) -> float:
    """A top-p (nucleus) filter: a real number in (0, 1] (1: off)."""
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p must be a real number in (0, 1], got {type(top_p).__name__} {top_p!r}")
    if not 0 < top_p <= 1:  # NaN fails this too
        raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p!r}")
    return float(top_p)


def check_device(name: str, device) -> torch.device:
    """``device`` (a str, ``torch.device`` or CUDA index) as a ``torch.device`` that exists here, else a ValueError
    naming ``name`` (torch's own error for a CUDA device on a CPU-only build is a bare AssertionError)."""
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"{name}={device!r} is not a torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={device!r}, but this torch has no CUDA device (torch.cuda.is_available() is "
                             "False); expected 'cpu'")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"{name}={device!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev
