"""GPU kernels per captured step (and per layer), by name and time, from a torch.profiler trace: the target's decode
step, or the speculative step's verify (the target over a 16-token block) or draft (the drafter)."""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterable, Sequence

import torch
from tqdm import tqdm


from ..pdl import pdl_switched_off
from .e2e import BLOCK, SHAPES, SpecBench, build_models, decode_runner, fill_caches, fill_decode


# Names of the attention kernels: the Triton kernel, and the CUDA kernels of the TurboQuant decode and verify calls.
ATTENTION_KERNELS = ("_paged_attention_kernel", "turboquant_attention", "turboquant_verify")
STEPS = ("decode", "verify", "draft")


def _is_attention(name: str, markers: Sequence[str]) -> bool:
    return any(m in name for m in markers)


def summarize_kernels(kernels: Iterable[tuple[str, float]], num_layers: int, top: int = 12,
                      markers: Sequence[str] = ATTENTION_KERNELS) -> dict:
    """``(name, microseconds)`` of every kernel one step launched -> count, count per layer, total time, the
    ``top`` names by total time with their launch counts, ``attention_us``: the time of the attention kernels (names
    containing one of ``markers``) and their split combiners, and ``layer``: the kernels (name, microseconds), in
    launch order, from one middle layer's attention kernel to the next layer's (empty if fewer than two)."""
    kernels = list(kernels)
    marks = [i for i, (name, _) in enumerate(kernels) if _is_attention(name, markers)]
    mid = len(marks) // 2
    layer = [(name[:60], round(us, 1)) for name, us in kernels[marks[mid - 1]:marks[mid]]] if len(marks) >= 2 else []
    count, total = 0, 0.0
    by_name: dict = defaultdict(lambda: [0, 0.0])
    for name, us in kernels:
        count += 1
        total += us
        by_name[name][0] += 1
        by_name[name][1] += us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    attention = sum(us for name, us in kernels if _is_attention(name, markers) or "_combine_splits_kernel" in name)
    return dict(kernels=count, kernels_per_layer=count / num_layers, kernel_us=total, attention_us=attention,
                top=[dict(name=n[:90], launches=c, us=round(t, 1)) for n, (c, t) in ranked], layer=layer)


def step_kernels(step, steps: int = 3) -> list[tuple[str, float]]:
    """The CUDA kernels (name, device microseconds) of one call of ``step``, profiled over ``steps`` calls."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_step = len(events) // steps
    return [(e.name, e.device_time) for e in events[:per_step]]


@torch.no_grad()
def bench_kernels(formats: Sequence[str] = ("bf16", "turboquant_4bit_nc"), batches: Sequence[int] = (1, 8),
                  shape: str = "qwen3-0.6b", pdl: bool = False, step: str = "decode") -> list[dict]:
    """One row per (format, batch): the kernels of one replay of a compiled, captured step at the shape's context:
    ``step`` is the target's decode step (one token per sequence), the verify step (the target over a 16-token block)
    or the draft step (the drafter over a block), the last two as the e2e benchmark's speculative step runs them.
    Profiled as a replay, not an uncaptured call: an uncaptured call also launches the eager value checks of the
    step's inputs (host syncs included), which a CUDA graph leaves out.

    Without ``pdl`` the steps are built and captured with programmatic dependent launch off, so each kernel's
    profiled time is its own: with it, a kernel launched early also counts the time it waits on the kernel before.
    The counts are the same either way."""
    if step not in STEPS:
        raise ValueError(f"step: expected one of {STEPS}, got {step!r}")
    rows = []
    with contextlib.nullcontext() if pdl else pdl_switched_off():
        for fmt in tqdm(formats, desc="kernels"):
            torch._dynamo.reset()
            rows += [dict(row, pdl="on" if pdl else "off") for row in _format_rows(fmt, batches, shape, step)]
            torch.cuda.empty_cache()
    return rows


def _format_rows(fmt: str, batches: Sequence[int], shape: str, step: str) -> list[dict]:
    target_cfg, drafter_cfg, context = SHAPES[shape]
    target, drafter = build_models(fmt, target_cfg, drafter_cfg)
    if step == "decode":
        runner, table = decode_runner(target, batches, context)
        runner.capture(progress=False)
        fill = lambda batch: fill_decode(runner, table, batch, context)
        num_layers = target_cfg["num_hidden_layers"]
    else:
        # room for the block past the context
        table = fill_caches((target, drafter), max(batches), context, -(-(context + 2 * drafter.block_size) // BLOCK))
        spec = SpecBench(target, drafter, table, context, batches)
        runner, fill = getattr(spec, step), spec.fill
        num_layers = (target_cfg if step == "verify" else drafter_cfg)["num_hidden_layers"]
    rows = []
    for batch in batches:
        fill(batch)
        summary = summarize_kernels(step_kernels(runner.graphs[batch].replay), num_layers)
        rows.append(dict(format=fmt, shape=shape, step=step, batch=batch, context=context, **summary))
        tqdm.write(f"{fmt} {step} batch {batch}: {summary['kernels']} kernels ({summary['kernels_per_layer']:.1f} "
                   f"per layer), {summary['kernel_us']:.0f} us of kernels")
    return rows
