"""Capture a model step per batch bucket as a CUDA graph and replay it with refilled static buffers."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils._pytree import tree_map
from tqdm import tqdm

from ..graphs import set_forward_context

from .buffers import StepBuffers, pick_bucket


class CaptureError(RuntimeError):
    """A step cannot be captured: it syncs with the host or allocates/copies outside the graph."""


class CudaGraphRunner:
    """Runs ``step(input_ids, positions)`` (``step(input_ids, positions, uniforms)`` over buffers with uniforms) for
    batches of sequences with ``q_len`` tokens each.

    The step returns a tensor or a tuple/list/dict of tensors (None allowed) whose dim 0 is the padded token count
    ``bucket * q_len`` or the padded sequence count ``bucket``; each is cut back to the real batch's rows.
    On CUDA, ``capture()`` records one graph per bucket (all sharing one memory pool) after warm-up runs; a call
    refills the static buffers in place and replays the smallest bucket that fits. Batches above the largest
    bucket, and every call on CPU, run the step eagerly from the same buffers (same padding, same metadata).
    The returned tensors are views of the graph's static outputs: consume or copy them before the next call.
    """

    def __init__(self, step: Callable, buffers: StepBuffers, buckets: Sequence[int]):
        if not buckets or max(buckets) > buffers.max_batch:
            raise ValueError(f"buckets {list(buckets)} must be non-empty and <= max_batch={buffers.max_batch}")
        self.step, self.buffers, self.buckets = step, buffers, sorted(set(buckets))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Any] = {}
        self.pool = None

    @property
    def device(self) -> torch.device:
        return self.buffers.input_ids.device

    def _run(self, bucket: int) -> Any:
        n = bucket * self.buffers.q_len
        extra = () if self.buffers.uniforms is None else (self.buffers.uniforms[:n],)
        with set_forward_context(self.buffers.forward_context(bucket)):
            return self.step(self.buffers.input_ids[:n], self.buffers.positions[:n], *extra)

    @torch.no_grad()
    def capture(self, warmup: int = 2, progress: bool = True) -> None:
        """Warm up and capture every bucket, largest first so smaller graphs reuse its pool memory."""
        if self.device.type != "cuda":
            return
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bucket in tqdm(self.buckets[::-1], desc="capturing CUDA graphs", disable=not progress):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):  # compile, autotune and allocate outside the graph
                    self._run(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    out = self._run(bucket)
            except RuntimeError as e:
                raise CaptureError(
                    f"capturing the step for bucket {bucket} failed: the step syncs with the host (.item(), "
                    f".tolist(), nonzero, printing a CUDA tensor) or copies from CPU memory while capturing. "
                    f"Move that work out of the step. Original error: {e}") from e
            self.graphs[bucket], self.outputs[bucket] = graph, out
        torch.cuda.synchronize()

    @torch.no_grad()
    def __call__(self, input_ids, positions, seq_lens, block_tables: dict, **context) -> Any:
        batch = seq_lens.shape[0]
        bucket = pick_bucket(self.buckets, batch)
        if bucket is None:  # eager fallback: no graph that large; the buffers must still hold the batch
            if batch > self.buffers.max_batch:
                raise ValueError(f"batch {batch} exceeds the runner's max_batch {self.buffers.max_batch}")
            bucket = batch
        self.buffers.fill(bucket, input_ids, positions, seq_lens, block_tables, **context)
        graph = self.graphs.get(bucket)
        if graph is None:
            return _unpad(self._run(bucket), bucket, batch)
        graph.replay()
        return _unpad(self.outputs[bucket], bucket, batch)

    def captured_buckets(self) -> Optional[list]:
        return sorted(self.graphs)


def _unpad(out: Any, bucket: int, batch: int) -> Any:
    """Cut every tensor of ``out`` to the real batch: ``shape[0] // bucket`` rows per sequence (tokens or sequences)."""
    return tree_map(lambda t: t[: t.shape[0] // bucket * batch] if isinstance(t, torch.Tensor) else t, out)
