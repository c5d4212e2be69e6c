"""What a 64-row verify tile can reach (needs CUDA): ``python tools/verify_ceiling.py``.

32 x 8K keys, 32 q / 8 kv heads, head_dim 128, so 64 query rows (16 tokens x the GQA group of 4) per sequence and kv
head. Prints microseconds per CUDA-graph replay (``time_graph``, L2 flushed between replays) and the rate of the
call's QK and PV products for:
- SDPA's flash, cuDNN and efficient backends on dense bf16 K/V with the group folded into the query rows
  (non-causal): one sequence with all 2,048 rows per kv head (the same products, each key tile shared by many rows),
  32 sequences of 64 rows sharing one K/V through a stride-0 batch (keys in L2), and 32 with their own K/V (DRAM);
- tqops' paged attention at ``q_len`` 16, causal and not, for bf16, fp8_e4m3 and turboquant_4bit_nc, each sequence
  on its own blocks (DRAM) or every sequence on the first one's blocks (keys in L2).
The figures and what they mean are in docs/tuning.md ("What limits the quantized attention kernels").
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tqops
from tqops.bench.attention import _fill_cache
from tqops.bench.timing import copy_bandwidth, time_graph

HEAD_DIM, KV_HEADS, CONTEXT, BATCH, ROWS = 128, 8, 8192, 32, 64
FLOP = 4 * BATCH * KV_HEADS * ROWS * CONTEXT * HEAD_DIM


def report(name: str, us: float) -> None:
    print(f"{name:60s} {us:8.1f} us  {FLOP / us / 1e6:6.0f} TFLOP/s", flush=True)


def sdpa_rows() -> None:
    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    one = [randn(1, KV_HEADS, CONTEXT, HEAD_DIM) for _ in range(2)]
    own = [randn(BATCH, KV_HEADS, CONTEXT, HEAD_DIM) for _ in range(2)]
    cases = {
        "one sequence, 2048 rows per kv head (keys in L2)": (randn(1, KV_HEADS, BATCH * ROWS, HEAD_DIM), *one),
        "32 x 64 rows, one K/V by a stride-0 batch (keys in L2)":
            (randn(BATCH, KV_HEADS, ROWS, HEAD_DIM), *(t.expand(BATCH, -1, -1, -1) for t in one)),
        "32 x 64 rows, own K/V (DRAM)": (randn(BATCH, KV_HEADS, ROWS, HEAD_DIM), *own),
    }
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for name, (q, k, v) in cases.items():
            try:
                with sdpa_kernel(backend):
                    us = time_graph(lambda: F.scaled_dot_product_attention(q, k, v))
                report(f"sdpa {backend.name[:9]} {name}", us)
            except RuntimeError as e:  # a backend that does not take the case says why
                print(f"sdpa {backend.name} {name}: {str(e)[:120]}", flush=True)


def tqops_rows() -> None:
    query = torch.randn(BATCH * 16, 4 * KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    query_start_loc = torch.arange(0, BATCH + 1, dtype=torch.int32, device="cuda") * 16
    seq_lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32, device="cuda")
    for name in ("bf16", "fp8_e4m3", "turboquant_4bit_nc"):
        fmt = tqops.get_format(name)
        cache, table = _fill_cache(name, BATCH, CONTEXT, KV_HEADS, HEAD_DIM, 16)
        # every row on the first sequence's blocks: all but the first read of a key come from L2
        shared = (table[0:1] % (CONTEXT // 16)).expand(BATCH, -1).contiguous()
        for blocks, where in ((table, "own blocks (DRAM)"), (shared, "shared blocks (keys in L2)")):
            for causal in (True, False):
                us = time_graph(lambda: tqops.paged_attention(query, cache, blocks, seq_lens, query_start_loc, fmt,
                                                              causal=causal))
                report(f"tqops {name} q16 {'causal' if causal else 'non-causal'} {where}", us)
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    torch.manual_seed(0)
    print(f"copy bandwidth {copy_bandwidth() / 1e12:.2f} TB/s, {FLOP / 1e9:.1f} GFLOP per call", flush=True)
    sdpa_rows()
    tqops_rows()
