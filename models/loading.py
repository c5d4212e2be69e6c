"""Hugging Face checkpoint loading: config.json, single or sharded *.safetensors, strict name matching."""
from __future__ import annotations

import json
import math
import os
from typing import Callable, Iterable, Mapping, Optional, Union

import torch
from torch import nn

from ..checks import check_device
from .parallel import checkpoint_params

PathLike = Union[str, "os.PathLike[str]"]
_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"


class ConfigFile(dict):
    """A checkpoint's ``config.json`` as a dict, with the file it came from (``source``), which the config classes'
    field errors name; a plain dict's errors name "config"."""

    source = "config"


def _read_json(file: str):
    try:
        with open(file) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None


def read_config(path: PathLike) -> dict:
    """The ``config.json`` of a checkpoint directory as a dict (a ``ConfigFile``); a file that is not a JSON object
    is a ValueError naming it."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path!r} has no config.json")
    raw = _read_json(file)
    if not isinstance(raw, dict):
        raise ValueError(f"{file} holds a JSON {type(raw).__name__}; expected an object of config fields")
    config = ConfigFile(raw)
    config.source = file
    return config


def sub_config(d: Mapping, field: str) -> dict:
    """``d[field]`` (a nested config such as ``text_config``) as a ``ConfigFile`` whose errors name the field too."""
    sub = d[field]
    source = f"{getattr(d, 'source', 'config')} ({field})"
    if not isinstance(sub, Mapping):
        raise ValueError(f"{source}: {field} is a {type(sub).__name__}; expected an object of config fields")
    config = ConfigFile(sub)
    config.source = source
    return config


def rope_config(d: Mapping) -> Mapping:
    """The RoPE fields (``rope_parameters``, or the older ``rope_scaling``; empty without either)."""
    for field in ("rope_parameters", "rope_scaling"):
        if d.get(field):
            return sub_config(d, field)
    return {}


def check_layer_types(d: Mapping, layer_types, num_layers: int) -> None:
    """``layer_types`` is a list of ``num_layers`` strings, else a ValueError naming the config's file."""
    source = getattr(d, "source", "config")
    if not isinstance(layer_types, (list, tuple)) or not all(isinstance(t, str) for t in layer_types):
        raise ValueError(f"{source}: layer_types is {layer_types!r}; expected a list of layer kinds (strings)")
    if len(layer_types) != num_layers:
        raise ValueError(f"{source}: layer_types has {len(layer_types)} entries for {num_layers} layers")


_REQUIRED = object()


def config_int(d: Mapping, field: str, default=_REQUIRED, *, low: int = 1):
    """``d[field]`` as an int >= ``low`` (``default`` where the field is absent or null, if one is given), else a
    ValueError naming the config's file and the field."""
    source = getattr(d, "source", "config")
    value = d.get(field)
    if value is None:
        if default is not _REQUIRED:
            return default
        raise ValueError(f"{source} has no {field!r}; expected an int >= {low}")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{source}: {field} is {value!r}; expected an int >= {low}")
    return value


def config_float(d: Mapping, field: str, default: float, *, positive: bool = True) -> float:
    """``d[field]`` as a finite float (> 0 when ``positive``; ``default`` where absent or null), else a ValueError
    naming the config's file and the field."""
    value = d.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            (positive and value <= 0):
        raise ValueError(f"{getattr(d, 'source', 'config')}: {field} is {value!r}; expected a finite "
                         f"{'positive ' if positive else ''}number")
    return float(value)


def weight_files(path: PathLike) -> list[str]:
    """The checkpoint's weight files: the sharded index's, ``model.safetensors``, or every ``*.safetensors``."""
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        raw = _read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} has no weight_map; expected an object of tensor name -> shard file")
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
    """Build a module on the meta device (no init cost), then give it uninitialized storage on ``device`` (one that
    exists here, else a ValueError naming it)."""
    device = check_device("device", device)
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
    (e.g. a multimodal checkpoint's language-model prefix), before ``ignore`` sees it. ``shard(name, full)`` (tensor
    parallelism, e.g. ``tqops.models.parallel.shard_hook``) maps a parameter's full checkpoint tensor, read lazily,
    to this rank's part, so each rank reads only what it holds.
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
            if name in seen:  # two checkpoint names (e.g. two spellings ``rename`` maps together) for one tensor
                raise ValueError(f"checkpoint {path!r} holds {name} twice")
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
