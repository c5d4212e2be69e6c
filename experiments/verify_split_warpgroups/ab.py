"""The split-warpgroup verify kernel against the landed one: the torch reference on ragged cases, then interleaved
timing at q_len 16 (32 q / 8 kv heads, causal). On an sm_90 GPU: python experiments/verify_split_warpgroups/ab.py [rounds]"""
import sys
from pathlib import Path

import torch

from tests.attention.cases import make_case
from tqops.attention import cuda_paged, cuda_verify
from tqops.attention.naive import paged_attention_naive
from tqops.attention.triton_paged import _centroid_pairs, _rotation_signs, _sm_count
from tqops.bench.attention import _fill_cache
from tqops.bench.timing import time_graph
from tqops.formats import get_format

HERE = Path(__file__).resolve().parent
LIBRARY = HERE.parents[1] / "tqops/attention/cuda/turboquant_verify.cu"
# name -> (source, dynamic shared memory, threads, partials per program)
KERNELS = {"landed": (LIBRARY, cuda_verify.SMEM_BYTES, 128, 1),
           "split": (HERE / "split_warpgroups.cu", 180416, 384, 2)}
fmt = get_format("turboquant_4bit_nc")
_built = {}


def call(name, query, cache, bt, seq, qsl, causal, sinks, splits=None):
    path, smem, threads, per_program = KERNELS[name]
    key = (name, query.dtype == torch.bfloat16)
    if key not in _built:
        _built[key] = cuda_paged.build_kernel(path, f"turboquant_verify<{'true' if key[1] else 'false'}>", smem,
                                              torch.cuda.current_device(), compute_capability="90a")
    num_tokens, num_q_heads, _ = query.shape
    _, block_size, num_kv_heads, _ = cache.shape
    batch, max_blocks = bt.shape
    bt, seq, qsl = (t.to(torch.int32) for t in (bt, seq, qsl))
    block_q, tiles, auto = cuda_verify.launch_shape(num_tokens, batch, num_q_heads // num_kv_heads, num_kv_heads,
                                                    max_blocks * block_size, _sm_count(query.device.index or 0))
    splits = splits or auto
    return cuda_paged.launch_split_kv(_built[key], (tiles, num_kv_heads, splits), threads, smem, query, cache, bt,
                                      seq, qsl, _rotation_signs(128, query.device), _centroid_pairs(4, query.device),
                                      128**-0.5 * 1.4426950408889634, block_q, splits * per_program, causal, sinks,
                                      (cuda_verify.tensor_map(cache),))


def check():
    gen = torch.Generator().manual_seed(1)
    for name in KERNELS:
        worst = 0.0
        for k in range(16):
            batch = 1 + k % 3
            q_lens = [int(x) for x in torch.randint(1, 40, (batch,), generator=gen)]
            ctx = [int(x) for x in torch.randint(0, 1500, (batch,), generator=gen)]
            case = make_case("turboquant_4bit_nc", q_lens=q_lens, seq_lens=[q + c for q, c in zip(q_lens, ctx)],
                             num_kv_heads=8, group=(4, 2, 3, 8)[k % 4], head_dim=128,
                             block_size=(8, 16, 32, 64, 128)[k % 5], causal=k % 2 == 0, with_sinks=k % 3 == 0,
                             dtype=(torch.bfloat16, torch.float16)[k % 5 == 4], seed=k,
                             pad_entry=(0, -1, 10**6)[k % 3], device="cuda")
            out = call(name, case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc,
                       case.causal, case.sinks, (None, 1, 2, 4, 8)[k % 5]).float()
            ref = paged_attention_naive(case.query, case.cache, case.block_table, case.seq_lens,
                                        case.query_start_loc, fmt, case.causal, None, case.sinks, 128**-0.5, 1.0,
                                        1.0).float()
            err = float((out - ref).norm() / ref.norm().clamp_min(1e-6))
            worst = max(worst, err if not torch.isnan(out).any() else float("inf"))
        print(f"{name}: worst relative error {worst:.2e} ({'ok' if worst < 1.5e-2 else 'FAIL'})", flush=True)


def bench(rounds: int):
    for batch, ctx in ((32, 8192), (8, 32768), (4, 16384)):
        cache, bt = _fill_cache(fmt.name, batch, ctx, 8, 128, 16)
        seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        qsl = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * 16
        query = torch.randn(batch * 16, 32, 128, device="cuda", dtype=torch.bfloat16)
        times = {name: [] for name in KERNELS}
        for _ in range(rounds):
            for name in KERNELS:
                times[name].append(time_graph(lambda: call(name, query, cache, bt, seq, qsl, True, None)))
        print(f"{batch} x {ctx} q_len 16 causal, us: " + "; ".join(
            f"{n} {' '.join(f'{t:.1f}' for t in ts)}" for n, ts in times.items()), flush=True)


if __name__ == "__main__":
    check()
    bench(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
