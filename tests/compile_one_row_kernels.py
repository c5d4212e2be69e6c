"""Compiles the kernels of a batch-1 decode layer's one-row path for sm_90, PDL launches included, on any machine
(no GPU): the GEMV with each prologue, the norm kernels and the split combiner. The interpreter runs none of their
PDL code, so this is what catches a kernel that would not compile on the GPU. Prints one line per kernel variant.

    python tests/compile_one_row_kernels.py
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
    from tqops.attention import combine
    from tqops.linear import triton_gemv
    from tqops.norm import triton_norm

    for module in (triton_gemv, triton_norm, combine):
        kh._patch_device_queries(module)
        module.pdl_enabled = lambda device: True  # as on a Hopper GPU
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
    triton_norm.qk_norm_rope_triton(torch.empty(1, 4096, dtype=dt), torch.empty(128, dtype=dt),
                                    torch.empty(128, dtype=dt), torch.zeros(1, dtype=torch.long), torch.empty(64),
                                    16, 8, 1e-6)
    combine.combine_splits(torch.empty(4, 1, 16, 128), torch.empty(4, 1, 16, 2), None,
                           torch.zeros(2, dtype=torch.int32), torch.empty(1, 16, 128, dtype=dt), 1)
    print("\n".join(kh._compiled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
