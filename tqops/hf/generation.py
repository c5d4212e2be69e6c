"""transformers' ``generate`` on tqops: a ``PagedKVCache`` sized for the call, checked before its first step."""
from __future__ import annotations

import functools
import inspect
import warnings
from typing import Mapping, Optional

import torch
from transformers import GenerationMixin

from .cache import PagedKVCache

# The key generate keeps a user's cache under in model_kwargs: "cache" in newer transformers 5 releases.
_CACHE_KEYS = ("cache", "past_key_values")
_MARK = "_tqops_checks_paged_kv_cache"


def install() -> bool:
    """Wrap ``GenerationMixin._prepare_cache_for_generation``, which ``generate`` calls once, after it has settled
    ``max_length``, ``num_beams`` and the batch and before the prompt's forward, so that a ``PagedKVCache`` passed to
    ``generate`` is checked there (``PagedKVCache.check_generate``); other caches pass through untouched. transformers
    checks nothing of a user's cache against these settings itself. Returns whether the wrapper is in place (False if
    this transformers has no such method, when only the per-step checks run)."""
    original = GenerationMixin.__dict__.get("_prepare_cache_for_generation")
    if getattr(original, _MARK, False):
        return True
    signature = None if original is None else inspect.signature(original)
    if signature is None or not {"generation_config", "model_kwargs", "batch_size"} <= set(signature.parameters):
        warnings.warn("tqops.hf: this transformers has no GenerationMixin._prepare_cache_for_generation(generation_"
                      "config, model_kwargs, batch_size, ...), so generate() does not check a PagedKVCache against "
                      "its settings before the first step; each step still checks its own rows and length",
                      RuntimeWarning, stacklevel=2)
        return False

    @functools.wraps(original)
    def _prepare_cache_for_generation(self, *args, **kwargs):
        try:
            arguments = signature.bind(self, *args, **kwargs).arguments
        except TypeError:
            arguments = {}  # let the original report its own argument error
        model_kwargs = arguments.get("model_kwargs")
        if isinstance(model_kwargs, dict) and "generation_config" in arguments:
            for key in _CACHE_KEYS:
                cache = model_kwargs.get(key)
                if isinstance(cache, PagedKVCache):
                    cache.check_generate(arguments["generation_config"], arguments.get("batch_size"),
                                         arguments.get("max_cache_length"), getattr(self, "config", None))
        return original(self, *args, **kwargs)

    setattr(_prepare_cache_for_generation, _MARK, True)
    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
    return True


def cache_argument(model) -> str:
    """The keyword ``model.generate`` takes a cache by: ``cache`` where the model's forward has it (transformers >=
    5.24, which deprecates ``past_key_values``), else ``past_key_values``."""
    forward = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in forward else "past_key_values"


def generate(model, input_ids: torch.Tensor, *, max_new_tokens: int, cache_format: str = "turboquant_4bit_nc",
             layer_cache_formats: Optional[Mapping[int, str]] = None, **kwargs):
    """``model.generate(input_ids, max_new_tokens=..., **kwargs)`` over a ``PagedKVCache`` in ``cache_format`` sized
    for this call: ``input_ids`` ``[batch, width]`` rows times ``num_return_sequences``, ``width + max_new_tokens``
    tokens, on the ids' device. The one-line way to run a model with ``attn_implementation="tqops"``; make the cache
    yourself to reuse it across calls or capture its steps. Returns what ``model.generate`` returns."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [batch, width] tensor, got {got}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    for taken in ("cache", "past_key_values"):
        if taken in kwargs:
            raise ValueError(f"tqops.hf.generate makes its own cache; got {taken}=. Pass it to model.generate "
                             "instead")
    rows = input_ids.shape[0] * (kwargs.get("num_return_sequences") or 1)
    cache = PagedKVCache(model.config, cache_format, max_batch_size=rows,
                         max_cache_len=input_ids.shape[1] + max_new_tokens,
                         layer_cache_formats=layer_cache_formats, device=input_ids.device)
    return model.generate(input_ids, max_new_tokens=max_new_tokens, **{cache_argument(model): cache}, **kwargs)
