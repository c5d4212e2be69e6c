"""tqops: store and attend over compressed (fp8, TurboQuant) paged KV caches, causal or not, compiled end to end."""
from .formats import FORMATS, CacheFormat, allocate_kv_cache, get_format
from .kv.ops import kv_load, kv_store

__all__ = ["FORMATS", "CacheFormat", "allocate_kv_cache", "get_format", "kv_load", "kv_store"]

try:  # the attention op family lands separately; keep the core importable meanwhile
    from .attention import paged_attention  # noqa: F401

    __all__.append("paged_attention")
except ImportError:
    pass
