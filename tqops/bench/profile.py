"""Where a captured hybrid step's GPU time goes: kernels of one graph replay grouped by name, with their share."""
from __future__ import annotations

import collections
from typing import Sequence

import torch

from .hybrid import SHAPES, captured_steps, fill_steps
from .kernels import step_kernels

REPLAYS = 20


def kernel_table(replay, replays: int = REPLAYS, top: int = 25) -> list[dict]:
    """Profile ``replays`` calls of ``replay`` -> the ``top`` kernels by total time: launches and microseconds per
    replay, share of the summed kernel time (gaps between kernels are not in the sum), then the sum."""
    total_us, calls = collections.Counter(), collections.Counter()
    for name, us in step_kernels(replay, replays):
        total_us[name] += us
        calls[name] += 1
    summed = sum(total_us.values()) or 1.0
    return [dict(kernel=name[:90], calls=calls[name], us=us, share=us / summed)
            for name, us in total_us.most_common(top)] + [
        dict(kernel="(all kernels)", calls=sum(calls.values()), us=summed, share=1.0)]


@torch.no_grad()
def profile_hybrid(shape: str = "qwen3.5-9b", formats: Sequence[str] = ("bf16", "turboquant_4bit_nc"),
                   batches: Sequence[int] = (1, 8), top: int = 25) -> list[dict]:
    """Kernel tables of the captured decode, verify and draft steps of ``bench_hybrid``'s setup."""
    target_cfg, drafter_cfg, context = SHAPES[shape]
    rows = []
    for fmt in formats:
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        target, drafter, runners, table = captured_steps(fmt, target_cfg, drafter_cfg, context, batches)
        for batch in batches:
            fill_steps(runners, table, batch, context, drafter)
            for step, r in runners.items():
                for row in kernel_table(r.graphs[batch].replay, top=top):
                    rows.append(dict(format=fmt, batch=batch, step=step, **row))
        del runners, target, drafter
    return rows


if __name__ == "__main__":
    import argparse

    from .table import markdown_table

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen3.5-9b", choices=sorted(SHAPES))
    p.add_argument("--formats", nargs="+", default=["bf16", "turboquant_4bit_nc"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    print(markdown_table(profile_hybrid(a.shape, a.formats, a.batches, a.top)))
