"""Compiles the kernels of a batch-1 decode layer's one-row path for sm_90, PDL launches included, on any machine
(no GPU): the GEMV with each prologue, the skinny GEMM and the kernels that feed it (PDL at 8 rows), the norm
kernels, the cache store (both store kernels, and the general one fused with the q/k norm and RoPE, at the two tokens
it starts from), the attention kernel and the split combiner. The interpreter runs none of their PDL code, so this is
what catches a kernel that would not compile on the GPU (tests/test_one_row_kernels_compile.py runs it). Prints one
line per kernel variant.

    python tools/compile_one_row_kernels.py
"""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU even where none is present
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import kernel_hashes as kh  # noqa: E402


def main() -> int:
    import tqops
    import tqops.pdl
    from tqops.attention import combine, triton_paged
    from tqops.kv import triton_store
    from tqops.linear import triton_gemv, triton_skinny
    from tqops.norm import triton_norm

    for module in (triton_gemv, triton_skinny, triton_norm, combine, triton_paged, triton_store,
                   *kh._shared_constants()):
        kh._patch_device_queries(module)
    tqops.pdl.pdl_enabled = lambda device: True  # as on a Hopper GPU
    torch.cuda.current_device = lambda: 0
    driver.set_active(kh._CompileOnlyDriver())
    JITFunction.run = kh._compile_only
    dt, hidden, ffn = torch.bfloat16, 1024, 3072
    x, w = torch.empty(1, hidden, dtype=dt), torch.empty(4096, hidden, dtype=dt)
    triton_gemv.gemv_triton(x, w, torch.empty(4096, dtype=dt))
    triton_gemv.gemv_triton(x, w, residual=x, norm_weight=torch.empty(hidden, dtype=dt), eps=1e-6,
                            prologue=triton_gemv.ADD_RMS_NORM)
    triton_gemv.gemv_triton(torch.empty(1, 2 * ffn, dtype=dt), torch.empty(hidden, ffn, dtype=dt),
                            prologue=triton_gemv.SILU_MUL)
    triton_gemv.silu_mul_triton(torch.empty(3, 2 * ffn, dtype=dt))
    triton_norm.add_rms_norm_triton(x, x, torch.empty(hidden, dtype=dt), 1e-6)
    # 8 rows against a large weight: the skinny GEMM and the kernels that feed it, with PDL
    rows = torch.empty(8, hidden, dtype=dt)
    triton_skinny.skinny_gemm_triton(rows, torch.empty(8192, hidden, dtype=dt))
    triton_gemv.silu_mul_triton(torch.empty(8, 2 * ffn, dtype=dt), pdl=True)
    triton_norm.add_rms_norm_triton(rows, rows, torch.empty(hidden, dtype=dt), 1e-6, pdl=True)
    triton_norm.qk_norm_rope_triton(torch.empty(1, 4096, dtype=dt), torch.empty(128, dtype=dt),
                                    torch.empty(128, dtype=dt), torch.zeros(1, dtype=torch.long), torch.empty(64),
                                    16, 8, 1e-6)
    combine.combine_splits(torch.empty(4, 1, 16, 128), torch.empty(4, 1, 16, 2), None,
                           torch.zeros(2, dtype=torch.int32), torch.empty(1, 16, 128, dtype=dt), 1)
    heads, kv_heads, head_dim, block_size, context = 16, 8, 128, 16, 8192
    for name in ("bf16", "turboquant_4bit_nc"):  # the plain store kernel and the rows kernel
        fmt = tqops.get_format(name)
        cache = torch.empty(context // block_size, block_size, kv_heads, fmt.slot_bytes(head_dim), dtype=torch.uint8)
        key = torch.empty(1, kv_heads, head_dim, dtype=dt)
        triton_store.kv_store_triton(key, key, cache, torch.zeros(1, dtype=torch.long), fmt, 1.0, 1.0)
        # the store fused with the q/k norm and RoPE, which runs from two tokens on (one launch, without PDL; for
        # turboquant_4bit_nc its MSE-key variant); one token runs the two kernels compiled above
        triton_store.qk_norm_rope_store_triton(torch.empty(2, (heads + 2 * kv_heads) * head_dim, dtype=dt),
                                               torch.empty(head_dim, dtype=dt), torch.empty(head_dim, dtype=dt),
                                               torch.zeros(2, dtype=torch.long), torch.empty(head_dim // 2),
                                               heads, kv_heads, 1e-6, cache, torch.arange(2), fmt, 1.0, 1.0)
        table = torch.arange(context // block_size, dtype=torch.int32).view(1, -1)
        triton_paged.paged_attention_triton(torch.empty(1, heads, head_dim, dtype=dt), cache, table,
                                            torch.full((1,), context, dtype=torch.int32),
                                            torch.arange(2, dtype=torch.int32), fmt, True, None, None,
                                            head_dim**-0.5, 1.0, 1.0)
    print("\n".join(kh._compiled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
