"""Variants of the sm_90 verify kernel against the library's, at q_len 16 (32 q / 8 kv heads, causal): each checked
against the torch reference on 16 ragged cases (where its header says check=1), then timed interleaved with the
library kernel in one process. On an sm_90 GPU, from the repository root:
python experiments/verify_ablations/ab.py experiments/verify_ablations/DIR [rounds]

A variant is a .cu file whose first line reads
// AB: smem=BYTES box=BYTES threads=N heads=H parts=P check=0|1
(dynamic shared memory, the TMA box's width, threads per program, kv heads per program, partials per program for the
split combiner, and whether its results are meant to be right)."""
import ctypes
import os
import re
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

LIBRARY = Path(cuda_verify.__file__).parent / "cuda" / "turboquant_verify.cu"
HEADER = r"// AB: smem=(\d+) box=(\d+) threads=(\d+) heads=(\d+) parts=(\d+) check=([01])(?: layout=(hnd|soa))?(?: per_sm=(\d))?"
fmt = get_format("turboquant_4bit_nc")
_built = {}
_hnd = {}


def variants(directory: Path) -> dict:
    """name -> (source, shared memory, box bytes, threads, heads, parts, check); the library kernel first."""
    found = {"library": (LIBRARY, cuda_verify.SMEM_BYTES, cuda_verify.STAGE_ROW, 128, 1, 1, True, None, 2)}
    for path in sorted(directory.glob("*.cu")):
        m = re.match(HEADER, path.read_text())
        smem, box, threads, heads, parts = (int(x) for x in m.groups()[:5])
        found[path.stem] = (path, smem, box, threads, heads, parts, m.group(6) == "1", m.group(7), int(m.group(8) or 2))
    return found


def map_16bit(cache: torch.Tensor, box_bytes: int, box_slots: int) -> cuda_paged.ByValue:
    """The cache as [blocks][slots][slot / 2] uint16, for boxes wider than a uint8 map's 256 elements."""
    num_blocks, block_size = cache.shape[:2]
    stride = cache.stride()
    buffer, address = cuda_paged._aligned_map_buffer()
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    libcuda = torch.cuda._utils._get_gpu_runtime_library()
    torch.cuda._utils._check_cuda(libcuda.cuTensorMapEncodeTiled(
        ctypes.c_void_p(address), 1, 3, ctypes.c_void_p(cache.data_ptr()),
        (u64 * 3)(stride[1] // 2, block_size, num_blocks), (u64 * 2)(stride[1], stride[0]),
        (u32 * 3)(box_bytes // 2, box_slots, 1), (u32 * 3)(1, 1, 1), 0, 0, 2, 0))
    return cuda_paged.ByValue(address, 128, buffer)


def relayout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """hnd: [blocks][heads][slots][row]. soa: per (block, head) segment of n slots, key codes [n][64], norms [n][2],
    value codes as u16 columns [32][n][2], scales and zero points [n][4]."""
    num_blocks, bs, heads, row = cache.shape
    hnd = cache.permute(0, 2, 1, 3).contiguous()  # [blocks][heads][slots][row]
    if layout == "soa":
        values = hnd[..., 66:130].reshape(num_blocks, heads, bs, 32, 2).transpose(2, 3)
        hnd = torch.cat([hnd[..., :64].flatten(2), hnd[..., 64:66].flatten(2), values.flatten(2),
                         hnd[..., 130:].flatten(2)], dim=2)
    return hnd.view(-1).as_strided((num_blocks, bs, heads, row), (heads * bs * row, row, bs * row, 1))


def call(variant, query, cache, bt, seq, qsl, causal, sinks, splits=None):
    path, smem, box, threads, heads, parts, _, hnd, per_sm = variant
    key = (path, query.dtype == torch.bfloat16)
    if key not in _built:
        _built[key] = cuda_paged.build_kernel(path, f"turboquant_verify<{'true' if key[1] else 'false'}>", smem,
                                              torch.cuda.current_device(), compute_capability="90a")
    num_tokens, num_q_heads, _ = query.shape
    _, block_size, num_kv_heads, _ = cache.shape
    batch, max_blocks = bt.shape
    bt, seq, qsl = (t.to(torch.int32) for t in (bt, seq, qsl))
    block_q, tiles, auto = cuda_verify.launch_shape(num_tokens, batch, num_q_heads // num_kv_heads, num_kv_heads,
                                                    max_blocks * block_size, _sm_count(query.device.index or 0))
    sms = _sm_count(query.device.index or 0)
    # programs per SM other than the launch rule's 2: the splits that fill one wave of them
    splits = splits or int(os.environ.get("AB_SPLITS", 0))
    if not splits and per_sm != 2:  # the most power-of-two splits (the combiner's) within one wave of them
        splits = 1 << max(0, (per_sm * sms // (tiles * num_kv_heads // heads)).bit_length() - 1)
    splits = splits or auto
    tensor_map = map_16bit if box > 256 else cuda_paged.tensor_map
    if hnd:  # the same cache held head-major, viewed as [blocks][slots][heads][row] (strides of a head-major one)
        key_hnd = (cache.data_ptr(), cache.shape, hnd)
        if key_hnd not in _hnd:
            _hnd[key_hnd] = (cache, relayout(cache, hnd))
        cache = _hnd[key_hnd][1]
        tensor_map = lambda *_: cuda_paged.NO_TENSOR_MAP
    return cuda_paged.launch_split_kv(_built[key], (tiles, num_kv_heads // heads, splits), threads, smem, query,
                                      cache, bt, seq, qsl, _rotation_signs(128, query.device),
                                      _centroid_pairs(4, query.device), 128**-0.5 * 1.4426950408889634, block_q,
                                      splits * parts, causal, sinks,
                                      (tensor_map(cache, box, min(block_size, 64)),))


def check(found: dict) -> None:
    gen = torch.Generator().manual_seed(1)
    cases = []
    for k in range(16):
        batch = 1 + k % 3
        q_lens = [int(x) for x in torch.randint(1, 40, (batch,), generator=gen)]
        ctx = [int(x) for x in torch.randint(0, 1500, (batch,), generator=gen)]
        cases.append((make_case("turboquant_4bit_nc", q_lens=q_lens, seq_lens=[q + c for q, c in zip(q_lens, ctx)],
                                num_kv_heads=8, group=(4, 2, 3, 8)[k % 4], head_dim=128,
                                block_size=(8, 16, 32, 64, 128)[k % 5], causal=k % 2 == 0, with_sinks=k % 3 == 0,
                                dtype=(torch.bfloat16, torch.float16)[k % 5 == 4], seed=k,
                                pad_entry=(0, -1, 10**6)[k % 3], device="cuda"), (None, 1, 2, 4, 8)[k % 5]))
    for name, variant in found.items():
        if not variant[6]:
            continue
        worst = 0.0
        for case, splits in cases:
            if variant[7] == "soa" and case.cache.shape[1] > 64:
                continue  # the soa variant stages whole segments only
            out = call(variant, case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc,
                       case.causal, case.sinks, splits).float()
            ref = paged_attention_naive(case.query, case.cache, case.block_table, case.seq_lens,
                                        case.query_start_loc, fmt, case.causal, None, case.sinks, 128**-0.5, 1.0,
                                        1.0).float()
            err = float((out - ref).norm() / ref.norm().clamp_min(1e-6))
            worst = max(worst, err if not torch.isnan(out).any() else float("inf"))
        print(f"{name}: worst relative error {worst:.2e} ({'ok' if worst < 1.5e-2 else 'FAIL'})", flush=True)


def bench(found: dict, rounds: int) -> None:
    shapes = os.environ.get("AB_SHAPES", "32x8192,8x32768,4x16384")  # e.g. 99x4096: 3 waves of 2/SM, 2 of 3/SM
    for batch, ctx in (tuple(int(x) for x in shape.split("x")) for shape in shapes.split(",")):
        cache, bt = _fill_cache(fmt.name, batch, ctx, 8, 128, 16)
        seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        qsl = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * 16
        query = torch.randn(batch * 16, 32, 128, device="cuda", dtype=torch.bfloat16)
        times = {name: [] for name in found}
        for _ in range(rounds):
            for name, variant in found.items():
                times[name].append(time_graph(lambda: call(variant, query, cache, bt, seq, qsl, True, None)))
        print(f"{batch} x {ctx}, us: " + "; ".join(f"{n} {' '.join(f'{t:.1f}' for t in ts)}"
                                                   for n, ts in times.items()), flush=True)


if __name__ == "__main__":
    found = variants(Path(sys.argv[1]).resolve())
    check(found)
    bench(found, int(sys.argv[2]) if len(sys.argv) > 2 else 3)
