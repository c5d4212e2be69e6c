"""tqops in Hugging Face transformers: attn_implementation="tqops" with a paged, compressed PagedKVCache."""
try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as err:  # transformers is an optional dependency of tqops
    raise ImportError("tqops.hf needs transformers >= 5.0 (pip install 'transformers>=5.0')") from err

from .attention import padding_mask, paged_attention_forward
from .cache import ATTN_IMPLEMENTATION, PagedCacheLayer, PagedKVCache, PagedLayerStep
from .generation import cache_argument, generate
from .generation import install as _install_generate_checks
from .speculative import generate_speculative

# Importing tqops.hf is what makes attn_implementation="tqops" (and its padding mask) known to transformers.
AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)
# ... and what makes generate check a PagedKVCache (beam search, rows, length) before its first step.
_install_generate_checks()

__all__ = ["ATTN_IMPLEMENTATION", "PagedCacheLayer", "PagedKVCache", "PagedLayerStep", "cache_argument", "generate",
           "generate_speculative", "paged_attention_forward", "padding_mask"]
