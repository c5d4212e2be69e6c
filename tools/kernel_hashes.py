"""sm_90 cubin hashes of the default store and attention kernels, compiled ahead of time on any machine (no GPU).

A refactor that only moves code must leave every hash unchanged: run this on the old and the new tree with the same
Triton and compare (``diff``):

    python tools/kernel_hashes.py > hashes.txt
"""
import hashlib
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU even where none is present
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # line tables would change with every moved comment

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

SM_COUNT = 132  # an H100 SXM; launch rules read it


class _CompileOnlyDriver:
    """Just enough of a Triton driver for compilation: kernels are built for sm_90 and never launched."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 64)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


_compiled: list[str] = []
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    _compiled.append(f"{self.fn.__name__} {hashlib.sha256(kernel.asm['cubin']).hexdigest()[:16]}")
    return kernel


def _patch_device_queries(module) -> None:
    """The host wrappers ask CUDA for the SM count and treat CPU tensors as interpreted: answer as an H100 would."""
    for name in dir(module):
        obj = getattr(module, name)
        if name in ("_num_sms", "_sm_count", "sm_count") and callable(obj):
            setattr(module, name, lambda *a, **k: SM_COUNT)
        elif name in ("_interpreting", "_interpreted") and callable(obj):
            setattr(module, name, lambda *a, **k: False)


def _shared_constants() -> tuple:
    """The module the attention backends read the SM count from (tqops.attention.constants), where the tree has one
    (an older tree's backends each ask CUDA themselves)."""
    try:
        from tqops.attention import constants
    except ImportError:
        return ()
    return (constants,)


def attention_cases():
    """(label, kwargs for paged_attention_triton) over the shapes the benchmarks and the e2e step use."""
    for batch, context, q_len in ((8, 8192, 1), (32, 8192, 1), (8, 8192, 16), (32, 8192, 16), (1, 8192, 16),
                                  (2, 4096, 512)):
        for causal, window, sinks in ((True, None, False), (False, None, False), (True, 512, True)):
            yield (f"{batch}x{context} q{q_len} {'causal' if causal else 'noncausal'}"
                   f"{' window+sinks' if window else ''}", batch, context, q_len, causal, window, sinks)


def main() -> int:
    import tqops
    from tqops.attention import triton_paged

    print(f"tqops from {os.path.dirname(tqops.__file__)}", file=sys.stderr)
    from tqops.kv import triton_store

    for module in (triton_paged, triton_store, *_shared_constants()):
        _patch_device_queries(module)
    torch.cuda.current_device = lambda: 0
    driver.set_active(_CompileOnlyDriver())
    JITFunction.run = _compile_only
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    for name in tqops.FORMATS:
        fmt = tqops.get_format(name)
        for dtype in (torch.bfloat16, torch.float32):
            n = 16384
            key = torch.empty(n, kv_heads, head_dim, dtype=dtype)
            cache = torch.empty(n // block_size, block_size, kv_heads, fmt.slot_bytes(head_dim), dtype=torch.uint8)
            triton_store.kv_store_triton(key, key, cache, torch.arange(n), fmt, 1.0, 1.0)
            print(f"store {name} {str(dtype)[6:]}: {' '.join(_compiled)}")
            _compiled.clear()
        for label, batch, context, q_len, causal, window, sinks in attention_cases():
            blocks = batch * context // block_size
            cache = torch.empty(blocks, block_size, kv_heads, fmt.slot_bytes(head_dim), dtype=torch.uint8)
            table = torch.arange(blocks, dtype=torch.int32).view(batch, -1)
            query = torch.empty(batch * q_len, heads, head_dim, dtype=torch.bfloat16)
            seq_lens = torch.full((batch,), context, dtype=torch.int32)
            qsl = torch.arange(batch + 1, dtype=torch.int32) * q_len
            triton_paged.paged_attention_triton(query, cache, table, seq_lens, qsl, fmt, causal, window,
                                                torch.zeros(heads) if sinks else None, head_dim**-0.5, 1.0, 1.0)
            print(f"attention {name} {label}: {' '.join(_compiled)}")
            _compiled.clear()
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
