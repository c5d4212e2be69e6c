"""kv_store throughput per cache format on CUDA, against a plain device copy of the same K/V bytes."""
from __future__ import annotations

import torch

from tqops.device_constants import allocate_kv_cache
from tqops.formats import FORMATS, get_format

from .timing import time_per_call

# Each figure is timing.time_per_call's. The calls cycle through SETS copies of the inputs and outputs (~4x the
# 60 MB L2) so no call reads what the one before left in L2; the copy baseline is timed the same way in the same run.
SETS = 4


def _inputs(num_tokens, num_kv_heads, head_dim, dtype, block_size=16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    # A prefill-like mapping: consecutive slots, as a fresh request fills its blocks.
    slot_mapping = torch.arange(num_tokens, device="cuda", dtype=torch.int64)
    num_blocks = -(-num_tokens // block_size)
    return key, value, slot_mapping, num_blocks, block_size


def _row(name, seconds, bytes_moved, copy_gbps=None, **extra):
    gbps = bytes_moved / seconds / 1e9
    row = dict(format=name, time_us=seconds * 1e6, gbps=gbps,
               fraction_of_copy=1.0 if copy_gbps is None else gbps / copy_gbps)
    row.update(extra)
    return row


def bench_copy(num_bytes: int, sets: int = SETS) -> dict:
    """A device-to-device copy of num_bytes: the bandwidth a memory-bound store should approach."""
    srcs = [torch.empty(num_bytes, dtype=torch.uint8, device="cuda") for _ in range(sets)]
    dsts = [torch.empty_like(s) for s in srcs]
    seconds = time_per_call([lambda s=s, d=d: d.copy_(s) for s, d in zip(srcs, dsts)])
    return _row("copy", seconds, 2 * num_bytes)


def bench_store(num_tokens: int = 16384, num_kv_heads: int = 8, head_dim: int = 128, dtype=torch.bfloat16,
                formats=FORMATS, configs=None, impl=None, sets: int = SETS) -> list[dict]:
    """Time kv_store_triton per format; rows of format, time_us, gbps, fraction_of_copy (copy row first).

    GB/s counts bytes read (K, V, slot_mapping) plus bytes written (the cache slots). ``configs`` maps a
    format name to named launch-parameter dicts (see triton_store.default_config, store_configs) to time
    instead of the default; each such row also carries its ``config`` name. ``impl``: a module with
    ``default_config`` and ``launch`` to time instead of triton_store (to compare kernels in one run).
    """
    if impl is None:
        # Imported here, as is store_configs below: they need triton, optional without CUDA, where
        # `python -m tqops.bench quality` imports this module.
        from tqops.kv import triton_store as impl

    inputs = [_inputs(num_tokens, num_kv_heads, head_dim, dtype, seed=i) for i in range(sets)]
    key, value, slot_mapping, num_blocks, block_size = inputs[0]
    kv_bytes = key.numel() * key.element_size() + value.numel() * value.element_size()
    copy = bench_copy(kv_bytes, sets)
    rows = [copy]
    for name in formats:
        fmt = get_format(name)
        caches = [allocate_kv_cache(fmt, num_blocks, block_size, num_kv_heads, head_dim, device="cuda")
                  for _ in range(sets)]
        moved = kv_bytes + slot_mapping.numel() * slot_mapping.element_size() + (
            num_tokens * num_kv_heads * fmt.slot_bytes(head_dim))
        sweep = (configs or {}).get(name)
        for label, cfg in (sweep or {"default": impl.default_config(fmt, head_dim, dtype)}).items():
            fns = [lambda k=k, v=v, s=s, c=c, cfg=cfg: impl.launch(k, v, c, s, fmt, 1.0, 1.0, **cfg)
                   for (k, v, s, _, _), c in zip(inputs, caches)]
            try:
                seconds = time_per_call(fns)
            except Exception as exc:  # a sweep reports a config that fails to build or launch and goes on
                if not sweep:
                    raise
                rows.append(dict(format=name, config=label, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                continue
            extra = {"config": label} if sweep else {}
            rows.append(_row(name, seconds, moved, copy["gbps"], **extra))
        del caches
    return rows


def sweep_configs(head_dim: int = 128, dtype=torch.bfloat16) -> dict:
    """candidate_configs for every format, as bench_store's ``configs`` argument."""
    from tqops.kv.store_configs import candidate_configs

    return {name: candidate_configs(name, head_dim, dtype) for name in FORMATS}


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'format':<22}{'time_us':>10}{'GB/s':>10}{'of copy':>9}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['format']:<22}  FAILED {r['error']}  {r['config']}")
            continue
        line = f"{r['format']:<22}{r['time_us']:>10.1f}{r['gbps']:>10.0f}{r['fraction_of_copy']:>9.2f}"
        if "config" in r:
            line += f"  {r['config']}"
        lines.append(line)
    return "\n".join(lines)
