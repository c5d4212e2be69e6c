"""Hugging Face checkpoint loading: config.json, single or sharded *.safetensors, strict name matching."""
from __future__ import annotations

import json
import os
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from .parallel import checkpoint_params

PathLike = Union[str, "os.PathLike[str]"]
_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"


def read_config(path: PathLike) -> dict:
    """The ``config.json`` of a checkpoint directory as a dict."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(file) as f:
        return json.load(f)


def weight_files(path: PathLike) -> list[str]:
    """The checkpoint's weight files: the sharded index's, ``model.safetensors``, or every ``*.safetensors``."""
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    if os.path.isfile(os.path.join(path, _SINGLE)):
        return [os.path.join(path, _SINGLE)]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path!r} has no *.safetensors weights")
    return [os.path.join(path, f) for f in files]


def iter_tensors(path: PathLike, *, lazy: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of the checkpoint, one file open at a time. ``lazy``: a ``LazyTensor``
    instead, valid until the next item, so a tensor-parallel rank reads only its part."""
    from safetensors import safe_open

    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, LazyTensor(f.get_slice(name)) if lazy else f.get_tensor(name)


class LazyTensor:
    """A checkpoint tensor not read yet: ``shape``, and indexing with slices (or ``...``) reads only that part."""

    def __init__(self, safe_slice):
        self._slice, self.shape = safe_slice, torch.Size(safe_slice.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]


def build_empty(factory: Callable[[], nn.Module], dtype: torch.dtype, device) -> nn.Module:
    """Build a module on the meta device (no init cost), then give it uninitialized storage on ``device``."""
    with torch.device("meta"):
        module = factory()
    return module.to(dtype=dtype).to_empty(device=device)


def load_weights(module: nn.Module, path: PathLike, *, ignore: Callable[[str], bool] = lambda name: False,
                 optional: Iterable[str] = (), rename: Callable[[str], str] = lambda name: name,
                 shard: Optional[Callable[[str, LazyTensor], torch.Tensor]] = None) -> None:
    """Copy a checkpoint's tensors into ``module``'s parameters by name (HF names), casting to their dtype/device; a
    merged projection (``MergedColumnLinear``) takes each of its parts' tensors into that part's rows.

    Every parameter must be present (except names in ``optional``) and every checkpoint tensor must be used
    (except those ``ignore`` accepts); mismatched shapes are errors. ``rename`` maps a checkpoint name to the model's
    (e.g. a multimodal checkpoint's language-model prefix), before ``ignore`` sees it. ``shard(name, full)`` (tensor parallelism,
    e.g. ``tqops.models.parallel.shard_hook``) maps a parameter's full checkpoint tensor, read lazily, to this
    rank's part, so each rank reads only what it holds.
    """
    params = {name: param for name, (param, _) in checkpoint_params(module).items()}
    seen, unexpected = set(), []
    with torch.no_grad():
        for name, tensor in iter_tensors(path, lazy=shard is not None):
            name = rename(name)
            if name not in params:
                if not ignore(name):
                    unexpected.append(name)
                continue
            param = params[name]
            if shard is not None:
                tensor = shard(name, tensor)
            if tuple(tensor.shape) != tuple(param.shape):
                part = " (this rank's part)" if shard is not None else ""
                raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}{part}, "
                                 f"the model expects {tuple(param.shape)}")
            param.copy_(tensor)
            seen.add(name)
    missing = sorted(set(params) - seen - set(optional))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not match {type(module).__name__}: "
                         f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")


def config_dtype(config: dict, dtype: Optional[torch.dtype]) -> torch.dtype:
    """``dtype`` if given, else the checkpoint's (``dtype``/``torch_dtype``), else float32."""
    if dtype is not None:
        return dtype
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, name) if isinstance(getattr(torch, str(name), None), torch.dtype) else torch.float32
