"""Timing helpers shared by the benchmarks: CUDA-graph replay times and device copy bandwidth."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

# time_per_call: each figure is the median over REPS replays of one CUDA graph holding CALLS back-to-back calls,
# divided by CALLS. A call that moves only ~100 MB (~30 us) timed as a single launch mostly measures launch
# overhead and timer granularity; inside a graph the calls run back to back, as in a model's forward pass.
CALLS, REPS = 32, 15


def median_ms(fn: Callable[[], object], rep_ms: int = 60, warmup_ms: int = 10) -> float:
    """Median milliseconds of one call of ``fn`` over about ``rep_ms`` of calls (triton's do_bench, L2 flushed)."""
    # Imported here: triton is optional without CUDA, where the benchmarks' CPU-tested parts import this module.
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def time_graph(fn: Callable[[], object], rep_ms: int = 100) -> float:
    """Median microseconds of one CUDA-graph replay of ``fn`` (L2 flushed between replays by do_bench)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return median_ms(graph.replay, rep_ms=rep_ms, warmup_ms=20) * 1e3


def time_per_call(fns: Sequence[Callable[[], object]], calls: int = CALLS, reps: int = REPS) -> float:
    """Seconds per call of a graph of ``calls`` launches cycling through ``fns`` (median of ``reps`` replays)."""
    for fn in fns:  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written.

    The better of cudaMemcpy (``copy_``) and an elementwise copy kernel, so the baseline is not understated.
    """
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    us = min(time_graph(lambda: dst.copy_(src)), time_graph(lambda: torch.mul(src, 1.0, out=dst)))
    return 2 * nbytes / (us * 1e-6)
