"""The Triton paged-attention kernel over one cache held slot-major (as allocated) and head-major (a strided view of
a head-major copy): four formats, q_len 1 and 16, us; outputs compared. From the repository root, on a GPU:
PYTHONPATH=$PWD python experiments/verify_ablations/head_major/triton_strides.py"""
import torch

from tqops.attention.triton_paged import paged_attention_triton
from tqops.bench.attention import _fill_cache
from tqops.bench.timing import time_graph
from tqops.formats import get_format


def attention(query, cache, bt, seq, qsl, fmt):
    return paged_attention_triton(query, cache, bt, seq, qsl, get_format(fmt), True, None, None, 128**-0.5, 1.0, 1.0)


for fmt in ("fp8_e4m3", "bf16", "turboquant_4bit_nc", "turboquant_3bit_nc"):
    for batch, ctx in ((32, 8192), (8, 32768)):
        slot_major, bt = _fill_cache(fmt, batch, ctx, 8, 128, 16)
        caches = {"slot-major": slot_major,
                  "head-major": slot_major.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)}
        seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        for q_len in (1, 16):
            qsl = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * q_len
            query = torch.randn(batch * q_len, 32, 128, device="cuda", dtype=torch.bfloat16)
            outs = [attention(query, c, bt, seq, qsl, fmt).float() for c in caches.values()]
            times = {name: [] for name in caches}
            for _ in range(3):
                for name, c in caches.items():
                    times[name].append(time_graph(lambda: attention(query, c, bt, seq, qsl, fmt)))
            print(f"{fmt} {batch} x {ctx} q_len {q_len}, us: " + "; ".join(
                f"{n} {' '.join(f'{x:.1f}' for x in ts)}" for n, ts in times.items()) +
                f"; max difference {float((outs[0] - outs[1]).abs().max()):.1e}", flush=True)
