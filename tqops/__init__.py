"""tqops: store and attend over compressed (fp8, TurboQuant) paged KV caches, causal or not, compiled end to end."""
import os as _os

# graphs/, models/ and cudagraph/ are tqops subpackages kept as top-level folders (setuptools package-dir). An
# editable install without that mapping (older setuptools, `setup.py develop`) sees only tqops/, so a source
# checkout also searches the repository root; in an installed wheel the sibling folders don't exist.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "graphs", "__init__.py")) and _checkout not in __path__:
    __path__.append(_checkout)

from .formats import FORMATS, CacheFormat, get_format  # noqa: E402
from .kv.ops import kv_load, kv_store  # noqa: E402
from .attention import paged_attention  # noqa: E402
from .device_constants import allocate_kv_cache  # noqa: E402

__all__ = ["FORMATS", "CacheFormat", "allocate_kv_cache", "get_format", "kv_load", "kv_store", "paged_attention"]
