"""A small run of every kernel family for compute-sanitizer (needs CUDA):

    compute-sanitizer --tool memcheck --error-exitcode 1 python tools/sanitize_kernels.py

Store (general and row kernels), attention with one split and with several (plus the split combiner), at q_len 1
and 16, with out-of-range slots and block-table entries, which the kernels must skip without touching memory; and the
CUDA decode and verify backends through the raw op with int64 indices past int32 (a block entry 2**32 + 1, a seq_len
2**32 + 16), whose outputs must equal the CPU op's, which treats those as out of range."""
import torch

import tqops
from tqops.attention import cuda_paged, cuda_verify
from tqops.attention.triton_paged import paged_attention_triton
from tqops.kv import triton_store

FORMATS = ("fp8_e4m3", "turboquant_4bit_nc")  # the general store kernel; the row store kernel and MSE attention


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    num_blocks, block_size, kv_heads, q_heads, d = 40, 16, 2, 8, 128
    for name in FORMATS:
        fmt = tqops.get_format(name)
        cache = tqops.allocate_kv_cache(fmt, num_blocks, block_size, kv_heads, d, device=dev)
        n = num_blocks * block_size
        key = torch.randn(n, kv_heads, d, device=dev, generator=gen, dtype=torch.bfloat16)
        value = torch.randn(n, kv_heads, d, device=dev, generator=gen, dtype=torch.bfloat16)
        slots = torch.randperm(n, device=dev, generator=gen)
        slots[::7] = n + 5  # past the cache: skipped
        tqops.kv_store(key, value, cache, torch.arange(n, device=dev), fmt)
        triton_store.kv_store_triton(key, value, cache, slots, fmt, 1.0, 1.0)
        table = torch.randperm(num_blocks, device=dev, generator=gen)[:36].view(4, 9).int()
        table[1, 2] = -3
        table[2, 0] = num_blocks + 1  # out of range: those keys are dropped
        for q_len in (1, 16):
            seq_lens = torch.tensor([140, 60, 100, 9 * block_size + 7], device=dev, dtype=torch.int32)  # last: past the table
            qsl = torch.arange(0, 4 * q_len + 1, q_len, device=dev, dtype=torch.int32)
            query = torch.randn(4 * q_len, q_heads, d, device=dev, generator=gen, dtype=torch.bfloat16)
            for splits in (1, 4):
                for causal in (True, False):
                    out = paged_attention_triton(query, cache, table, seq_lens, qsl, fmt, causal, None, None,
                                                 d**-0.5, 1.0, 1.0, num_splits=splits)
                    assert out.isfinite().all(), (name, q_len, splits, causal)
        torch.cuda.synchronize()
        print(f"{name}: store, store-rows, attention (1 and 4 splits, q_len 1 and 16) ran")
    cuda_backends(dev, gen)


def cuda_backends(dev: torch.device, gen: torch.Generator) -> None:
    """The NVRTC decode (q_len 1) and verify (q_len 16) kernels on a table long enough to take them, with int64
    indices past int32, against the CPU op on the same inputs."""
    num_blocks, block_size, kv_heads, q_heads, d, batch = 40, 16, 8, 32, 128, 4
    fmt = tqops.get_format("turboquant_4bit_nc")
    cache = tqops.allocate_kv_cache(fmt, num_blocks, block_size, kv_heads, d, device=dev)
    n = num_blocks * block_size
    kv = [torch.randn(n, kv_heads, d, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(2)]
    tqops.kv_store(*kv, cache, torch.arange(n, device=dev), fmt)
    width = cuda_verify.MIN_TABLE_KEYS // block_size  # blocks per row: enough keys over the table for both kernels
    table = torch.randint(0, num_blocks, (batch, width), device=dev, generator=gen)
    table[1, 2] = 2**32 + 1  # past int32: out of range, its keys dropped (not block 1)
    seq_lens = torch.tensor([140, 2**32 + 16, 100, 9 * block_size + 7], device=dev)  # the second: the whole table
    for q_len, backend in ((1, cuda_paged), (16, cuda_verify)):
        query = torch.randn(batch * q_len, q_heads, d, device=dev, generator=gen, dtype=torch.bfloat16)
        qsl = torch.arange(0, batch * q_len + 1, q_len, device=dev)
        assert backend.applies(query, cache, table, fmt, None), backend.__name__
        args = (table, seq_lens, qsl, fmt.name, False, None, None, d**-0.5, 1.0, 1.0)
        out = torch.ops.tqops.paged_attention(query, cache, *args)
        torch.cuda.synchronize()
        ref = torch.ops.tqops.paged_attention(query.cpu(), cache.cpu(), *(a.cpu() if torch.is_tensor(a) else a
                                                                            for a in args))
        err = (out.float().cpu() - ref.float()).abs().max().item()
        assert err < 2e-2, (backend.__name__, err)
        print(f"{backend.__name__}: q_len {q_len}, int64 indices past int32: max |cuda - cpu| = {err:.2e}")


if __name__ == "__main__":
    main()
