"""GPU kernels per decode step (and per layer) of the captured target, by name and time, from a torch.profiler trace."""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterable, Sequence

import torch
from tqdm import tqdm


from ..pdl import pdl_switched_off
from .e2e import SHAPES, build_models, decode_runner, fill_decode


# Names of the attention kernels: the Triton kernel, and the CUDA kernel of the TurboQuant decode calls.
ATTENTION_KERNELS = ("_paged_attention_kernel", "turboquant_attention")


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
                  shape: str = "qwen3-0.6b", pdl: bool = False) -> list[dict]:
    """One row per (format, batch): the kernels of one replay of the compiled, captured target decode step at the
    shape's context. Profiled as a replay, not an uncaptured call: an uncaptured call also launches the eager
    value checks of the step's inputs (host syncs included), which a CUDA graph leaves out.

    Without ``pdl`` the steps are built and captured with programmatic dependent launch off, so each kernel's
    profiled time is its own: with it, a kernel launched early also counts the time it waits on the kernel before.
    The counts are the same either way."""
    rows = []
    with contextlib.nullcontext() if pdl else pdl_switched_off():
        for fmt in tqdm(formats, desc="kernels"):
            torch._dynamo.reset()
            rows += [dict(row, pdl="on" if pdl else "off") for row in _format_rows(fmt, batches, shape)]
            torch.cuda.empty_cache()
    return rows


def _format_rows(fmt: str, batches: Sequence[int], shape: str) -> list[dict]:
    target_cfg, drafter_cfg, context = SHAPES[shape]
    target, _ = build_models(fmt, target_cfg, drafter_cfg)
    runner, table = decode_runner(target, batches, context)
    runner.capture(progress=False)
    rows = []
    for batch in batches:
        fill_decode(runner, table, batch, context)
        summary = summarize_kernels(step_kernels(runner.graphs[batch].replay), target_cfg["num_hidden_layers"])
        rows.append(dict(format=fmt, shape=shape, batch=batch, context=context, **summary))
        tqdm.write(f"{fmt} batch {batch}: {summary['kernels']} kernels ({summary['kernels_per_layer']:.1f} per "
                   f"layer), {summary['kernel_us']:.0f} us of kernels")
    return rows
