"""Argument validation shared by the ops: clear Python errors before any kernel launches."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


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


def check_slot_values(name: str, slot_mapping, num_slots: int, *, distinct: bool = True) -> None:
    """Eager-only: ``slot_mapping`` values must be < num_slots (negative means skip) and, for a store, distinct."""
    if slot_mapping.numel() == 0 or in_graph_region():
        return
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
