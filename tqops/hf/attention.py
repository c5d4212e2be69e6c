"""The "tqops" attention function and padding mask for transformers' AttentionInterface / AttentionMaskInterface."""
from __future__ import annotations

from typing import Optional

import torch

from .cache import ATTN_IMPLEMENTATION, PagedLayerStep
from .transient import transient_attention, transient_format


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: PagedLayerStep,
    value: PagedLayerStep,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    s_aux: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Store this step's K/V in the layer's ``PagedKVCache`` and attend over it with tqops' paged attention.

    query ``[batch, heads, q_len, head_dim]``; ``key``/``value`` are the ``PagedLayerStep`` that
    ``PagedKVCache.update`` returned (the new keys and values ``[batch, kv_heads, q_len, head_dim]``);
    ``attention_mask`` is the "tqops" padding mask ``[batch, >= q_len]`` (True for real tokens) or None. Causal
    unless ``module.is_causal`` is False; ``sliding_window`` and ``s_aux`` (per-head sink logits ``[heads]``, gpt-oss)
    are the layer's own; ``scaling`` is the model's softmax scale (``head_dim ** -0.5`` if None). Query i of row b
    sits at position ``seq_len[b] - q_len + i``, so left padding lines up with the positions ``generate`` computes.
    Returns ``(attn_output [batch, q_len, heads, head_dim], None)`` (no attention weights).

    Without a ``PagedKVCache`` (no cache, or another Cache: ``key`` and ``value`` are then tensors ``[batch,
    kv_heads, kv_len, head_dim]`` of every key of the rows) the keys go through a cache that lives for the call, in
    ``model.config.tqops_cache_format`` (default: the 16-bit format of the model's dtype), so a cacheless forward
    (perplexity, evaluation) sees each format's keys as decoding would. Dropout and logit soft-capping are rejected.
    """
    if not isinstance(key, (PagedLayerStep, torch.Tensor)):
        raise TypeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} takes the keys of a tqops.hf.PagedKVCache step or a tensor, "
            f"but got key of type {type(key).__name__}; pass past_key_values=tqops.hf.PagedKVCache(model.config, ...) "
            "to the model or to generate()")
    if dropout:
        raise ValueError(f"dropout={dropout}; the 'tqops' attention is inference-only, expected 0.0 (model.eval())")
    if softcap is not None:
        raise NotImplementedError(f"softcap={softcap}: tqops paged attention has no attention logit soft-capping")
    if not isinstance(key, PagedLayerStep):
        return _without_paged_cache(module, query, key, value, attention_mask, scaling, sliding_window, s_aux), None
    cache, layer_idx = key.cache, key.layer_idx
    new_keys, new_values = key.key, key.value
    batch, num_heads, q_len, head_dim = query.shape
    if (new_keys.shape[0], new_keys.shape[2], new_keys.shape[3]) != (batch, q_len, head_dim):
        raise ValueError(f"query has shape {tuple(query.shape)}; expected [batch, heads, q_len, head_dim] matching "
                         f"the keys {tuple(new_keys.shape)}")
    sinks = _sinks(s_aux, num_heads)
    scale = head_dim ** -0.5 if scaling is None else float(scaling)

    layer = cache.layers[layer_idx]
    num_kv_heads = new_keys.shape[1]
    # [batch, heads, q_len, d] -> packed [batch * q_len, heads, d]: row b's tokens are back to back.
    packed_keys = new_keys.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_dim)
    packed_values = new_values.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_dim)
    packed_query = query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim)
    causal = bool(getattr(module, "is_causal", True))
    # The module's config is the model's: the first attention layer checks it against the cache's layers.
    step = cache.step_metadata(layer_idx, batch, q_len, attention_mask, getattr(module, "config", None))
    out = _store_and_attend(layer, step, packed_keys, packed_values, packed_query, causal, sliding_window, sinks, scale)
    # The last layer commits the step's row lengths: a forward that fails before (here or in any module between the
    # layers' attention) leaves the cache's lengths as they were.
    cache.finish_layer(layer_idx, step)
    return out.view(batch, q_len, num_heads, head_dim), None


def _without_paged_cache(module, query, key, value, attention_mask, scaling, sliding_window, s_aux):
    batch, num_heads, q_len, head_dim = query.shape
    if key.dim() != 4 or key.shape[0] != batch or key.shape[3] != head_dim or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be [batch, kv_heads, "
                         f"kv_len, head_dim] with the query's batch and head_dim {tuple(query.shape)}")
    if key.shape[2] < q_len:
        raise ValueError(f"key has {key.shape[2]} positions, fewer than the query's {q_len}")
    sinks = _sinks(s_aux, num_heads)
    scale = head_dim ** -0.5 if scaling is None else float(scaling)
    return transient_attention(query, key, value, attention_mask, transient_format(module, query),
                               bool(getattr(module, "is_causal", True)), sliding_window, sinks, scale)


def _sinks(s_aux, num_heads):
    if s_aux is None:
        return None
    if s_aux.shape != (num_heads,):
        raise ValueError(f"s_aux has shape {tuple(s_aux.shape)}; expected one sink logit per head ({num_heads},)")
    return s_aux.detach().float()


def _store_and_attend(layer, step, packed_keys, packed_values, packed_query, causal, sliding_window, sinks, scale):
    fmt = layer.cache_format.name
    # The raw ops: the cache built this step's metadata (distinct slots inside each row's blocks), and padding queries
    # of a left-padded prefill sit at negative positions (seq_len - q_len + i < 0), where they see no key and come out
    # 0, which the eager wrapper's q_len <= seq_len check would reject.
    torch.ops.tqops.kv_store(packed_keys, packed_values, layer.kv_cache, step.slot_mapping, fmt, 1.0, 1.0)
    return torch.ops.tqops.paged_attention(
        packed_query, layer.kv_cache, step.block_table, step.seq_lens, step.query_start_loc, fmt, causal,
        sliding_window, sinks, scale, 1.0, 1.0)


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
) -> Optional[torch.Tensor]:
    """The "tqops" mask: the last ``kv_length`` columns of the 2D padding mask, ``[batch, kv_length]`` bool (True for
    real tokens), or None without one. ``PagedKVCache.get_mask_sizes`` makes kv_length this step's token count; the
    causal structure, windows and sinks are applied inside paged attention, not by a mask."""
    if attention_mask is None:
        return None
    columns = attention_mask.shape[-1]
    # Contiguous: a view into the growing 2D mask would change strides every step, and a compiled step guards on them.
    return attention_mask[:, max(columns - kv_length, 0):].to(torch.bool).contiguous()
