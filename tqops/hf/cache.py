"""PagedKVCache: a transformers Cache whose layers are tqops paged caches (one format per layer)."""
from __future__ import annotations

import operator
from typing import Mapping, NamedTuple, Optional, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention.ops import ATTENTION_HEAD_DIMS
from ..checks import in_graph_region
from ..device_constants import allocate_kv_cache
from ..formats import CacheFormat, get_format, layer_formats
from .metadata import SequenceState, StepMetadata

ATTN_IMPLEMENTATION = "tqops"
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class PagedLayerStep(NamedTuple):
    """One layer's new K/V of this step, handed by ``PagedKVCache.update`` to the "tqops" attention function, which
    stores them (it alone sees the padding mask) and attends over the layer's cache."""

    cache: "PagedKVCache"
    layer_idx: int
    key: torch.Tensor  # [batch, kv_heads, q_len, head_dim]
    value: torch.Tensor  # [batch, kv_heads, q_len, head_dim]

    def __getattr__(self, name):
        # The cache cannot tell which attention will receive the step (the model's config decides; the cache's own
        # config may be another object), so a non-"tqops" attention is caught here, at its first tensor access
        # (key.shape, key.transpose, ...), before it writes or attends anything.
        if name.startswith("_"):
            raise AttributeError(name)
        raise ValueError(
            f"PagedKVCache needs the model's attn_implementation={ATTN_IMPLEMENTATION!r} (import tqops.hf, then load "
            f"with attn_implementation='tqops' or call model.set_attn_implementation('tqops')); the layer's "
            f"attention reads key.{name} as if the cache returned tensors, so the model uses another implementation")


class PagedCacheLayer(CacheLayerMixin):
    """One decoder layer's tqops cache ``[num_blocks, block_size, kv_heads, slot_bytes]`` uint8 in ``cache_format``;
    the row lengths live in the ``SequenceState`` shared by all layers."""

    is_compileable = True
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache_format: CacheFormat, num_kv_heads: int, head_dim: int, is_sliding: bool,
                 sequences: SequenceState):
        super().__init__()
        self.cache_format = cache_format
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.is_sliding = is_sliding
        self.sequences = sequences
        self.kv_cache: Optional[torch.Tensor] = None

    def __repr__(self):
        return f"PagedCacheLayer({self.cache_format.name}{', sliding' if self.is_sliding else ''})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate(key_states.device)

    def allocate(self, device: torch.device) -> None:
        s = self.sequences
        self.kv_cache = allocate_kv_cache(self.cache_format, s.num_blocks, s.block_size, self.num_kv_heads,
                                          self.head_dim, device=device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("a PagedCacheLayer is written by the 'tqops' attention; call PagedKVCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self):
        return _seen_tokens(self.sequences)

    def get_max_length(self) -> int:
        return self.sequences.max_cache_len

    def reset(self) -> None:
        self.sequences.reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop a PagedKVCache as a whole (PagedKVCache.crop); its layers share row lengths")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError(_NO_BEAMS)

    def offload(self):
        raise NotImplementedError("PagedKVCache does not support offloading")

    prefetch = offload


_NO_BEAMS = ("PagedKVCache does not support beam search (reorder_cache) or regrouping its rows "
             "(batch_repeat_interleave, batch_select_indices); expected generate(num_beams=1)")


def _seen_tokens(sequences: SequenceState):
    # An int in eager mode; while compiling, the tensor itself, so the graph never guards on its value.
    return sequences.seen_tokens if in_graph_region() else int(sequences.seen_tokens)


def _layer_formats(num_layers: int, cache_format, layer_cache_formats) -> list[CacheFormat]:
    return [get_format(fmt) for fmt in layer_formats(num_layers, cache_format, layer_cache_formats)]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class PagedKVCache(Cache):
    """A transformers ``Cache`` backed by tqops paged caches, for models loaded with ``attn_implementation="tqops"``.

    ``PagedKVCache(model.config, cache_format="turboquant_4bit_nc", max_batch_size=8, max_cache_len=32768,
    layer_cache_formats={0: "bf16", -1: "bf16"}, device="cuda", block_size=16)``: one cache per decoder layer in its
    format (``layer_cache_formats`` overrides ``cache_format`` by layer index, negative from the end), each holding
    ``max_batch_size`` rows of ``max_cache_len`` tokens in blocks of ``block_size``. Pass it as ``past_key_values`` to
    ``generate`` or to the model's forward. ``device=None`` allocates on the device of the first keys stored.

    - Left padding: tokens where the step's ``attention_mask`` is 0 are not stored, so row b holds exactly its real
      tokens; padding must precede a row's real tokens. ``max_cache_len`` bounds the columns processed, padding
      included (what ``get_seq_length()`` reports).
    - Each forward step is one ``update`` per layer; the attention of layer 0 places the step's tokens, and the row
      lengths (tensors updated in place, so a compiled decode step never recompiles) take the step's tokens once the
      last layer has stored and attended them. A forward that fails before then, in any layer's attention or any
      module between them, leaves the cache as it was; one that fails after (the last layer's MLP, the final norm,
      the LM head) leaves the step stored in every layer and counted, and ``crop(-q_len)`` removes it.
    - ``crop(max_length)`` rolls back every row, ``rollback_rows(tokens_to_remove)`` each row by its own count
      (speculative decoding); ``reset()`` empties every row.
    - Not supported, each a clear exception raised before the step writes anything: a batch larger than
      ``max_batch_size``, more than ``max_cache_len`` tokens, padding after real tokens, a prepared 4D mask, layer
      types other than full and sliding attention (or KV sharing between layers), head dims other than 64, 128, 256;
      beam search (``reorder_cache``, ``batch_repeat_interleave`` and ``batch_select_indices`` raise). Inference only
      (no backward through the cache).
    - ``generate`` (with ``tqops.hf`` imported) checks ``num_beams``, its rows and its ``max_length`` against the
      cache before its first step (``check_generate``). Within a step the value checks (lengths, padding) run on the
      host in eager mode; a compiled or CUDA-graph-captured step cannot read values on the host, so it checks
      ``max_cache_len`` with a device-side assert (a ``RuntimeError`` on CPU, a device-side assert error on CUDA;
      the step stores nothing) and skips the padding checks.
    """

    def __init__(self, config, cache_format: Union[str, CacheFormat] = "turboquant_4bit_nc", max_batch_size: int = 8,
                 max_cache_len: int = 32768, layer_cache_formats: Optional[Mapping[int, str]] = None,
                 device: Union[str, torch.device, None] = None, block_size: int = 16):
        if not hasattr(config, "get_text_config"):
            raise TypeError(f"config must be a transformers PretrainedConfig (model.config), got "
                            f"{type(config).__name__}")
        text_config = config.get_text_config(decoder=True)
        _positive_int("max_batch_size", max_batch_size)
        _positive_int("max_cache_len", max_cache_len)
        _positive_int("block_size", block_size)
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16 (paged_attention's tiles), got {block_size}")
        num_layers = text_config.num_hidden_layers
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        if head_dim not in ATTENTION_HEAD_DIMS:
            raise ValueError(f"config has head_dim={head_dim}; tqops paged attention supports {ATTENTION_HEAD_DIMS}")
        layer_types = getattr(text_config, "layer_types", None)
        if layer_types is None:
            sliding = getattr(text_config, "sliding_window", None) is not None
            layer_types = ["sliding_attention" if sliding else "full_attention"] * num_layers
        if len(layer_types) != num_layers:
            raise ValueError(f"config.layer_types has {len(layer_types)} entries; expected one per layer "
                             f"({num_layers})")
        unsupported = sorted({t for t in layer_types if t not in SUPPORTED_LAYER_TYPES})
        if unsupported:
            raise ValueError(f"config.layer_types has {unsupported}; PagedKVCache supports {SUPPORTED_LAYER_TYPES}")
        if getattr(text_config, "num_kv_shared_layers", 0) or getattr(text_config, "kv_sharing_modes", None):
            raise ValueError("config shares KV caches between layers; PagedKVCache expects one cache per layer")
        formats = _layer_formats(num_layers, cache_format, layer_cache_formats)
        for fmt in formats:
            fmt.check_head_dim(head_dim)

        self.config = text_config
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.sequences = SequenceState(max_batch_size, max_cache_len, block_size,
                                       torch.device("cpu") if device is None else torch.device(device))
        self._allocated = False
        super().__init__(layers=[PagedCacheLayer(fmt, num_kv_heads, head_dim, kind == "sliding_attention",
                                                 self.sequences)
                                 for fmt, kind in zip(formats, layer_types)])
        if device is not None:
            self._allocate(torch.device(device))

    def __repr__(self):
        s = self.sequences
        return (f"PagedKVCache(max_batch_size={s.max_batch_size}, max_cache_len={s.max_cache_len}, "
                f"block_size={s.block_size}, layers={self.layers})")

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.sequences.max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self.sequences.max_cache_len

    @property
    def batch_size(self) -> int:
        return self.sequences.max_batch_size

    @property
    def cache_formats(self) -> list[str]:
        return [layer.cache_format.name for layer in self.layers]

    def get_seq_length(self, layer_idx: int = 0):
        """Columns processed so far, padding included (every layer and row share it): an int in eager mode, a 0-d
        tensor while compiling. ``sequence_lengths()`` gives each row's stored (real) tokens."""
        return _seen_tokens(self.sequences)

    def sequence_lengths(self) -> torch.Tensor:
        """``[max_batch_size]`` int32: the real (stored) tokens of each row."""
        return self.sequences.seq_lens.clone()

    def get_query_offset(self, layer_idx: int = 0):
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        # The "tqops" mask keeps only the padding of this step's tokens: earlier ones are in the cache already.
        return query_length, 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.sequences.max_cache_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.sequences.max_cache_len

    # ---- the step ---------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Hand this layer's new keys and values ``[batch, kv_heads, q_len, head_dim]`` to the "tqops" attention.

        Returns ``(step, step)``, one ``PagedLayerStep``: only the "tqops" attention function consumes it (it stores
        the tokens that the padding mask marks real, then attends over the cache); another attention implementation
        raises ``ValueError`` at its first use of it, before anything is stored.
        """
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer_idx={layer_idx!r}; expected a layer index in [0, {len(self.layers)})")
        expected = f"[batch, {self.num_kv_heads}, q_len, {self.head_dim}]"
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[1::2]) != (self.num_kv_heads,
                                                                                           self.head_dim):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} has shape {shape}; expected {expected} (from the config)")
        if value_states.shape != key_states.shape:
            raise ValueError(f"value_states has shape {tuple(value_states.shape)}; expected the key's "
                             f"{tuple(key_states.shape)}")
        batch = key_states.shape[0]
        if batch > self.sequences.max_batch_size:
            # generate rejects num_beams > 1 before its first step (check_generate); a forward over rows expanded
            # for beams some other way meets this check first, so it names beams too.
            raise ValueError(f"batch size {batch} exceeds max_batch_size={self.sequences.max_batch_size}; create the "
                             "PagedKVCache with a larger max_batch_size (generate(num_beams=n) runs n rows per prompt, "
                             "but beam search is not supported: expected num_beams=1)")
        if not self._allocated:
            if in_graph_region():
                raise RuntimeError("PagedKVCache allocates its memory on the first eager step; pass device= to "
                                   "PagedKVCache or run one step before compiling")
            self._allocate(key_states.device)
        step = PagedLayerStep(self, layer_idx, key_states, value_states)
        return step, step

    def step_metadata(self, layer_idx: int, batch: int, q_len: int,
                      padding_mask: Optional[torch.Tensor]) -> StepMetadata:
        """This step's metadata: layer 0 places the step's tokens (``padding_mask`` ``[batch, >= q_len]`` bool, its
        last q_len columns for this step's tokens; None: no padding); later layers reuse it. The row lengths change
        only in ``finish_layer`` of the last layer."""
        s = self.sequences
        if layer_idx == 0:
            real = self._real_tokens(batch, q_len, padding_mask)
            # Eager steps were checked on the host (_check_step); a compiled or captured one checks on the device.
            return s.begin_step(batch, q_len, real, check_capacity=in_graph_region())
        step = s.step
        if step is None or (step.batch, step.q_len) != (batch, q_len):
            raise RuntimeError(f"layer {layer_idx} runs a step of batch {batch} x {q_len} tokens that layer 0 did "
                               "not start; every forward must run the layers in order from layer 0")
        return step

    def finish_layer(self, layer_idx: int, step: StepMetadata) -> None:
        """Layer ``layer_idx`` stored and attended ``step``; after the last layer the cache takes the step's lengths.
        Until then the cache is as it was before the step, so a forward that fails anywhere before leaves it so."""
        if layer_idx == len(self.layers) - 1:
            # Nothing keeps the step's tensors past its last layer (under CUDA graphs they are graph outputs that the
            # next replay overwrites).
            self.sequences.commit_step(step)

    def check_generate(self, generation_config, batch_size: Optional[int] = None,
                       max_cache_length: Optional[int] = None) -> None:
        """What transformers' ``generate`` is about to run with this cache, checked before its first step (importing
        ``tqops.hf`` makes ``generate`` call this): beam search, more rows than ``max_batch_size`` (``batch_size``
        prompts times ``num_return_sequences``), and more columns than ``max_cache_len`` (``max_cache_length``, which
        ``generate`` derives as ``max_length - 1``: the prompt's width, padding included, plus ``max_new_tokens``, less
        the last token, which is never fed back). Each a ``ValueError`` before anything is written."""
        num_beams = getattr(generation_config, "num_beams", None) or 1
        if num_beams > 1:
            raise ValueError(f"generate got num_beams={num_beams}, but PagedKVCache does not support beam search (it "
                             "cannot reorder its rows between beams); expected num_beams=1")
        sequences = getattr(generation_config, "num_return_sequences", None) or 1
        if batch_size is not None and batch_size * sequences > self.max_batch_size:
            raise ValueError(f"generate runs {batch_size * sequences} rows ({batch_size} prompts x "
                             f"num_return_sequences={sequences}), past max_batch_size={self.max_batch_size}; create "
                             f"the PagedKVCache with max_batch_size >= {batch_size * sequences}")
        if max_cache_length is None:
            max_length = getattr(generation_config, "max_length", None)
            max_cache_length = None if max_length is None else max_length - 1
        if max_cache_length is not None and max_cache_length > self.max_cache_len:
            raise ValueError(f"generate needs the cache to hold {max_cache_length} tokens (the prompt's width, padding "
                             f"included, plus max_new_tokens - 1), past max_cache_len={self.max_cache_len}; create "
                             f"the PagedKVCache with max_cache_len >= {max_cache_length} or generate fewer tokens")

    def _real_tokens(self, batch: int, q_len: int, padding_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``[batch, q_len]`` bool: this step's tokens to store (None: all); checked in eager mode."""
        real = None
        if padding_mask is not None:
            if not isinstance(padding_mask, torch.Tensor) or padding_mask.dim() != 2:
                shape = tuple(padding_mask.shape) if isinstance(padding_mask, torch.Tensor) else padding_mask
                raise ValueError(f"attention_mask reaching the 'tqops' attention is {shape}; expected a 2D padding "
                                 "mask [batch, columns] (1 for real tokens), not a prepared 4D mask")
            if padding_mask.shape[0] != batch or padding_mask.shape[1] < q_len:
                raise ValueError(f"attention_mask has shape {tuple(padding_mask.shape)}; expected [{batch}, >= {q_len}]"
                                 " (batch, columns ending with this step's tokens)")
            real = padding_mask[:, padding_mask.shape[1] - q_len:].to(torch.bool)
        if not in_graph_region():
            self._check_step(batch, q_len, real)
        return real

    def _check_step(self, batch: int, q_len: int, real: Optional[torch.Tensor]) -> None:
        s = self.sequences
        seen = int(s.seen_tokens)
        if seen + q_len > s.max_cache_len:
            raise ValueError(f"this step brings the cache to {seen + q_len} tokens (padding included), past "
                             f"max_cache_len={s.max_cache_len}; create the PagedKVCache with a larger max_cache_len")
        if real is None:
            return
        if bool((real[:, 1:] < real[:, :-1]).any()):
            row = int((real[:, 1:] < real[:, :-1]).any(1).nonzero()[0, 0])
            raise ValueError(f"attention_mask row {row} has padding after a real token in this step; PagedKVCache "
                             "supports left padding only (padding_side='left')")
        holds = s.seq_lens[:batch] > 0
        padded_late = holds & ~real.all(1)
        if bool(padded_late.any()):
            row = int(padded_late.nonzero()[0, 0])
            raise ValueError(f"attention_mask row {row} has padding but the row already holds "
                             f"{int(s.seq_lens[row])} tokens; PagedKVCache supports left padding only (padding must "
                             "precede a row's first real token)")

    def _allocate(self, device: torch.device) -> None:
        s = self.sequences
        s.block_table, s.seq_lens, s.seen_tokens = (t.to(device) for t in s.tensors())
        for layer in self.layers:
            layer.allocate(device)
        if not in_graph_region():
            # Fixed addresses let a compiled step with CUDA graphs (mode="reduce-overhead") mutate them in place.
            for t in (*s.tensors(), *(layer.kv_cache for layer in self.layers)):
                torch._dynamo.mark_static_address(t)
        self._allocated = True

    # ---- rollback and what is not supported ----------------------------------------------------
    def crop(self, max_length: int) -> None:
        """Roll back to the first ``max_length`` columns (padding included); negative removes ``-max_length`` columns
        and 0 removes nothing, as transformers 5 treats it. A ``max_length`` at or past the current length is a no-op.
        Eager only (it reads the length on the host)."""
        try:
            # transformers' assisted decoding may pass a 0-d integer tensor
            length = None if isinstance(max_length, bool) else operator.index(max_length)
        except TypeError:
            length = None
        if length is None:
            raise TypeError(f"max_length must be an int, got {type(max_length).__name__}")
        max_length = length
        seen = int(self.sequences.seen_tokens)
        if max_length < 0:
            if -max_length > seen:
                raise ValueError(f"crop({max_length}) removes {-max_length} tokens, but the cache holds {seen}; "
                                 f"expected max_length in [-{seen}, ...]")
            keep = seen + max_length
        else:
            keep = seen if max_length == 0 else min(max_length, seen)
        if keep != seen:
            self.sequences.crop(keep)

    def rollback_rows(self, tokens_to_remove) -> None:
        """Per-row rollback (speculative decoding, where rows accept different numbers of drafts): drop the last
        ``tokens_to_remove[b]`` real tokens of row b, for the first ``len(tokens_to_remove)`` rows (a ``[batch]``
        integer tensor or sequence). Afterwards ``get_seq_length()`` is the longest row's length, as if every row
        were left-padded to it; a row's next tokens go right after its remaining ones. Checked in eager mode."""
        s = self.sequences
        counts = torch.as_tensor(tokens_to_remove, device=s.seq_lens.device)
        if counts.dim() != 1 or counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
            raise TypeError(f"tokens_to_remove must be a 1-D integer tensor or sequence [batch], got "
                            f"{counts.dtype} of shape {tuple(counts.shape)}")
        if not 1 <= counts.shape[0] <= s.max_batch_size:
            raise ValueError(f"tokens_to_remove has {counts.shape[0]} rows; expected 1 to "
                             f"max_batch_size={s.max_batch_size}")
        if not in_graph_region():
            held = s.seq_lens[:counts.shape[0]]
            bad = (counts < 0) | (counts > held)
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                raise ValueError(f"tokens_to_remove[{row}] = {int(counts[row])}, but row {row} holds {int(held[row])} "
                                 "tokens; expected a count in [0, tokens held]")
        s.rollback_rows(counts)

    def reset(self) -> None:
        """Empty every row (the memory is kept; nothing reads a slot before it is written again)."""
        self.sequences.reset()

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError(_NO_BEAMS)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(_NO_BEAMS)

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError(_NO_BEAMS)

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return self._allocated
