"""transformers' own Qwen3.5 of the hybrid benchmark's shape, on its own cache: a decode and a verify step's costs."""
from __future__ import annotations

import inspect
import logging
import time
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from .hf import _free

log = logging.getLogger(__name__)

# (cache class, compiled), fastest first: the first that runs a batch's decode and verify steps gives its row.
# Compiled means torch.compile(mode="reduce-overhead"), CUDA graphs, so only on CUDA; it needs the StaticCache's
# fixed addresses (a DynamicCache grows by concatenation).
MODES = (("StaticCache", True), ("StaticCache", False), ("DynamicCache", False))
WARMUP, REPS = 3, 20  # warm-up calls: compilation and the CUDA-graph recording
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def hf_qwen3_5(cfg: dict, device, dtype=torch.bfloat16):
    """A randomly initialised (seeded) ``transformers`` Qwen3_5ForCausalLM of ``cfg``'s shape, built on ``device``."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3_5ForCausalLM._from_config(transformers.Qwen3_5TextConfig(**cfg),
                                                              attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def hf_cache(model, cache: str, context: int, room: int):
    """An empty ``DynamicCache`` or ``StaticCache`` (``context + room`` tokens) for ``model``."""
    import transformers

    if cache == "StaticCache":
        return transformers.StaticCache(config=model.config, max_cache_len=context + room)
    return transformers.DynamicCache(config=model.config)


def fill_hf_cache(model, cache, batch: int, context: int) -> None:
    """Random states in ``cache`` as a ``context``-token prefill of ``batch`` rows leaves them, without the prefill:
    K/V of ``context`` tokens in every full-attention layer, conv states (the model's dtype) and recurrent states
    (float32, as the delta rules return them) in every Gated DeltaNet layer, each through the layer's own update."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    cfg, dev, dtype = model.config, model.device, model.dtype
    kv = torch.randn(batch, cfg.num_key_value_heads, context, cfg.head_dim, device=dev, dtype=dtype)
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            gdn = model.model.layers[i].linear_attn
            k = gdn.conv_kernel_size
            layer.update_conv_state(torch.randn(batch, gdn.conv_dim, k, device=dev, dtype=dtype), conv_kernel_size=k)
            layer.update_recurrent_state(torch.randn(batch, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim,
                                                     device=dev, dtype=torch.float32))
        else:  # the same K/V in every layer: only the step cost matters
            layer.update(kv, kv)


def restorer(cache) -> Callable[[], None]:
    """A function that puts ``cache`` back as it is now. ``Cache.crop`` cannot: a recurrent state has no past to cut
    back to. The states are copied back in place, keeping the addresses a captured step reads."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin, StaticLayer

    saved = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            saved.append((layer.conv_states[0].clone(), layer.recurrent_states[0].clone()))
        else:
            saved.append(int(layer.get_seq_length()))

    def restore() -> None:
        for layer, kept in zip(cache.layers, saved):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.conv_states[0].copy_(kept[0])
                layer.recurrent_states[0].copy_(kept[1])
            elif isinstance(layer, StaticLayer):  # the next update writes over the stale tail
                layer.cumulative_length.fill_(kept)
            else:
                layer.keys, layer.values = layer.keys[..., :kept, :], layer.values[..., :kept, :]

    return restore


def hf_step(model, cache, ids: torch.Tensor, context: int) -> Callable[[], torch.Tensor]:
    """One forward of ``ids`` (``[batch, q_len]``, the tokens at positions ``context ..`` of each row) over ``cache``:
    ``() -> logits [batch, q_len, vocab]``. The cache argument is ``cache`` from transformers 5.24 on,
    ``past_key_values`` before."""
    position_ids = (context + torch.arange(ids.shape[1], device=ids.device)).expand_as(ids)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def step():
        with torch.no_grad():
            return model(input_ids=ids, position_ids=position_ids, use_cache=True, **{name: cache}).logits

    return step


def time_step(step: Callable[[], object], restore: Callable[[], None], reps: int = REPS,
              warmup: int = WARMUP) -> float:
    """Median ms of one ``step()`` over ``reps`` calls, each after ``restore()``, untimed, so every call sees the
    same cache. Not timing.median_ms: do_bench times back-to-back calls, and each would see one token more."""
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(warmup + reps):
        restore()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    restore()
    return sorted(times[warmup:])[reps // 2]


def time_hf_steps(model, cache_name: str, compile: bool, batch: int, context: int, block: int,
                  reps: int = REPS) -> tuple[float, float]:
    """ms of a decode step (one token per row) and a verify step (``block`` tokens per row), both at ``context``
    cached tokens, on a fresh ``cache_name`` of ``batch`` rows."""
    cache = hf_cache(model, cache_name, context, room=block)
    fill_hf_cache(model, cache, batch, context)
    restore = restorer(cache)
    times = []
    for q_len in (1, block):
        ids = torch.randint(0, model.config.vocab_size, (batch, q_len), device=model.device)
        step = hf_step(model, cache, ids, context)
        if compile:  # dynamic=False: decode and verify each specialised to their shapes, as tqops' steps are
            step = torch.compile(step, mode="reduce-overhead", dynamic=False)
        times.append(time_step(step, restore, reps))
    return times[0], times[1]


def gdn_kernels() -> str:
    """Whose chunked gated delta rule transformers' Qwen3.5 runs: "fla" (flash-linear-attention, where installed),
    "torch" (transformers' reference), or "?" where the wrapper around it is not the one read here."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    wrapped = modeling_qwen3_5.torch_chunk_gated_delta_rule
    impl = inspect.getclosurevars(wrapped).nonlocals.get("implementation")
    if impl is None:
        return "?"
    return "torch" if impl.__module__ == modeling_qwen3_5.__name__ else impl.__module__.split(".")[0]


def bench_hybrid_hf(cfg: dict, context: int, batches: Sequence[int] = (1, 8), block: int = 16, shape: str = "",
                    device="cuda", dtype=torch.bfloat16, reps: int = REPS) -> list[dict]:
    """One row per batch: transformers' Qwen3_5ForCausalLM (random weights) on its own cache, in the fastest of
    ``MODES`` that runs, ms of a decode step and of a ``block``-token verify step at ``context`` cached tokens."""
    model = hf_qwen3_5(cfg, device, dtype)
    modes = [m for m in MODES if torch.device(device).type == "cuda" or not m[1]]
    kernels = gdn_kernels()
    rows = []
    for batch in tqdm(batches, desc="transformers hybrid"):
        cache_name, compile, decode_ms, verify_ms, mode = _first_that_runs(modes, model, batch, context, block, reps)
        row = dict(format=f"transformers ({DTYPE_NAMES[dtype]}, {cache_name}, {'compiled' if compile else 'eager'})",
                   shape=shape, context=context, batch=batch, mode=mode, gdn_kernels=kernels,
                   hf_decode_ms=decode_ms, hf_verify_ms=verify_ms)
        rows.append(row)
        tqdm.write(str({c: (round(v, 3) if isinstance(v, float) else v) for c, v in row.items()}))
        _free()
    return rows


def _first_that_runs(modes: list, model, batch: int, context: int, block: int, reps: int):
    """``(cache, compiled, decode ms, verify ms, mode)`` of the first of ``modes`` that runs; those that fail are
    dropped from ``modes`` (the later batches skip them), with a warning that says why."""
    while modes:
        cache_name, compile = modes[0]
        before = _compile_counts()
        try:
            decode_ms, verify_ms = time_hf_steps(model, cache_name, compile, batch, context, block, reps)
        except Exception:
            log.warning("transformers' Qwen3.5 with a %s%s failed at batch %d; trying the next mode", cache_name,
                        ", compiled," if compile else "", batch, exc_info=True)
            modes.pop(0)
            _free()
        else:
            return cache_name, compile, decode_ms, verify_ms, _mode(compile, before)
    raise RuntimeError(f"no mode of transformers' Qwen3.5 ran batch {batch}; the warnings above say why")


def _mode(compile: bool, before: tuple[int, int, int]) -> str:
    """What the steps ran as; compiled, what they compiled to since ``before`` (graph breaks run eagerly between
    graphs, and a graph inductor skips is not a CUDA graph)."""
    if not compile:
        return "eager"
    graphs, breaks, skips = (b - a for a, b in zip(before, _compile_counts()))
    return f'torch.compile(mode="reduce-overhead"): {graphs} graphs, {breaks} graph breaks, {skips} CUDA-graph skips'


def _compile_counts() -> tuple[int, int, int]:
    """Graphs dynamo has compiled, graph breaks, CUDA graphs inductor skipped, so far in this process."""
    counters = torch._dynamo.utils.counters
    return (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
            counters["inductor"]["cudagraph_skips"])
