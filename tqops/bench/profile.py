"""Where a captured hybrid step's GPU time goes: kernels of one graph replay grouped by name, with their share."""
from __future__ import annotations

import collections
from typing import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from tqops.cudagraph import steps as cg
from tqops.models.generate import CACHE_BLOCK_SIZE as BLOCK

from .e2e import _compiled, fill_caches
from .hybrid import SHAPES, _fill, build_hybrid

REPLAYS = 20


def kernel_table(replay, replays: int = REPLAYS, top: int = 25) -> list[dict]:
    """Profile ``replays`` calls of ``replay`` -> the ``top`` kernels by total time: calls and microseconds per
    replay, share of the summed kernel time (gaps between kernels are not in the sum)."""
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    total_us, calls = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total_us[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            calls[ev.name] += 1
    summed = sum(total_us.values()) or 1.0
    return [dict(kernel=name[:90], calls=calls[name] / replays, us=us / replays, share=us / summed)
            for name, us in total_us.most_common(top)] + [dict(kernel="(all kernels)", calls=sum(calls.values())
                                                               / replays, us=summed / replays, share=1.0)]


@torch.no_grad()
def profile_hybrid(shape: str = "qwen3.5-9b", formats: Sequence[str] = ("bf16", "turboquant_4bit_nc"),
                   batches: Sequence[int] = (1, 8), top: int = 25) -> list[dict]:
    """Kernel tables of the captured decode, verify and draft steps of ``bench_hybrid``'s setup."""
    target_cfg, drafter_cfg, context = SHAPES[shape]
    rows = []
    for fmt in formats:
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        target, drafter = build_hybrid(fmt, target_cfg, drafter_cfg)
        bs, dev, big = drafter.block_size, target.lm_head.weight.device, max(batches)
        per_seq = -(-(context + 2 * bs) // BLOCK)
        table = fill_caches((target,), big, context, per_seq)
        fill_caches((drafter,), big, context, per_seq)
        target.allocate_state(big, bs, dev)
        kw = dict(max_batch=big, max_blocks=per_seq, block_size=BLOCK, device=dev, buckets=list(batches))
        t_step = _compiled(cg.target_step(target, drafter.target_layer_ids))
        runners = dict(decode=cg.make_runner(t_step, q_len=1, state_mode="commit", **kw),
                       verify=cg.make_runner(t_step, q_len=bs, state_mode="stash", **kw),
                       draft=cg.make_runner(_compiled(cg.drafter_step(drafter)), q_len=bs,
                                            context_dim=drafter.context_dim,
                                            context_dtype=drafter.fc.weight.dtype, **kw))
        _fill(runners["decode"], runners["verify"], runners["draft"], table, big, context, bs, drafter)
        for r in runners.values():
            r.capture(progress=False)
        for batch in batches:
            _fill(runners["decode"], runners["verify"], runners["draft"], table, batch, context, bs, drafter)
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
