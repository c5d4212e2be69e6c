"""The one-row decode kernels compile for sm_90 with their PDL code (tools/compile_one_row_kernels.py, in a
subprocess: the compile-only driver replaces Triton's globally)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_one_row_kernels_compile_for_sm90():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "tools", "compile_one_row_kernels.py")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    names = [line.split()[0] for line in run.stdout.splitlines() if line.strip()]
    assert names.count("_gemv_kernel") == 3 and "_skinny_kernel" in names
    assert names.count("_silu_mul_kernel") == 2 and names.count("_add_rms_norm_kernel") == 2  # without and with PDL
    assert {"_add_rms_norm_kernel", "_qk_norm_rope_kernel", "_combine_splits_kernel", "_kv_store_kernel",
            "_kv_store_rows_kernel"} <= set(names)
    assert names.count("_paged_attention_kernel") == 2
    # plain, and fused with qk_norm_rope (qk_norm_rope_store) for bf16 and for turboquant_4bit_nc's MSE keys
    assert names.count("_kv_store_kernel") == 3
    stores = {line for line in run.stdout.splitlines() if line.startswith("_kv_store_kernel ")}
    assert len(stores) == 3  # three different binaries, not one compiled twice
