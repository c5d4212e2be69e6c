"""PagedKVCache: a transformers Cache whose layers are tqops paged caches (one format per layer)."""
from __future__ import annotations

import contextlib
import operator
from typing import Mapping, NamedTuple, Optional, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

from ..attention.ops import ATTENTION_HEAD_DIMS
from ..checks import check_device, in_graph_region
from ..device_constants import allocate_kv_cache
from ..formats import CacheFormat, get_format, layer_formats
from .linear_replay import StepInputs, recording, replay
from .metadata import SequenceState, StepMetadata

ATTN_IMPLEMENTATION = "tqops"
LINEAR_ATTENTION = "linear_attention"
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", LINEAR_ATTENTION)
# The Gated DeltaNet fields of a Qwen3.5 text config that size a linear-attention layer's states.
LINEAR_ATTENTION_FIELDS = ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                           "linear_key_head_dim", "linear_value_head_dim")


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


_NO_BEAMS = ("PagedKVCache does not support beam search (reorder_cache) or regrouping its rows "
             "(batch_repeat_interleave, batch_select_indices); expected generate(num_beams=1)")


class _LayerOfPagedKVCache:
    """What a layer of a ``PagedKVCache`` leaves to the cache as a whole (crop), or does not do (beams, offloading)."""

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop a PagedKVCache as a whole (PagedKVCache.crop); its layers share row lengths")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError(_NO_BEAMS)

    def offload(self):
        raise NotImplementedError("PagedKVCache does not support offloading")

    prefetch = offload


class PagedCacheLayer(_LayerOfPagedKVCache, CacheLayerMixin):
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



_NO_LINEAR_ROLLBACK = (
    "a linear-attention (Gated DeltaNet) layer keeps one recurrent state per row, which cannot be cut back from its "
    "final value; it can take back tokens of the last step only, replayed from that step's inputs, which the cache "
    "sees inside `with cache.record_linear_inputs(model):` (tqops.hf.generate_speculative records them)")


class LinearAttentionCacheLayer(_LayerOfPagedKVCache, LinearAttentionLayer):
    """One linear-attention (Gated DeltaNet) layer's states, as transformers' ``LinearAttentionLayer`` keeps them but
    preallocated for ``max_rows`` rows at fixed addresses: conv states ``[max_rows, conv_dim, conv_kernel]`` (the
    model's dtype) and recurrent states ``[max_rows, num_heads, head_k_dim, head_v_dim]`` (float32, what transformers'
    delta rules return). A step of ``batch`` rows reads and writes rows ``[0, batch)``.

    What a step writes is held apart until its owner commits it: the conv state that transformers' single-token path
    updates in place is a scratch copy (``conv_states[0]``, refreshed from the committed one each time it is handed
    out), and the new recurrent state is kept as the tensor the delta rule returned. ``commit`` copies both into the
    committed buffers, so a step that fails before its commit leaves the layer as it was. ``deferred=False`` (a layer
    after the last full-attention layer, which runs after the step's commit) commits as soon as it has run.
    """

    is_compileable = True
    is_croppable = False
    supports_early_init = False

    def __init__(self, layer_idx: int, conv_dim: int, conv_kernel: int, num_heads: int, head_k_dim: int,
                 head_v_dim: int, max_rows: int, deferred: bool):
        # Not the mixin's __init__: its dicts of states are views of the preallocated buffers here (properties).
        self.layer_idx = layer_idx
        self.conv_shape = (conv_dim, conv_kernel)
        self.recurrent_shape = (num_heads, head_k_dim, head_v_dim)
        self.max_rows = max_rows
        self.deferred = deferred
        self.number_of_states = 1
        self.conv_kernel_size = {0: conv_kernel}
        self.has_previous_state = {0: False}
        self.is_conv_states_initialized = {0: False}
        self.is_recurrent_states_initialized = {0: False}
        self.record_past = False
        self.device = self.dtype = None
        self.rows = 0  # rows holding a state (the batch of the step that started them)
        self.conv: Optional[torch.Tensor] = None  # committed
        self.conv_scratch: Optional[torch.Tensor] = None  # what this step writes
        self.recurrent: Optional[torch.Tensor] = None  # committed
        self.pending: Optional[torch.Tensor] = None  # this step's new recurrent state, until the commit
        # Rollback (inside PagedKVCache.record_linear_inputs): this step's inputs, then the last committed step's and
        # the states before it, from which a rollback replays the tokens it keeps.
        self.recording = False
        self.step_inputs: Optional[StepInputs] = None
        self.last_inputs: Optional[StepInputs] = None
        self.before: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def __repr__(self):
        return (f"LinearAttentionCacheLayer(conv {list(self.conv_shape)}, recurrent {list(self.recurrent_shape)})")

    # ---- storage ----------------------------------------------------------------------------
    def allocate(self, device: torch.device, conv_dtype: torch.dtype,
                 recurrent_dtype: torch.dtype = torch.float32) -> None:
        self._allocate_conv(device, conv_dtype)
        self._allocate_recurrent(device, recurrent_dtype)

    def _allocate_conv(self, device, dtype) -> None:
        self.conv = torch.empty((self.max_rows, *self.conv_shape), dtype=dtype, device=device)
        self.conv_scratch = torch.empty_like(self.conv)
        self.device, self.dtype = self.conv.device, dtype
        self.is_conv_states_initialized[0] = True
        self._mark_static(self.conv, self.conv_scratch)

    def _allocate_recurrent(self, device, dtype) -> None:
        self.recurrent = torch.empty((self.max_rows, *self.recurrent_shape), dtype=dtype, device=device)
        self.is_recurrent_states_initialized[0] = True
        self._mark_static(self.recurrent)

    @staticmethod
    def _mark_static(*tensors) -> None:
        if not in_graph_region():
            # Fixed addresses let a compiled step with CUDA graphs (mode="reduce-overhead") mutate them in place.
            for t in tensors:
                torch._dynamo.mark_static_address(t)

    def lazy_initialization(self, *args, **kwargs) -> None:
        raise NotImplementedError("a LinearAttentionCacheLayer is allocated by its PagedKVCache")

    def _match(self, name: str, states: torch.Tensor, current: torch.Tensor, allocate) -> None:
        """Before the first state is stored: take the step's dtype (the model's) if the guess at allocation was
        another; afterwards every step must match."""
        if states.device != current.device:
            raise ValueError(f"{name} of layer {self.layer_idx} are on {states.device}, but the PagedKVCache is on "
                             f"{current.device}; create it with device={str(states.device)!r}")
        if states.dtype == current.dtype:
            return
        if self.rows:
            raise ValueError(f"{name} of layer {self.layer_idx} have dtype {states.dtype}, but the cache holds "
                             f"{current.dtype} states; run every step in one dtype (or reset() first)")
        if in_graph_region():
            raise RuntimeError(f"{name} of layer {self.layer_idx} have dtype {states.dtype}, not the {current.dtype} "
                               "the PagedKVCache allocated; run one step eagerly before compiling")
        allocate(current.device, states.dtype)

    # ---- what transformers' Gated DeltaNet reads and writes --------------------------------------
    @property
    def conv_states(self) -> dict:
        """``{0: conv state}`` of the rows held, as transformers 5.17's Gated DeltaNet reads it (before a one-token
        step, which updates it in place): a fresh scratch copy of the committed state each time."""
        return {0: self.serve_conv_state()}

    @property
    def recurrent_states(self) -> dict:
        return {0: self.serve_recurrent_state()}

    def serve_conv_state(self) -> Optional[torch.Tensor]:
        if not self.has_previous_state[0]:
            return None
        scratch = self.conv_scratch[:self.rows]
        scratch.copy_(self.conv[:self.rows])
        return scratch

    def serve_recurrent_state(self) -> Optional[torch.Tensor]:
        # Read only: transformers' delta rules (torch and fla) return a new final state.
        return self.recurrent[:self.rows] if self.has_previous_state[0] else None

    def _check(self, name: str, states, expected: tuple, shape: str) -> int:
        """``states`` is ``[batch, *expected, ...]`` (``shape`` in words); returns its batch."""
        dims = shape.count(",") + 1
        if (not isinstance(states, torch.Tensor) or states.dim() != dims
                or tuple(states.shape[1:1 + len(expected)]) != expected):
            got = tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__
            raise ValueError(f"{name} of layer {self.layer_idx} has shape {got}; expected {shape} (from the config)")
        self.check_batch(states.shape[0])
        return states.shape[0]

    def check_batch(self, batch: int) -> None:
        if batch > self.max_rows:
            raise ValueError(f"batch size {batch} exceeds max_batch_size={self.max_rows}; create the PagedKVCache "
                             "with a larger max_batch_size")
        if self.rows and batch != self.rows:
            raise ValueError(f"this step has {batch} rows, but the linear-attention states hold {self.rows} (the batch "
                             "that started them); run every step of a sequence with the same batch, or reset() first")

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: Optional[int] = None,
                          **kwargs) -> torch.Tensor:
        """A step of several tokens (or the first step): store the last ``conv_kernel`` columns of the committed state
        followed by ``conv_states`` ``[batch, conv_dim, tokens]`` (in the scratch state), and return that
        concatenation, zero-padded on the left to ``conv_kernel`` columns on a first step, as transformers does."""
        batch = self._check("conv_states", conv_states, (self.conv_shape[0],), f"[batch, {self.conv_shape[0]}, tokens]")
        kernel = self.conv_shape[1]
        if conv_kernel_size is not None and conv_kernel_size != kernel:
            raise ValueError(f"layer {self.layer_idx} has conv_kernel_size={conv_kernel_size}; the config's "
                             f"linear_conv_kernel_dim is {kernel}")
        self._match("conv_states", conv_states, self.conv, self._allocate_conv)
        if self.has_previous_state[0]:
            full = torch.cat([self.conv[:batch], conv_states], dim=-1)
        elif conv_states.shape[-1] < kernel:
            full = torch.nn.functional.pad(conv_states, (kernel - conv_states.shape[-1], 0))
        else:
            full = conv_states
        self.conv_scratch[:batch].copy_(full[..., -kernel:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """The layer's step is done (transformers' last cache call in it): hold its new recurrent state ``[batch,
        num_heads, head_k_dim, head_v_dim]`` until the commit (or commit now, if not deferred)."""
        self._check("recurrent_states", recurrent_states, self.recurrent_shape,
                    f"[batch, {', '.join(map(str, self.recurrent_shape))}]")
        self._match("recurrent_states", recurrent_states, self.recurrent, self._allocate_recurrent)
        self.pending = recurrent_states
        if not self.deferred:
            self.commit(recurrent_states.shape[0])
        return recurrent_states

    def ready(self, batch: int) -> bool:
        return self.pending is not None and self.pending.shape[0] == batch

    def record(self, inputs: StepInputs) -> None:
        """This step's module and input (from ``record_linear_inputs``' hook), kept for a rollback once committed."""
        self.step_inputs = inputs

    def commit(self, batch: int) -> None:
        """The step of ``batch`` rows becomes the layer's state (in place, so a compiled step mutates the same
        tensors every time). While recording, the states before it are kept with its inputs, for ``rollback``."""
        recorded = self.recording and self.step_inputs is not None and self.has_previous_state[0]
        self.before = (self.conv[:batch].clone(), self.recurrent[:batch].clone()) if recorded else None
        self.last_inputs = self.step_inputs if recorded else None
        self.step_inputs = None
        self.conv[:batch].copy_(self.conv_scratch[:batch])
        self.recurrent[:batch].copy_(self.pending)
        self.pending = None
        if not self.has_previous_state[0]:
            self.has_previous_state[0] = True
            self.rows = batch

    def can_roll_back(self, columns: torch.Tensor) -> bool:
        """Whether the last step was recorded and covers ``columns[b]`` of row b's last columns."""
        inputs = self.last_inputs
        return (inputs is not None and columns.shape[0] == inputs.hidden.shape[0]
                and bool((columns <= inputs.hidden.shape[1]).all()))

    def roll_back(self, columns: torch.Tensor) -> None:
        """Take back the last ``columns[b]`` columns of the last step from row b (``can_roll_back`` first): the states
        become those after only the step's first columns, replayed from the states before it. Once per step."""
        keep = self.last_inputs.hidden.shape[1] - columns
        conv, recurrent = replay(self.last_inputs, *self.before, keep)
        batch = columns.shape[0]
        self.conv[:batch].copy_(conv)
        self.recurrent[:batch].copy_(recurrent)
        self.last_inputs = self.before = None

    def reset(self) -> None:
        """Hold no state (the memory is kept: nothing reads a row before a first step writes it)."""
        self.has_previous_state[0] = False
        self.rows = 0
        self.pending = None
        self.step_inputs = self.last_inputs = self.before = None

    def activate_past_recording(self):
        raise NotImplementedError(f"PagedKVCache cannot record past linear-attention states for a rollback: "
                                  f"{_NO_LINEAR_ROLLBACK}")



def _seen_tokens(sequences: SequenceState):
    # An int in eager mode; while compiling, the tensor itself, so the graph never guards on its value.
    return sequences.seen_tokens if in_graph_region() else int(sequences.seen_tokens)


def _layer_formats(num_layers: int, cache_format, layer_cache_formats) -> list[CacheFormat]:
    return [get_format(fmt) for fmt in layer_formats(num_layers, cache_format, layer_cache_formats)]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _linear_attention_dims(config) -> tuple[int, int, int, int, int]:
    """``(conv_dim, conv_kernel, num_value_heads, head_k_dim, head_v_dim)`` of a Gated DeltaNet layer (Qwen3.5): the
    conv states are ``[rows, conv_dim, conv_kernel]`` and the recurrent states ``[rows, num_value_heads, head_k_dim,
    head_v_dim]``, as transformers' ``Qwen3_5GatedDeltaNet`` passes them to the cache."""
    values = {name: getattr(config, name, None) for name in LINEAR_ATTENTION_FIELDS}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"config.layer_types has linear_attention layers, but config.{name}={value!r}; "
                             f"PagedKVCache holds Gated DeltaNet states (Qwen3.5), sized by {LINEAR_ATTENTION_FIELDS}, "
                             "each a positive int")
    kernel, key_heads, value_heads, head_k, head_v = (values[name] for name in LINEAR_ATTENTION_FIELDS)
    if value_heads % key_heads:
        raise ValueError(f"config has linear_num_value_heads={value_heads}, not a multiple of "
                         f"linear_num_key_heads={key_heads}; a Gated DeltaNet layer shares each key head among "
                         "value heads")
    return 2 * key_heads * head_k + value_heads * head_v, kernel, value_heads, head_k, head_v


def _layer_types(text_config, num_layers: int) -> list[str]:
    """Each decoder layer's kind (``config.layer_types``, or one kind for all from ``sliding_window``)."""
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        sliding = getattr(text_config, "sliding_window", None) is not None
        layer_types = ["sliding_attention" if sliding else "full_attention"] * num_layers
    return list(layer_types)


def _describe_layers(layer_types: list) -> str:
    """``[linear_attention x3, full_attention]``: runs of one kind counted."""
    runs = []
    for kind in layer_types:
        if runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
    return "[" + ", ".join(kind if n == 1 else f"{kind} x{n}" for kind, n in runs) + "]"


def _config_dtype(config) -> torch.dtype:
    """The model's dtype as its config states it (the conv states' dtype, until a first step shows another)."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


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
    - Each forward step is one ``update`` per attention layer; the first attention layer places the step's tokens, and
      the row lengths (tensors updated in place, so a compiled decode step never recompiles) take the step's tokens
      once the last attention layer has stored and attended them (the commit). A forward that fails before then, in
      any layer's attention or any module between them, leaves the cache as it was; one that fails after (the last
      attention layer's MLP, later layers, the final norm, the LM head) leaves the step stored in every layer and
      counted, and ``crop(-q_len)`` removes it (not in a hybrid cache: see below).
    - ``crop(max_length)`` rolls back every row, ``rollback_rows(tokens_to_remove)`` each row by its own count
      (speculative decoding); ``reset()`` empties every row.
    - Hybrid models (``config.layer_types`` with ``"linear_attention"``: Qwen3.5 and Qwen3.5-MoE, text or
      vision-language, whose Gated DeltaNet layers alternate with gated full attention): the attention layers are
      paged caches as above (``layer_cache_formats`` names them by their index among all decoder layers; naming a
      linear-attention layer is a ``ValueError``), and each linear-attention layer is a
      ``LinearAttentionCacheLayer``: transformers' ``LinearAttentionLayer`` preallocated for ``max_batch_size`` rows
      at fixed addresses, conv states ``[rows, conv_dim, linear_conv_kernel_dim]`` and float32 recurrent states
      ``[rows, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim]``, served and updated as
      transformers 5.17 and 5.24 ask for them (``has_previous_state``, ``get_conv_state``, ``update_conv_state``,
      ``get_recurrent_state``, ``update_recurrent_state``, and ``layers[i].conv_states[0]`` /
      ``recurrent_states[0]``). A step of ``batch`` rows uses rows ``[0, batch)``; the states take the batch of the
      first step after a reset, and every later step must have that batch (another batch fails before anything is
      written: a ``ValueError`` here, or for a one-token step the model's own shape error in its conv update). The
      linear-attention layers before the last attention layer hold their step apart (the conv state that the
      one-token path updates in place is a scratch copy, the new recurrent state is the tensor the delta rule
      returned, kept alive until the commit: one recurrent state per such layer) and take it at the commit, so a step
      that fails before the commit leaves them as they were too. A linear-attention layer after the last attention
      layer (none in Qwen3.5, whose last layer is full attention) runs after the commit and takes its step at once: a
      failure in or after it leaves the step stored and counted, and only ``reset()`` takes it back. The decode step
      compiles with ``fullgraph=True`` once (tested on CPU).
      Rollback: a recurrent state cannot be cut back from its final value, and transformers' Gated DeltaNet never
      shows the cache its per-token inputs (it calls its delta-rule functions as module globals). Inside
      ``with cache.record_linear_inputs(model):`` forward pre-hooks hand each Gated DeltaNet module's input to its
      cache layer, which keeps the last committed step's input and the states before it (one more state per layer);
      ``rollback_rows`` and ``crop`` then take back tokens of that step by replaying the kept ones from those states
      with tqops' Gated DeltaNet ops (the rejected ones masked to identities), once per step. Outside it, or past the
      last step, they raise ``NotImplementedError`` (a crop that removes nothing works). ``generate_speculative``
      records; ``is_croppable`` is False and ``activate_past_recording`` raises (transformers' assisted and
      prompt-lookup decoding refuse these models themselves).
    - Not supported, each a clear exception raised before the step writes anything: a model whose decoder layers
      are not those of the config the cache was built from (another number or kind; ``check_model``, run by the first
      attention layer of each step and by ``generate``), a batch larger than
      ``max_batch_size``, more than ``max_cache_len`` tokens, padding after real tokens, a prepared 4D mask, layer
      types other than full, sliding and linear attention (or KV sharing between layers), head dims other than 64,
      128, 256, linear-attention fields missing from the config or inconsistent (value heads not a multiple of key
      heads); beam search (``reorder_cache``, ``batch_repeat_interleave`` and ``batch_select_indices`` raise).
      Inference only (no backward through the cache).
    - ``generate`` (with ``tqops.hf`` imported) checks the model's layers, ``num_beams``, its rows and its
      ``max_length`` against the cache before its first step (``check_generate``). Within a step the value checks
      (lengths, padding) run on the host in eager mode; a compiled or CUDA-graph-captured step cannot read values on
      the host, so it checks ``max_cache_len`` with a device-side assert (a ``RuntimeError`` on CPU, a device-side
      assert error on CUDA; the step stores nothing) and skips the padding checks.
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
        layer_types = _layer_types(text_config, num_layers)
        if len(layer_types) != num_layers:
            raise ValueError(f"config.layer_types has {len(layer_types)} entries; expected one per layer "
                             f"({num_layers})")
        unsupported = sorted({t for t in layer_types if t not in SUPPORTED_LAYER_TYPES})
        if unsupported:
            raise ValueError(f"config.layer_types has {unsupported}; PagedKVCache supports {SUPPORTED_LAYER_TYPES}")
        if getattr(text_config, "num_kv_shared_layers", 0) or getattr(text_config, "kv_sharing_modes", None):
            raise ValueError("config shares KV caches between layers; PagedKVCache expects one cache per layer")
        linear = [i for i, kind in enumerate(layer_types) if kind == LINEAR_ATTENTION]
        attention = [i for i, kind in enumerate(layer_types) if kind != LINEAR_ATTENTION]
        if not attention:
            raise ValueError("config.layer_types has only linear_attention layers; PagedKVCache needs at least one "
                             "full or sliding attention layer")
        linear_dims = _linear_attention_dims(text_config) if linear else None
        formats = _layer_formats(num_layers, cache_format, layer_cache_formats)
        for key in (layer_cache_formats or {}):
            if layer_types[key % num_layers] == LINEAR_ATTENTION:
                raise ValueError(f"layer_cache_formats has key {key}, but layer {key % num_layers} is a "
                                 f"linear-attention (Gated DeltaNet) layer, which keeps no K/V cache; the attention "
                                 f"layers are {attention}")
        for i in attention:
            formats[i].check_head_dim(head_dim)

        self.config = text_config
        self._layer_types = list(layer_types)
        self._checked_model_config = None  # the last model config check_model passed
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        if device is not None:
            device = check_device("device", device)
        self.sequences = SequenceState(max_batch_size, max_cache_len, block_size,
                                       torch.device("cpu") if device is None else device)
        self._allocated = False
        # The first attention layer places a step's tokens; the last one commits the step (lengths and the states of
        # the linear-attention layers before it).
        self._first_attention, self._last_attention = attention[0], attention[-1]
        self._conv_dtype = _config_dtype(text_config)
        layers = []
        for i, (fmt, kind) in enumerate(zip(formats, layer_types)):
            if kind == LINEAR_ATTENTION:
                layers.append(LinearAttentionCacheLayer(i, *linear_dims, max_batch_size,
                                                        deferred=i < self._last_attention))
            else:
                layers.append(PagedCacheLayer(fmt, num_kv_heads, head_dim, kind == "sliding_attention",
                                              self.sequences))
        self._linear_layers = [layers[i] for i in linear]
        super().__init__(layers=layers)
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
    def cache_formats(self) -> list[Optional[str]]:
        """Each layer's cache format (None for a linear-attention layer, which keeps states, not K/V)."""
        return [layer.cache_format.name if isinstance(layer, PagedCacheLayer) else None for layer in self.layers]

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention (Gated DeltaNet, Qwen3.5), with states instead of K/V."""
        return bool(self._linear_layers)

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
        if not isinstance(self.layers[layer_idx], PagedCacheLayer):
            raise ValueError(f"layer {layer_idx} is a linear-attention layer (config.layer_types); it keeps conv and "
                             "recurrent states (update_conv_state, update_recurrent_state), not keys and values")
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
        if self._linear_layers:
            self._linear_layers[0].check_batch(batch)
        if not self._allocated:
            if in_graph_region():
                raise RuntimeError("PagedKVCache allocates its memory on the first eager step; pass device= to "
                                   "PagedKVCache or run one step before compiling")
            self._allocate(key_states.device)
        step = PagedLayerStep(self, layer_idx, key_states, value_states)
        return step, step

    def step_metadata(self, layer_idx: int, batch: int, q_len: int, padding_mask: Optional[torch.Tensor],
                      model_config=None) -> StepMetadata:
        """This step's metadata: the first attention layer (layer 0 but in a hybrid model) checks ``model_config``
        (``check_model``) and places the step's tokens (``padding_mask`` ``[batch, >= q_len]`` bool, its last q_len
        columns for this step's tokens; None: no padding); later layers reuse it. The row lengths change only in
        ``finish_layer`` of the last attention layer."""
        s = self.sequences
        if layer_idx == self._first_attention:
            self.check_model(model_config)
            real = self._real_tokens(batch, q_len, padding_mask)
            # Eager steps were checked on the host (_check_step); a compiled or captured one checks on the device.
            return s.begin_step(batch, q_len, real, check_capacity=in_graph_region())
        step = s.step
        if step is None or (step.batch, step.q_len) != (batch, q_len):
            raise RuntimeError(f"layer {layer_idx} runs a step of batch {batch} x {q_len} tokens that layer "
                               f"{self._first_attention} did not start; every forward must run the layers in order "
                               f"from layer 0")
        return step

    def finish_layer(self, layer_idx: int, step: StepMetadata) -> None:
        """Layer ``layer_idx`` stored and attended ``step``; after the last attention layer the cache takes the step's
        lengths, and the linear-attention layers before it their new states. Until then the cache is as it was before
        the step, so a forward that fails anywhere before leaves it so."""
        if layer_idx == self._last_attention:
            deferred = [layer for layer in self._linear_layers if layer.deferred]
            missing = [layer.layer_idx for layer in deferred if not layer.ready(step.batch)]
            if missing:
                raise RuntimeError(f"linear-attention layers {missing} did not run this step of {step.batch} rows "
                                   "before its last attention layer; every forward must run the layers in order")
            # Nothing keeps the step's tensors past its last layer (under CUDA graphs they are graph outputs that the
            # next replay overwrites).
            self.sequences.commit_step(step)
            for layer in deferred:
                layer.commit(step.batch)

    def check_model(self, model_config) -> None:
        """The model that runs a step over this cache has the decoder layers the cache was built for: the same number
        (``num_hidden_layers`` of ``model_config``'s text config) and the same kind at each index (full, sliding or
        linear attention), else a ``ValueError`` naming both. With more layers in the cache than in the model its last
        attention layer would never run, so no step would ever be committed (each one overwriting the last); with
        fewer, the last one would commit the step before the model's next layer fails. The "tqops" attention calls
        this at the first attention layer of every step, before anything is stored (with the attention module's
        ``config``), and ``check_generate`` before ``generate``'s first step. A config without
        ``num_hidden_layers`` is not checked; a config that passed is not checked again."""
        if model_config is None or model_config is self._checked_model_config:
            return
        text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else \
            model_config
        num_layers = getattr(text, "num_hidden_layers", None)
        if not isinstance(num_layers, int):
            return
        layer_types = _layer_types(text, num_layers)
        if num_layers != len(self.layers) or layer_types != self._layer_types:
            raise ValueError(f"the model has {num_layers} decoder layers {_describe_layers(layer_types)}, but this "
                             f"PagedKVCache was built for {len(self.layers)} {_describe_layers(self._layer_types)}; "
                             "create it from the model's own config: PagedKVCache(model.config, ...)")
        self._checked_model_config = model_config

    def check_generate(self, generation_config, batch_size: Optional[int] = None,
                       max_cache_length: Optional[int] = None, model_config=None) -> None:
        """What transformers' ``generate`` is about to run with this cache, checked before its first step (importing
        ``tqops.hf`` makes ``generate`` call this): the model's layers (``model_config``: ``check_model``), beam
        search, more rows than ``max_batch_size`` (``batch_size`` prompts times ``num_return_sequences``), and more
        columns than ``max_cache_len`` (``max_cache_length``, which ``generate`` derives as ``max_length - 1``: the
        prompt's width, padding included, plus ``max_new_tokens``, less the last token, which is never fed back).
        Each a ``ValueError`` before anything is written."""
        self.check_model(model_config)
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

    def _allocate(self, device: torch.device, conv_dtype: Optional[torch.dtype] = None) -> None:
        s = self.sequences
        s.block_table, s.seq_lens, s.seen_tokens = (t.to(device) for t in s.tensors())
        for layer in self.layers:
            if isinstance(layer, PagedCacheLayer):
                layer.allocate(device)
            else:  # marks its own buffers static
                layer.allocate(device, conv_dtype or self._conv_dtype)
        if not in_graph_region():
            # Fixed addresses let a compiled step with CUDA graphs (mode="reduce-overhead") mutate them in place.
            paged = [layer.kv_cache for layer in self.layers if isinstance(layer, PagedCacheLayer)]
            for t in (*s.tensors(), *paged):
                torch._dynamo.mark_static_address(t)
        self._allocated = True

    # ---- linear-attention (Gated DeltaNet) states, as transformers' Cache serves them -------------------------
    def _linear_layer(self, layer_idx, state_idx=0) -> LinearAttentionCacheLayer:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer_idx={layer_idx!r}; expected a layer index in [0, {len(self.layers)})")
        layer = self.layers[layer_idx]
        if not isinstance(layer, LinearAttentionCacheLayer):
            raise ValueError(f"layer {layer_idx} is an attention layer of the PagedKVCache, not a linear-attention "
                             "layer; it keeps no conv or recurrent states")
        if state_idx != 0:
            raise ValueError(f"state_idx={state_idx!r}; a Gated DeltaNet layer has one conv and one recurrent state "
                             "(state_idx=0)")
        return layer

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Optional[torch.Tensor]:
        """Layer ``layer_idx``'s conv state ``[rows, conv_dim, conv_kernel]``, None before its first step. A scratch
        copy of the committed state, which a one-token step updates in place (transformers 5.24 reads it here, 5.17
        as ``layers[layer_idx].conv_states[0]``)."""
        return self._linear_layer(layer_idx, state_idx).serve_conv_state()

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Optional[torch.Tensor]:
        """Layer ``layer_idx``'s recurrent state ``[rows, num_heads, head_k_dim, head_v_dim]``, None before its first
        step."""
        return self._linear_layer(layer_idx, state_idx).serve_recurrent_state()

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          **kwargs) -> torch.Tensor:
        layer = self._linear_layer(layer_idx, state_idx)
        if not self._allocated:
            if in_graph_region():
                raise RuntimeError("PagedKVCache allocates its memory on the first eager step; pass device= to "
                                   "PagedKVCache or run one step before compiling")
            self._allocate(conv_states.device, conv_states.dtype)
        return layer.update_conv_state(conv_states, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        layer = self._linear_layer(layer_idx, state_idx)
        if layer.recurrent is None:
            raise RuntimeError(f"layer {layer_idx} updates its recurrent state before any conv state; expected "
                               "transformers' Gated DeltaNet order (update_conv_state on a first step)")
        return layer.update_recurrent_state(recurrent_states, **kwargs)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def activate_past_recording(self) -> None:
        """transformers' assisted and prompt-lookup decoding call this before their first step, to crop later; a
        hybrid cache cannot crop, so it raises here, before anything is written."""
        if self._linear_layers:
            raise NotImplementedError(f"PagedKVCache cannot roll back a hybrid model's cache (assisted, prompt-lookup "
                                      f"or speculative decoding): {_NO_LINEAR_ROLLBACK}")

    # ---- rollback and what is not supported ----------------------------------------------------
    def crop(self, max_length: int) -> None:
        """Roll back to the first ``max_length`` columns (padding included); negative removes ``-max_length`` columns
        and 0 removes nothing, as transformers 5 treats it. A ``max_length`` at or past the current length is a no-op.
        Eager only (it reads the length on the host). A hybrid cache raises ``NotImplementedError`` for a crop that
        removes anything (its linear-attention states cannot be rolled back)."""
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
            if self._linear_layers:
                self._roll_back_linear(torch.full((self._linear_layers[0].rows or 1,), seen - keep),
                                       f"crop({max_length}) removes {seen - keep} of {seen} columns")
            self.sequences.crop(keep)

    def rollback_rows(self, tokens_to_remove) -> None:
        """Per-row rollback (speculative decoding, where rows accept different numbers of drafts): drop the last
        ``tokens_to_remove[b]`` real tokens of row b, for the first ``len(tokens_to_remove)`` rows (a ``[batch]``
        integer tensor or sequence). Afterwards ``get_seq_length()`` is the longest row's length, as if every row
        were left-padded to it; a row's next tokens go right after its remaining ones. Checked in eager mode. A hybrid
        cache raises ``NotImplementedError`` unless every count is 0 (and, compiled, always)."""
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
        if self._linear_layers:
            if in_graph_region():
                raise NotImplementedError(f"PagedKVCache rolls back a hybrid model's rows in eager mode only: "
                                          f"{_NO_LINEAR_ROLLBACK}")
            if not bool(counts.any()):
                return
            self._roll_back_linear(counts, f"rollback_rows({counts.tolist()})")
        s.rollback_rows(counts)

    def _roll_back_linear(self, columns: torch.Tensor, what: str) -> None:
        """Every linear-attention layer takes back the last ``columns[b]`` of row b, or none does."""
        columns = columns.to(self.sequences.seq_lens.device)
        if not all(layer.can_roll_back(columns) for layer in self._linear_layers):
            raise NotImplementedError(f"PagedKVCache cannot take back what {what} asks of a hybrid model's cache: "
                                      f"{_NO_LINEAR_ROLLBACK}")
        for layer in self._linear_layers:
            layer.roll_back(columns)

    @contextlib.contextmanager
    def record_linear_inputs(self, model: torch.nn.Module):
        """Inside the block, the hybrid ``model``'s Gated DeltaNet layers hand each step's inputs to this cache, which
        keeps the last step's and the states before it (one more state per layer), so that ``rollback_rows`` and
        ``crop`` can take back tokens of that step: the kept ones are replayed from the states before it with
        tqops' Gated DeltaNet ops. Outside it (and for more than the last step) they raise ``NotImplementedError``.
        A no-op for a cache without linear-attention layers."""
        if not self._linear_layers:
            yield
            return
        with recording(model, {layer.layer_idx: layer for layer in self._linear_layers}):
            yield

    def reset(self) -> None:
        """Empty every row and linear-attention state (the memory is kept; nothing reads a slot or a state before it
        is written again)."""
        self.sequences.reset()
        for layer in self._linear_layers:
            layer.reset()

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
        # transformers' sense: whether crop can put the whole cache back (not so for linear-attention states)
        return not self._linear_layers

    @property
    def is_initialized(self) -> bool:
        return self._allocated
