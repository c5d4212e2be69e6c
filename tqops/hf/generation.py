"""transformers' ``generate`` checks a ``PagedKVCache`` against its settings before its first step."""
from __future__ import annotations

import functools
import inspect

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
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True
    signature = inspect.signature(original)

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
