"""The speculative-decoding steps that generate captures: target decode/verify and the whole DFlash drafter step, and
their runners kept per step geometry on the models."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..cudagraph import CudaGraphRunner
from ..cudagraph.steps import kept_runner, make_runner


def target_step(target, layer_ids: Optional[tuple] = None) -> Callable:
    """``(input_ids [n], positions [n]) -> (logits [n, V] float32, aux [n, C] or None)``: one target forward + head."""

    def step(input_ids, positions):
        out = target(input_ids, positions, layer_ids=layer_ids)
        hidden, aux = out if layer_ids is not None else (out, None)
        return target.compute_logits(hidden).float(), aux

    return step


def drafter_step(drafter, temperature: float = 0.0) -> Callable:
    """The whole DFlash step: context-state injection and context K/V store (inside ``drafter.forward``), the
    non-causal block pass, and ``drafter.propose`` over the block.

    DFlash v1: ``(input_ids [n * bs], positions [n * bs]) -> draft logits [n, bs - 1, V]`` float32 (the shared
    lm_head over the mask positions), whatever the temperature. A drafter that ``selects_in_step`` (DFlash2) returns
    its ``SelectedDrafts`` at ``temperature``; at temperature > 0 the step takes ``uniforms [n * bs]`` too, one
    uniform per token for the sampled walk (``StepBuffers(uniforms=True)`` holds them for a captured step).
    """
    bs = drafter.block_size

    def step(input_ids, positions):
        hidden = drafter(input_ids, positions)
        torch._check(hidden.shape[0] % bs == 0)  # the token dim may be unbacked under compile
        return drafter.propose(hidden, input_ids, temperature)

    def sampled_step(input_ids, positions, uniforms):
        torch._check(uniforms.shape[0] == input_ids.shape[0])
        hidden = drafter(input_ids, positions)
        torch._check(hidden.shape[0] % bs == 0)
        return drafter.propose(hidden, input_ids, temperature, uniforms)

    return sampled_step if step_uniforms(drafter, temperature) else step


def step_uniforms(drafter, temperature: float) -> bool:
    """Whether ``drafter_step(drafter, temperature)`` takes uniforms: a drafter that samples inside its step."""
    return bool(getattr(drafter, "selects_in_step", False)) and temperature > 0


def drafter_step_variant(drafter, temperature: float) -> Optional[float]:
    """What a drafter step depends on besides its inputs: None for one step at every temperature (v1), else the
    temperature (DFlash2). Part of the compiled step's name and of the drafter runner's key."""
    return float(temperature) if getattr(drafter, "selects_in_step", False) else None


def speculative_runners(target, drafter, key, verify_step: Callable[[], Callable],
                        draft_step: Callable[[], Callable], *, q_len: int, max_batch: int, max_blocks: int,
                        block_size: int, device, state_mode: Optional[str] = None, temperature: float = 0.0
                        ) -> tuple[CudaGraphRunner, Optional[CudaGraphRunner]]:
    """The (target verify, drafter) runners of one step geometry ``key``, kept so later calls of the same geometry
    replay instead of capturing again: the verify runner on the target, the drafter's on the drafter (kept on the
    target, its step would keep a dropped drafter and its caches alive). ``allocate_cache`` keeps caches of the same
    geometry in place, which the graphs point at; if a model's caches moved, its kept runners are dropped.
    ``verify_step``/``draft_step`` build the step functions (compiled or not) only when a runner is made;
    ``drafter=None`` makes no drafter runner; ``state_mode`` is the target step's (``StepBuffers``), for targets with
    linear-attention layers. ``temperature``: the drafter step's (``drafter_step``); a drafter whose step depends on
    it (DFlash2) keeps a runner per temperature, the target's verify runner is the same for all."""
    shape = dict(max_batch=max_batch, max_blocks=max_blocks, block_size=block_size, device=device)
    verify = kept_runner(target, key, _caches(target),
                         lambda: make_runner(verify_step(), q_len=q_len, state_mode=state_mode, **shape))
    drafting = None
    if drafter is not None:
        variant = drafter_step_variant(drafter, temperature)
        drafting = kept_runner(drafter, key if variant is None else key + (variant,), _caches(drafter),
                               lambda: make_runner(draft_step(), q_len=q_len, context_dim=drafter.context_dim,
                                                   context_dtype=drafter.fc.weight.dtype,
                                                   uniforms=step_uniforms(drafter, temperature), **shape))
    return verify, drafting


def _caches(model) -> tuple:
    """The data pointers of ``model``'s KV caches and linear-attention state pools, which its graphs point at."""
    return tuple(layer.kv_cache.data_ptr() for layer in model.attention_layers) + tuple(
        t.data_ptr() for layer in getattr(model, "state_layers", ()) for t in layer.buffers())
