"""Launch-config sweep of the Triton paged attention kernel at the Qwen3.5-9B full-attention shape (needs CUDA).

16 q heads, 4 kv heads, head_dim 256, blocks of 16 slots, 32,768 keys per sequence; q_len 1 (decode) and 16 (DFlash
verify, causal) at batch 8 and 1. Per (format, batch, q_len) it times ``paged_attention_triton`` (attention kernel
plus split combiner, the host-side query rotation of MSE keys included) at the default ``launch_config`` and at
alternatives passed through the function's keyword overrides (no library change), and checks each against the
default's output:

- stage 1: block_n {16, 32, 64} x num_warps {1, 2, 4, 8} x splits x{1, 2, 0.5} (and block_q {8, 4} at q_len > 1),
  with the default's switches; combinations whose estimated registers clearly spill are not compiled, and those whose
  compiled kernel spills are not timed;
- stage 2: on the fastest correct stage-1 tiles, the tile loop's switches (register prefetch, block ids ahead, L2
  prefetch), the value decode (byte-permute PTX off, even / odd value halves), dense pipelining stages, keys as M;
- confirmation: every format's default and best re-timed alternately (median of 3), and the summary
  ``best / bf16 default`` per (batch, q_len).

Kernels compile ahead in parallel worker processes (each also runs its configs once on zeroed block tables, so a
config that faults kills a worker, not the sweep); timing runs in this process only after each compile phase.
Timing: ``tqops.bench.timing.time_per_call``, one CUDA graph of back-to-back calls cycling through disjoint
sequences of one cache (so no call finds its keys in L2, as in a model's step), median of the replays.

    python tools/attention_sweep.py --out attention_sweep.json            # bf16 + turboquant_4bit_nc, ~3-4 min
    python tools/attention_sweep.py --formats bf16 turboquant_4bit_nc fp8_e4m3 turboquant_k8v4 --q-lens 1

Prints a markdown table per (format, batch, q_len) and the summary last; writes every row as JSON to ``--out`` (after
each stage too, so an interrupted run keeps what it measured) and the tables to the same path with ``.md``.
Labels: ``bq`` query tokens per tile (q_len > 1), ``bn`` keys per tile, ``w`` warps, ``s`` splits; the tile loop is
``pf`` (register prefetch), ``ids`` (block ids a tile ahead), ``ids+l2`` (and an L2 prefetch of the next tile) or
neither; ``st`` pipeline stages, ``no-asm`` no byte-permute PTX decode, ``halves`` values as even / odd halves,
``kam`` keys as the MMA's M side.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections import deque
from typing import Callable, Optional, Sequence

if __name__ in ("__main__", "__mp_main__"):  # run as a script (or a worker of one): this tree's tqops first
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

SWITCH_KEYS = ("block_q", "block_n", "num_splits", "num_warps", "num_stages", "key_pairs", "prefetch",
               "value_halves", "pair_asm", "keys_as_m", "ids_ahead", "prefetch_l2", "row_loads")
ATTENTION = "_paged_attention_kernel"
# Shares of --budget-s: no compile is started after COMPILE_UNTIL, no config timed after TIME_UNTIL (defaults are),
# no stage 2 begun after STAGE2_FROM, no confirmation round after CONFIRM_UNTIL.
COMPILE_UNTIL, TIME_UNTIL, STAGE2_FROM, CONFIRM_UNTIL = 0.8, 0.92, 0.75, 0.96


@dataclasses.dataclass(frozen=True)
class Shape:
    """The attention shape: Qwen3.5-9B's gated full attention (tqops.bench.hybrid.QWEN3_5_9B), the cache block size
    tqops' models use (tqops.models.generate.CACHE_BLOCK_SIZE), the hybrid bench's 32K context."""
    num_q_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 256
    block_size: int = 16
    context: int = 32768


@dataclasses.dataclass(frozen=True)
class Grid:
    """What the sweep tries per (format, batch, q_len); see the module docstring."""
    block_ns: tuple = (16, 32, 64)
    warps: tuple = (1, 2, 4, 8)
    split_scales: tuple = (1, 2, 0.5)
    block_qs: tuple = (8, 4)  # at q_len > 1, besides the default
    max_configs: int = 40  # per case, the default included
    stage1_share: float = 0.7
    top: int = 3  # stage-2 bases, at most
    # est_regs above which a config is not compiled: ptxas (sm_90, Triton 3.9) gave 255 registers and 100s of bytes
    # of spills to every 16-row decode tile above 256, and to most 32/64-row tiles at 256 (the q_len 16 default too)
    max_est_regs: int = 256
    max_spills: int = 16  # local-memory words per thread above which (and the default's) a config is not timed
    keys_as_m: bool = True
    maxnreg: tuple = ()


# ---- configs ------------------------------------------------------------------------------------------------------

def full_config(base: dict, **overrides) -> dict:
    """The launch config a call with ``overrides`` gets: ``base`` (a ``launch_config`` result) updated."""
    cfg = {k: base[k] for k in SWITCH_KEYS}
    cfg["maxnreg"] = None
    cfg.update(overrides)
    return cfg


def overrides_of(cfg: dict) -> dict:
    """Keyword arguments of ``paged_attention_triton`` that force ``cfg`` (every switch explicit)."""
    return {k: cfg[k] for k in SWITCH_KEYS + ("maxnreg",) if cfg.get(k) is not None}


def block_m(cfg: dict, group_pad: int) -> int:
    return max(16, cfg["block_q"] * group_pad)


def effective_key(cfg: dict, fmt) -> tuple:
    """What the kernel's code depends on (switches the kernel ignores for ``fmt`` or with other switches dropped),
    so configs that compile to the same code are timed once."""
    mse, uniform = fmt.key_mode == "mse", fmt.value_mode == "uniform"
    key = [cfg["block_q"], cfg["block_n"], cfg["num_splits"], cfg["num_warps"], cfg["num_stages"], cfg["prefetch"],
           cfg["keys_as_m"], cfg.get("maxnreg")]
    if not cfg["prefetch"]:
        key += [cfg["ids_ahead"], cfg["ids_ahead"] and cfg["prefetch_l2"]]
    if mse or uniform:
        key.append(cfg["pair_asm"])
    if mse and fmt.key_bits == 4 and not cfg["pair_asm"]:
        key.append(cfg["key_pairs"])
    key.append(halves(cfg, fmt))
    if cfg["keys_as_m"] and mse and fmt.key_bits == 3:
        key.append(cfg["row_loads"])
    return tuple(key)


def halves(cfg: dict, fmt) -> bool:
    """Whether the kernel runs packed values as even / odd halves (its HALVES constant)."""
    return bool(fmt.value_mode == "uniform" and cfg["value_halves"] and not (cfg["pair_asm"] and fmt.key_mode == "mse")
                and not cfg["keys_as_m"])


def est_regs(cfg: dict, head_dim: int, group_pad: int) -> float:
    """A rough 32-bit register count per thread: the fp32 accumulator and 16-bit query of the M rows, the decoded K
    and V tile (twice with the register prefetch), over the program's threads."""
    m = block_m(cfg, group_pad)
    return (1.5 * m * head_dim + (1 + cfg["prefetch"]) * cfg["block_n"] * head_dim) / (32 * cfg["num_warps"])


def label(cfg: dict, fmt, q_len: int) -> str:
    """A short name: tile, warps, splits, then the switches that are on (of those that change the code)."""
    parts = [f"bn{cfg['block_n']}", f"w{cfg['num_warps']}", f"s{cfg['num_splits']}"]
    if q_len > 1:
        parts.insert(0, f"bq{cfg['block_q']}")
    if cfg["prefetch"]:
        parts.append("pf")
    elif cfg["ids_ahead"]:
        parts.append("ids+l2" if cfg["prefetch_l2"] else "ids")
    if cfg["num_stages"] > 1:
        parts.append(f"st{cfg['num_stages']}")
    if (fmt.key_mode == "mse" or fmt.value_mode == "uniform") and not cfg["pair_asm"]:
        parts.append("no-asm")
    if halves(cfg, fmt):
        parts.append("halves")
    if cfg["keys_as_m"]:
        parts.append("kam")
    if cfg.get("maxnreg"):
        parts.append(f"nreg{cfg['maxnreg']}")
    return " ".join(parts)


def _pow2_splits(splits: float) -> int:
    return 1 << max(0, min(7, round(math.log2(max(1.0, splits)))))


def stage1_configs(base_for: Callable[[Optional[int]], dict], fmt, q_len: int, head_dim: int, grid: Grid,
                   cap: int) -> tuple[list[dict], list[dict]]:
    """(configs to compile, pruned configs with a reason): the tile grid at the default switches, in priority order
    (the default block_q at the default splits, the first other block_q at its own, the default block_q at the other
    split scales, the further block_qs), at most ``cap``; duplicates of the default dropped. ``base_for(block_q)``:
    ``launch_config`` for that block_q (None: the default)."""
    default = full_config(base_for(None))
    group_pad = base_for(None)["group_pad"]
    fmt_keys = {effective_key(default, fmt)}
    block_qs = [None] + ([bq for bq in grid.block_qs if bq != default["block_q"] and bq <= q_len] if q_len > 1 else [])
    ranked, pruned = [], []
    for bq_rank, bq in enumerate(block_qs):
        base = full_config(base_for(bq))
        for scale_rank, scale in enumerate(grid.split_scales):
            if bq_rank and scale_rank:  # other query tiles at their own default splits only
                continue
            for bn in grid.block_ns:
                for w in grid.warps:
                    cfg = dict(base, block_n=bn, num_warps=w, num_splits=_pow2_splits(base["num_splits"] * scale))
                    if cfg["prefetch"] and est_regs(cfg, head_dim, group_pad) > grid.max_est_regs:
                        cfg["prefetch"] = False  # a prefetched wide tile spills: try the tile without it
                    key = effective_key(cfg, fmt)
                    if key in fmt_keys:
                        continue
                    fmt_keys.add(key)
                    if est_regs(cfg, head_dim, group_pad) > grid.max_est_regs:
                        pruned.append(dict(cfg=cfg, reason=f"~{est_regs(cfg, head_dim, group_pad):.0f} registers"))
                        continue
                    rank = (scale_rank * 2 if bq_rank == 0 else 1 if bq_rank == 1
                            else 2 * len(grid.split_scales) + bq_rank)
                    # within a rank, the default's warps and block_n first
                    ranked.append(((rank, w != default["num_warps"], bn != default["block_n"]), cfg))
    ranked.sort(key=lambda r: r[0])
    keep = [cfg for _, cfg in ranked[:cap]]
    pruned += [dict(cfg=cfg, reason="over the config cap") for _, cfg in ranked[cap:]]
    return keep, pruned


def stage2_variants(base: dict, fmt, head_dim: int, group_pad: int, grid: Grid) -> list[dict]:
    """Switch variants of one tile config: the tile loop's three other modes, the value decode, dense stages, keys as
    M (32-row tiles of quantized formats), a register cap."""
    out = []
    for loop in (dict(prefetch=True), dict(prefetch=False, ids_ahead=False, prefetch_l2=False),
                 dict(prefetch=False, ids_ahead=True, prefetch_l2=False),
                 dict(prefetch=False, ids_ahead=True, prefetch_l2=True)):
        out.append(dict(base, **loop))
    m = block_m(base, group_pad)
    if fmt.key_mode == "mse":  # the byte-permute PTX off (keys by centroid pairs), values interleaved or as halves
        out.append(dict(base, pair_asm=False, value_halves=False))
        if m <= 32:
            out.append(dict(base, pair_asm=False, value_halves=True))
    elif fmt.value_mode == "uniform":
        out.append(dict(base, value_halves=not base["value_halves"]))
    if fmt.key_mode == "dense":
        out += [dict(base, prefetch=False, num_stages=s) for s in (2, 3) if s != base["num_stages"]]
    if grid.keys_as_m and m == 32 and fmt.key_mode != "dense" and not base["keys_as_m"]:
        out.append(dict(base, keys_as_m=True, prefetch=False, ids_ahead=True, prefetch_l2=True))
    out += [dict(base, maxnreg=n) for n in grid.maxnreg]
    return [c for c in out if est_regs(c, head_dim, group_pad) <= grid.max_est_regs]


# ---- inputs -------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Inputs:
    """One case's call arguments: ``sets`` (cache, block table rows) of disjoint sequences, cycled through."""
    fmt: object
    query: torch.Tensor
    seq_lens: torch.Tensor
    qsl: torch.Tensor
    sets: list
    scale: float

    def args(self, i: int = 0) -> tuple:
        cache, table = self.sets[i % len(self.sets)]
        return (self.query, cache, table, self.seq_lens, self.qsl, self.fmt, True, None, None, self.scale, 1.0, 1.0)


def make_cache(fmt, shape: Shape, seqs: int, device, fill: bool = True, seed: int = 0):
    """(cache, block table [seqs, blocks]) of ``seqs`` sequences of ``shape.context`` random tokens at shuffled
    blocks (the torch reference store, as tqops.bench.attention); ``fill=False``: the same tensors uninitialized and a
    zero table (for compiling, where only shapes, strides and alignments count)."""
    from tqops.device_constants import allocate_kv_cache
    from tqops.kv.naive import kv_store_naive

    n_blk = -(-shape.context // shape.block_size)
    cache = allocate_kv_cache(fmt, seqs * n_blk, shape.block_size, shape.num_kv_heads, shape.head_dim, device=device)
    if not fill:
        return cache, torch.zeros(seqs, n_blk, dtype=torch.int32, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    table = torch.randperm(seqs * n_blk, device=device, generator=g).to(torch.int32).view(seqs, n_blk)
    j = torch.arange(shape.context, device=device)
    dtype = torch.bfloat16 if cache.is_cuda else torch.float32
    for b in range(seqs):
        slots = table[b, j // shape.block_size].long() * shape.block_size + j % shape.block_size
        for c in range(0, shape.context, 16384):
            n = min(16384, shape.context - c)
            k, v = (torch.randn(n, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype, generator=g)
                    for _ in range(2))
            kv_store_naive(k, v, cache, slots[c:c + n], fmt, 1.0, 1.0)
    return cache, table


def make_inputs(fmt, shape: Shape, batch: int, q_len: int, cache, table, dtype, max_sets: int = 8,
                seed: int = 1) -> Inputs:
    """The case's query (q_len tokens per sequence at the end of a ``shape.context``-token sequence) over groups of
    ``batch`` rows of ``table``."""
    device = cache.device
    g = torch.Generator(device=device).manual_seed(seed)
    query = torch.randn(batch * q_len, shape.num_q_heads, shape.head_dim, device=device, generator=g).to(dtype)
    sets = [(cache, table[i * batch:(i + 1) * batch]) for i in range(min(max_sets, table.shape[0] // batch))]
    return Inputs(fmt, query, torch.full((batch,), shape.context, dtype=torch.int32, device=device),
                  torch.arange(0, batch + 1, dtype=torch.int32, device=device) * q_len, sets, shape.head_dim**-0.5)


# ---- compiled-kernel bookkeeping ----------------------------------------------------------------------------------

def _record_kernels(jit, seen: dict, warmup_only: bool = False) -> None:
    """Wrap one @triton.jit kernel's launches (an instance attribute over JITFunction.run) to keep the compiled kernel
    it ran, for its register and spill counts; ``warmup_only``: compile without launching."""
    from triton.runtime.jit import JITFunction

    if not isinstance(jit, JITFunction) or "run" in vars(jit):
        return
    run = jit.run

    def recording(*args, grid, warmup, **kwargs):
        kernel = run(*args, grid=grid, warmup=warmup or warmup_only, **kwargs)
        seen[jit.fn.__name__] = kernel
        return kernel

    jit.run = recording


def _kernel_stats(kernel) -> dict:
    """Registers, local-memory words (Triton's n_spills: local bytes / 4) and shared bytes of a launched kernel."""
    if kernel is None:
        return {}
    try:
        kernel._init_handles()  # loaded already by its launch; a no-op then
        return dict(regs=kernel.n_regs, spills=kernel.n_spills, shared=kernel.metadata.shared)
    except Exception as e:  # noqa: BLE001 - another Triton's internals: the counts are only informative
        return dict(stats_error=f"{type(e).__name__}: {str(e)[:200]}")


def _fatal(e: BaseException) -> bool:
    """A CUDA error that leaves the process's context unusable (a faulting kernel)."""
    text = str(e).lower()
    return "cuda error" in text or "illegal" in text or "launch failure" in text or "misaligned" in text


# ---- parallel compile ---------------------------------------------------------------------------------------------

def _worker(tasks, results) -> None:
    """Compile (and run once, on a zero block table) each task's config; exit after a fatal CUDA error."""
    os.environ.pop("TRITON_INTERPRET", None)
    from tqops.attention import combine, triton_paged

    seen: dict = {}
    _record_kernels(triton_paged._paged_attention_kernel, seen)
    _record_kernels(combine._combine_splits_kernel, seen)
    made: dict = {}
    while True:
        task = tasks.get()
        if task is None:
            return
        start = time.monotonic()
        fatal = False
        try:
            fmt = _format(task["fmt"])
            shape = Shape(**task["shape"])
            key = (task["fmt"], task["batch"], task["q_len"])
            if key not in made:
                if task["fmt"] not in made:
                    made[task["fmt"]] = make_cache(fmt, shape, task["seqs"], "cuda", fill=False)
                made[key] = make_inputs(fmt, shape, task["batch"], task["q_len"], *made[task["fmt"]], torch.bfloat16)
            seen.pop(ATTENTION, None)
            triton_paged.paged_attention_triton(*made[key].args(0), **task["overrides"])
            torch.cuda.synchronize()
            res = _kernel_stats(seen.get(ATTENTION))
        except Exception as e:  # noqa: BLE001 - reported per config
            fatal = _fatal(e)
            res = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        res["compile_s"] = time.monotonic() - start
        results.send((task["id"], res, fatal))
        if fatal:
            return


class CompilePool:
    """Worker processes that fill Triton's on-disk cache (so this process's first call of a config only loads it).
    A worker whose CUDA context a config broke is replaced; that config is reported failed.

    Each worker answers on its own pipe: a worker that dies mid-answer can break only its own channel (a shared
    ``multiprocessing.Queue`` is written by a feeder thread under a lock every process shares, and a worker that
    exits holding it blocks every other worker's answer for good)."""

    def __init__(self, jobs: int, target: Callable = _worker):
        import multiprocessing as mp

        self.ctx, self.target = mp.get_context("spawn"), target
        self.workers = [self._start() for _ in range(jobs)]

    def _start(self) -> dict:
        tasks = self.ctx.Queue()
        answers, child_end = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=self.target, args=(tasks, child_end), daemon=True)
        proc.start()
        child_end.close()  # the child's copy alone: recv raises EOFError once it exits
        return dict(proc=proc, tasks=tasks, answers=answers, task=None, since=0.0)

    def run(self, tasks: list[dict], stop_at: float, desc: str, task_timeout: float = 240.0,
            grace: float = 60.0) -> dict:
        """{task id: result}: ``tasks`` handed out until ``stop_at`` (the rest: "not compiled: time budget"); a task
        whose worker dies, or runs past ``task_timeout`` or ``grace`` after ``stop_at``, is reported failed."""
        from multiprocessing.connection import wait
        from tqdm import tqdm

        pending, done = deque(tasks), {}

        def replace(i: int) -> None:
            w = self.workers[i]
            if w["proc"].is_alive():
                w["proc"].terminate()
            w["proc"].join(timeout=30)
            w["answers"].close()
            self.workers[i] = self._start()

        def fail(i: int, error: str) -> None:
            done[self.workers[i]["task"]["id"]] = dict(error=error)
            replace(i)
            bar.update()

        with tqdm(total=len(tasks), desc=desc, file=sys.stdout, mininterval=2.0) as bar:
            while True:
                now = time.monotonic()
                for w in self.workers:
                    if w["task"] is None and pending and now < stop_at:
                        w["task"], w["since"] = pending.popleft(), now
                        w["tasks"].put(w["task"])
                busy = [i for i, w in enumerate(self.workers) if w["task"] is not None]
                if not busy:
                    break
                ready = wait([self.workers[i]["answers"] for i in busy], timeout=2.0)
                now = time.monotonic()
                for i in busy:
                    w = self.workers[i]
                    if w["answers"] in ready:
                        try:
                            tid, res, fatal = w["answers"].recv()
                        except EOFError:
                            fail(i, f"worker died (exit {w['proc'].exitcode})")
                            continue
                        done[tid] = res
                        bar.update()
                        w["task"] = None
                        if fatal:
                            replace(i)
                    elif now - w["since"] > task_timeout:
                        fail(i, f"compile timeout ({task_timeout:.0f} s)")
                    elif now > stop_at + grace:
                        fail(i, "not compiled: time budget")
        for t in pending:
            done[t["id"]] = dict(error="not compiled: time budget")
        return done

    def close(self) -> None:
        for w in self.workers:
            w["tasks"].put(None)
        for w in self.workers:
            w["proc"].join(timeout=10)
            if w["proc"].is_alive():
                w["proc"].terminate()


# ---- timing -------------------------------------------------------------------------------------------------------

def time_us(fns: Sequence[Callable[[], object]], timer: str, calls: int, reps: int) -> float:
    """Microseconds per call: ``calls`` back-to-back calls cycling through ``fns`` in one CUDA graph (median of
    ``reps`` replays; "calls"), one call per replay with L2 flushed ("graph"), or one call on the CPU clock ("cpu",
    for the interpreter: structure only)."""
    if timer == "cpu":
        start = time.perf_counter()
        fns[0]()
        return (time.perf_counter() - start) * 1e6
    from tqops.bench.timing import time_graph, time_per_call

    if timer == "graph":
        return time_graph(fns[0], rep_ms=40)
    return time_per_call(fns, calls=calls, reps=reps) * 1e6


def _diff(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref|, that over max |ref|); NaN anywhere gives inf."""
    d = (out.float() - ref.float()).abs()
    if not torch.isfinite(out.float()).all():
        return math.inf, math.inf
    top = ref.float().abs().max().item()
    return d.max().item(), d.max().item() / max(top, 1e-30)


# ---- the sweep ----------------------------------------------------------------------------------------------------

def _format(name: str):
    from tqops.formats import get_format

    return get_format(name)


class Sweep:
    """The cases, their rows and the per-stage work. ``attention``/``launch``: the kernel's host wrapper and launch
    rules (tests pass the interpreted copies); ``pool``: a CompilePool or None (compile on first call)."""

    def __init__(self, formats: Sequence[str], batches: Sequence[int], q_lens: Sequence[int], shape: Shape,
                 grid: Grid, device, dtype=torch.bfloat16, attention=None, launch=None, num_sms: Optional[int] = None,
                 timer: str = "calls", calls: int = 32, reps: int = 15, tol: float = 2e-2, pool=None,
                 budget_s: Optional[float] = None, log=print, max_sets: int = 8, out_path: Optional[str] = None):
        if attention is None or launch is None:
            from tqops.attention.triton_paged import launch_config, paged_attention_triton

            attention, launch = attention or paged_attention_triton, launch or launch_config
        self.attention, self.launch = attention, launch
        self.formats, self.shape, self.grid, self.device, self.dtype = list(formats), shape, grid, device, dtype
        self.num_sms = num_sms or (torch.cuda.get_device_properties(device).multi_processor_count
                                   if torch.device(device).type == "cuda" else 132)
        self.timer, self.calls, self.reps, self.tol, self.pool, self.log = timer, calls, reps, tol, pool, log
        self.t0 = time.monotonic()
        self.budget_s, self.out_path = budget_s, out_path
        self.seqs = max(batches) * (2 if max_sets > 1 else 1)
        self.max_sets = max_sets
        # priority: decode first (the measured gap), then verify; batches and formats as given
        self.cases = [dict(fmt=f, batch=b, q_len=q) for q in q_lens for b in batches for f in self.formats]
        self.caches: dict = {}
        self.seen: dict = {}  # the compiled attention kernel of the last call (registers, spills)
        if torch.device(device).type == "cuda":
            from tqops.attention import triton_paged

            _record_kernels(triton_paged._paged_attention_kernel, self.seen)
        self._next_id = 0
        self.tasks: dict = {}

    # -- bookkeeping
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def before(self, share: float) -> float:
        """The monotonic time at ``share`` of the budget (inf without one)."""
        return math.inf if self.budget_s is None else self.t0 + share * self.budget_s

    def groups(self) -> list[list[dict]]:
        """The cases by q_len, in the order given (q_len 1 first by default)."""
        out: dict = {}
        for case in self.cases:
            out.setdefault(case["q_len"], []).append(case)
        return list(out.values())

    # -- setup
    def setup(self) -> None:
        for fmt_name in self.formats:
            fmt = _format(fmt_name)
            self.caches[fmt_name] = make_cache(fmt, self.shape, self.seqs, self.device)
        for case in self.cases:
            fmt = _format(case["fmt"])
            case["inputs"] = make_inputs(fmt, self.shape, case["batch"], case["q_len"], *self.caches[case["fmt"]],
                                         self.dtype, self.max_sets)
            base = self.base_for(case)
            case["default"] = full_config(base(None))
            case["group_pad"] = base(None)["group_pad"]
            case["rows"], case["pruned"] = [], []
            case["keys"] = set()

    def base_for(self, case) -> Callable[[Optional[int]], dict]:
        inp = case["inputs"]
        num_tokens, batch = inp.query.shape[0], case["batch"]
        max_blocks = inp.sets[0][1].shape[1]
        fmt = _format(case["fmt"])
        s = self.shape

        def base(block_q=None):
            return self.launch(num_tokens, batch, s.num_q_heads, s.num_kv_heads, s.head_dim, s.block_size,
                               max_blocks, self.num_sms, fmt, block_q)

        return base

    def add(self, case, cfgs: list[dict], stage: str) -> list[dict]:
        """New rows for the configs of ``cfgs`` not yet in ``case`` (by effective_key)."""
        fmt, rows = _format(case["fmt"]), []
        for cfg in cfgs:
            key = effective_key(cfg, fmt)
            if key in case["keys"]:
                continue
            case["keys"].add(key)
            row = dict(config=label(cfg, fmt, case["q_len"]), stage=stage, cfg=cfg, us=None)
            case["rows"].append(row)
            rows.append(row)
        return rows

    # -- compile
    def compile(self, work: list[tuple[dict, dict]], stop_share: float, desc: str) -> None:
        """Compile the (case, row) pairs' configs in the pool; attach regs / spills / errors to the rows."""
        if self.pool is None or not work:
            return
        tasks = []
        for case, row in work:
            tid = self._next_id
            self._next_id += 1
            tasks.append(dict(id=tid, fmt=case["fmt"], batch=case["batch"], q_len=case["q_len"],
                              shape=dataclasses.asdict(self.shape), seqs=self.seqs,
                              overrides={} if row["stage"] == "default" else overrides_of(row["cfg"])))
            self.tasks[tid] = row
        for tid, res in self.pool.run(tasks, self.before(stop_share), desc).items():
            row = self.tasks[tid]
            if row["stage"] == "default" and "error" in res:
                res["pool_error"] = res.pop("error")  # the default runs here in any case (the production path)
            row.update(res)
            if res.get("error"):
                row["skip"] = "time budget" if "time budget" in res["error"] else "compile/probe error"

    # -- time
    def measure(self, case, row) -> None:
        """Run the row's config once (output vs the default's) and time it; errors are kept on the row."""
        if row.get("error"):
            return
        if row["stage"] != "default" and "out" not in case:
            self._skip(row, "no default output", "the default failed")
            return
        inp = case["inputs"]
        kw = {} if row["stage"] == "default" else overrides_of(row["cfg"])
        fns = [(lambda i=i: self.attention(*inp.args(i), **kw)) for i in range(len(inp.sets))]
        try:
            self.seen.pop(ATTENTION, None)
            start = time.monotonic()
            out = fns[0]()
            if inp.query.is_cuda:
                torch.cuda.synchronize()
            row["first_call_s"] = time.monotonic() - start  # ~0.1 when the pool compiled it, seconds if not
            if "regs" not in row:
                row.update(_kernel_stats(self.seen.get(ATTENTION)))
            if row["stage"] == "default":
                case["out"] = out
                from tqops.attention.naive import paged_attention_naive

                row["ref_max_diff"], row["ref_rel"] = _diff(out, paged_attention_naive(*inp.args(0)))
            row["max_diff"], row["rel_diff"] = _diff(out, case["out"])
            row["ok"] = row["rel_diff"] <= self.tol
            row["us"] = time_us(fns, self.timer, self.calls, self.reps)
        except Exception as e:  # noqa: BLE001 - a config the compiler or the launch rejects
            if inp.query.is_cuda and _fatal(e):
                raise
            self._skip(row, "error", f"{type(e).__name__}: {str(e)[:300]}")

    @staticmethod
    def _skip(row: dict, why: str, error: str) -> None:
        row["skip"], row["error"] = why, error

    def prune_spills(self, case, rows: list[dict]) -> None:
        """Rows whose kernel spills more than ``grid.max_spills`` words (or the default's) are not timed."""
        limit = max(self.grid.max_spills, case["rows"][0].get("spills") or 0)
        for row in rows:
            if row.get("spills") is not None and row["spills"] > limit and row["stage"] != "default":
                self._skip(row, "spills", f"spills {row['spills']} words (limit {limit})")

    def time_rows(self, work: list[tuple[dict, dict]], stop_share: float, desc: str) -> None:
        from tqdm import tqdm

        for case, row in tqdm(work, desc=desc, file=sys.stdout, mininterval=2.0):
            if time.monotonic() > self.before(stop_share) and row["stage"] != "default":
                if not row.get("error"):
                    self._skip(row, "time budget", "not timed: time budget")
                continue
            self.measure(case, row)
        self.save()

    # -- stages (each on a group of cases: main runs the q_len 1 cases' two stages before the q_len 16 ones')
    def stage1(self, cases: Optional[list] = None, explicit: Optional[dict] = None) -> None:
        """Default and stage-1 rows of ``cases`` (all); ``explicit`` {format: [override dicts]} replaces the grid."""
        work = []
        for case in cases or self.cases:
            fmt = _format(case["fmt"])
            self.add(case, [case["default"]], "default")
            if explicit is not None:
                cfgs = [full_config(case["default"], **o) for o in explicit.get(case["fmt"], [])]
            else:
                cap = max(1, int(self.grid.max_configs * self.grid.stage1_share) - 1)
                cfgs, case["pruned"] = stage1_configs(self.base_for(case), fmt, case["q_len"],
                                                      self.shape.head_dim, self.grid, cap)
            self.add(case, cfgs, "tiles")
            work += [(case, row) for row in case["rows"]]
        self.compile(work, COMPILE_UNTIL, "compile stage 1")
        for case in cases or self.cases:
            self.prune_spills(case, case["rows"])
        self.time_rows(work, TIME_UNTIL, "time stage 1")

    def stage2(self, cases: Optional[list] = None) -> None:
        """Switch variants (stage2_variants) of the fastest correct stage-1 rows, up to ``grid.max_configs``."""
        if time.monotonic() > self.before(STAGE2_FROM):
            if self.log:
                self.log(f"stage 2 skipped: {self.elapsed():.0f} s of the {self.budget_s:.0f} s budget used")
            return
        work = []
        for case in cases or self.cases:
            fmt = _format(case["fmt"])
            good = sorted((r for r in case["rows"] if r.get("ok") and r["us"] is not None), key=lambda r: r["us"])
            room = self.grid.max_configs - len(case["rows"])
            bases = []
            for row in good[:self.grid.top]:
                variants = stage2_variants(row["cfg"], fmt, self.shape.head_dim, case["group_pad"], self.grid)
                variants = [v for v in variants if effective_key(v, fmt) not in case["keys"]]
                if room <= 0 or (bases and len(variants) > room):
                    break
                new = self.add(case, variants[:room], "switches")
                room -= len(new)
                bases.append(row["config"])
                work += [(case, r) for r in new]
            case["stage2_bases"] = bases
        self.compile(work, COMPILE_UNTIL, "compile stage 2")
        for case in cases or self.cases:
            self.prune_spills(case, [r for c, r in work if c is case])
        self.time_rows(work, TIME_UNTIL, "time stage 2")

    def best(self, case) -> Optional[dict]:
        good = [r for r in case["rows"] if r.get("ok") and r.get("us") is not None]
        return min(good, key=lambda r: r["us"]) if good else None

    def confirm(self, rounds: int = 3) -> list[dict]:
        """Every format's default and best re-timed alternately per (batch, q_len); the summary rows."""
        summary = []
        groups: dict = {}
        for case in self.cases:
            groups.setdefault((case["batch"], case["q_len"]), []).append(case)
        for (batch, q_len), cases in groups.items():
            entries = []
            for case in cases:
                default = case["rows"][0]
                best = self.best(case)
                if default.get("us") is None:
                    continue
                entries.append((case, "default", default))
                if best is not None and best is not default:
                    entries.append((case, "best", best))
            if self.timer != "cpu" and time.monotonic() < self.before(CONFIRM_UNTIL):
                times = {id(row): [] for _, _, row in entries}
                for _ in range(rounds):
                    for case, _, row in entries:
                        inp = case["inputs"]
                        kw = {} if row["stage"] == "default" else overrides_of(row["cfg"])
                        fns = [(lambda i=i, inp=inp, kw=kw: self.attention(*inp.args(i), **kw))
                               for i in range(len(inp.sets))]
                        times[id(row)].append(time_us(fns, self.timer, self.calls, self.reps))
                for _, _, row in entries:
                    row["confirm_us"] = statistics.median(times[id(row)])
            s = dict(batch=batch, q_len=q_len)
            ref = next((row for case, kind, row in entries if case["fmt"] == "bf16" and kind == "default"), None)
            ref_us = (ref or {}).get("confirm_us", (ref or {}).get("us"))
            for case in cases:
                default, best = case["rows"][0], self.best(case) or case["rows"][0]
                d_us = default.get("confirm_us", default.get("us"))
                b_us = best.get("confirm_us", best.get("us"))
                s[f"{case['fmt']} default us"] = d_us
                s[f"{case['fmt']} best us"] = b_us
                s[f"{case['fmt']} best config"] = best["config"]
                if ref_us and b_us:
                    s[f"{case['fmt']} best / bf16 default"] = b_us / ref_us
            summary.append(s)
        self.summary = summary
        self.save()
        return summary

    # -- reports
    def table(self, case) -> str:
        from tqops.bench.table import markdown_table

        if not case.get("rows"):
            return f"### {case['fmt']}, batch {case['batch']}, q_len {case['q_len']}: not run"
        default = case["rows"][0]
        rows = [r for r in case["rows"] if r.get("us") is not None]
        rows = [default] + sorted((r for r in rows if r is not default), key=lambda r: r["us"])
        out = []
        for r in rows:
            note = "default" if r is default else ("" if r.get("ok") else "**WRONG**")
            if r is default and r.get("ref_rel") is not None:
                note += f" (vs torch reference: rel {r['ref_rel']:.2g})"
            out.append(dict(config=r["config"], us=r["us"],
                            vs_default=r["us"] / default["us"] if default.get("us") else None,
                            max_diff=r.get("max_diff"), rel_diff=r.get("rel_diff"), regs=r.get("regs"),
                            spills=r.get("spills"), stage=r["stage"], note=note))
        skipped = [r for r in case["rows"] if r.get("us") is None]
        title = (f"### {case['fmt']}, batch {case['batch']}, q_len {case['q_len']} "
                 f"(default: {default['config']})")
        lines = [title, "", markdown_table(out) if out else "(nothing timed)"]
        if skipped or case["pruned"]:
            reasons: dict = {}
            for r in skipped:
                reasons.setdefault(r.get("skip", "not timed"), []).append(r["config"])
            for p in case["pruned"]:
                why = "est. registers" if "registers" in p["reason"] else p["reason"]
                reasons.setdefault(f"not compiled ({why})", []).append(
                    label(p["cfg"], _format(case["fmt"]), case["q_len"]))
            lines.append("")
            lines += [f"- {reason}: {len(cfgs)} ({', '.join(cfgs[:6])}{', ...' if len(cfgs) > 6 else ''})"
                      for reason, cfgs in reasons.items()]
        return "\n".join(lines)

    def markdown(self) -> str:
        """Every case's table, then the summary (last, so the tail of the output has it)."""
        from tqops.bench.table import markdown_table

        parts = [self.table(case) for case in self.cases]
        slow = [r for case in self.cases for r in case["rows"] if (r.get("first_call_s") or 0) > 1.0]
        if self.pool is not None or slow:
            parts.append(f"First calls over 1 s (compiled in this process, not ahead in the pool): {len(slow)}")
        parts.append("### Summary (medians of the confirmation round; best = the fastest correct config)\n\n"
                     + markdown_table(getattr(self, "summary", None) or []))
        return "\n\n".join(parts)

    def report(self) -> dict:
        cases = []
        for case in self.cases:
            rows = [{k: v for k, v in r.items() if k != "cfg"} | dict(overrides=overrides_of(r["cfg"]))
                    for r in case.get("rows", [])]
            cases.append(dict(format=case["fmt"], batch=case["batch"], q_len=case["q_len"],
                              default=case.get("default"), stage2_bases=case.get("stage2_bases"), rows=rows,
                              pruned=[dict(config=label(p["cfg"], _format(case["fmt"]), case["q_len"]),
                                           reason=p["reason"], overrides=overrides_of(p["cfg"]))
                                      for p in case.get("pruned", [])]))
        return dict(shape=dataclasses.asdict(self.shape), grid=dataclasses.asdict(self.grid), timer=self.timer,
                    calls=self.calls, reps=self.reps, tol=self.tol, num_sms=self.num_sms, elapsed_s=self.elapsed(),
                    device=(torch.cuda.get_device_name(self.device) if torch.device(self.device).type == "cuda"
                            else str(self.device)),
                    versions=dict(torch=torch.__version__, triton=_triton_version()), cases=cases,
                    summary=getattr(self, "summary", None))

    def save(self) -> None:
        if self.out_path:
            with open(self.out_path, "w") as f:
                json.dump(self.report(), f, indent=1, default=str)


def _triton_version() -> str:
    import triton

    return triton.__version__


def run_sweep(formats: Sequence[str] = ("bf16", "turboquant_4bit_nc"), batches: Sequence[int] = (8, 1),
              q_lens: Sequence[int] = (1, 16), shape: Shape = Shape(), grid: Grid = Grid(), device="cuda",
              explicit: Optional[dict] = None, stage2: bool = True, **kw) -> Sweep:
    """The whole sweep (setup, stage 1, stage 2, confirmation); returns the Sweep (its cases, tables, report)."""
    sweep = Sweep(formats, batches, q_lens, shape, grid, device, **kw)
    sweep.setup()
    for group in sweep.groups():
        sweep.stage1(group, explicit)
        if stage2 and explicit is None:
            sweep.stage2(group)
    sweep.confirm()
    return sweep


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 2


def main(argv=None) -> int:
    from tqops.formats import FORMATS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="attention_sweep.json", help="JSON results (written after each stage)")
    p.add_argument("--formats", nargs="+", default=["bf16", "turboquant_4bit_nc"], choices=FORMATS,
                   help="bf16 first: the summary compares with its default")
    p.add_argument("--batches", nargs="+", type=int, default=[8, 1])
    p.add_argument("--q-lens", nargs="+", type=int, default=[1, 16])
    p.add_argument("--context", type=int, default=Shape.context)
    p.add_argument("--max-configs", type=int, default=Grid.max_configs, help="per (format, batch, q_len)")
    p.add_argument("--top", type=int, default=Grid.top, help="stage-1 configs whose switches stage 2 varies")
    p.add_argument("--no-keys-as-m", action="store_true", help="no keys-as-M variants (32-row tiles)")
    p.add_argument("--maxnreg", nargs="*", type=int, default=[], help="register caps to try in stage 2")
    p.add_argument("--budget-s", type=float, default=210.0,
                   help="wall-clock budget after start-up; later stages are cut to fit (default 210)")
    p.add_argument("--jobs", type=int, default=min(15, max(1, _cpus() - 1)),
                   help="compile worker processes (0: compile in this process)")
    p.add_argument("--timer", choices=("calls", "graph"), default="calls")
    p.add_argument("--calls", type=int, default=32)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--tol", type=float, default=2e-2, help="max |alt - default| / max |default| counted correct")
    a = p.parse_args(argv)
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        p.error("needs a CUDA device and compiled kernels (TRITON_INTERPRET unset)")
    start = time.monotonic()
    pool = CompilePool(a.jobs) if a.jobs > 0 else None  # the workers import while this process fills the caches
    grid = Grid(max_configs=a.max_configs, top=a.top, keys_as_m=not a.no_keys_as_m, maxnreg=tuple(a.maxnreg))
    sweep = None
    try:
        sweep = Sweep(a.formats, a.batches, a.q_lens, dataclasses.replace(Shape(), context=a.context), grid, "cuda",
                      timer=a.timer, calls=a.calls, reps=a.reps, tol=a.tol, pool=pool, budget_s=a.budget_s,
                      out_path=a.out)
        sweep.t0 = start
        sweep.setup()
        print(f"setup {sweep.elapsed():.0f} s: {len(sweep.cases)} cases on {torch.cuda.get_device_name()}, "
              f"{sweep.num_sms} SMs, {a.jobs} compile workers", flush=True)
        for group in sweep.groups():
            sweep.stage1(group)
            sweep.stage2(group)
        if pool is not None:
            pool.close()
            pool = None
        sweep.confirm()
    finally:
        if pool is not None:
            pool.close()
        if sweep is not None:  # also after an error: what was measured
            sweep.save()
            text = sweep.markdown()
            with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
                f.write(text + "\n")
            print("\n" + text)
            print(f"\n{sweep.elapsed():.0f} s in all; JSON in {a.out}, tables in {os.path.splitext(a.out)[0]}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
