"""Instruction classes of the paged-attention kernel's key loop, from sm_90 SASS compiled on any machine (no GPU).

For each format: the default launch config at the given shape, then the kernel's two key loops in code order (the
unmasked loop over whole tiles, then the masked one), each with its instructions per warp and iteration and its most
frequent opcodes. docs/tuning.md ("Where a decode tile's instructions go") was made with it:

    python tools/sass_loop_profile.py turboquant_4bit_nc,bf16 --heads 32 --batch 8 --context 32768 --q-len 1
"""
import argparse
import collections
import os
import re
import subprocess
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU even where none is present
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import kernel_hashes as kh  # noqa: E402

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def loops(sass: str, min_size: int = 100) -> list[tuple[int, list[str]]]:
    """``(size, instructions)`` of every loop of at least ``min_size`` instructions in ``sass`` (nvdisasm -c text),
    in code order."""
    ins, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1).strip())
    found = []
    for i, text in enumerate(ins):
        branch = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if branch and labels.get(branch.group(1), len(ins)) <= i:
            body = ins[labels[branch.group(1)]:i + 1]
            if len(body) >= min_size:
                found.append((labels[branch.group(1)], len(body), body))
    return [(size, body) for _, size, body in sorted(found, key=lambda f: f[0])]


def opcodes(body: list[str]) -> collections.Counter:
    ops = collections.Counter()
    for text in body:
        words = text.split()
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        ops[op.split(".")[0]] += 1
    return ops


def main() -> int:
    import tqops
    from tqops.attention import triton_paged
    from tqops.attention.launch import launch_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("formats", help="comma-separated cache formats")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--block-n", type=int, default=None, help="override the key tile")
    parser.add_argument("--num-warps", type=int, default=None, help="override the warps")
    args = parser.parse_args()

    for module in (triton_paged, *kh._shared_constants()):
        kh._patch_device_queries(module)
    torch.cuda.current_device = lambda: 0
    driver.set_active(kh._CompileOnlyDriver())
    built = []
    run = JITFunction.run
    JITFunction.run = lambda self, *a, grid, warmup, **k: built.append(
        (self.fn.__name__, run(self, *a, grid=grid, warmup=True, **k))) or built[-1][1]
    head_dim, block_size = 128, 16
    overrides = {k: v for k, v in (("block_n", args.block_n), ("num_warps", args.num_warps)) if v is not None}
    for name in args.formats.split(","):
        fmt = tqops.get_format(name)
        blocks = args.batch * args.context // block_size
        cache = torch.empty(blocks, block_size, args.kv_heads, fmt.slot_bytes(head_dim), dtype=torch.uint8)
        table = torch.arange(blocks, dtype=torch.int32).view(args.batch, -1)
        query = torch.empty(args.batch * args.q_len, args.heads, head_dim, dtype=torch.bfloat16)
        built.clear()
        triton_paged.paged_attention_triton(
            query, cache, table, torch.full((args.batch,), args.context, dtype=torch.int32),
            torch.arange(args.batch + 1, dtype=torch.int32) * args.q_len, fmt, True, None, None, head_dim**-0.5,
            1.0, 1.0, **overrides)
        cfg = dict(launch_config(args.batch * args.q_len, args.batch, args.heads, args.kv_heads, head_dim,
                                 block_size, table.shape[1], kh.SM_COUNT, fmt, None), **overrides)
        kernel = next(k for n, k in built if n == "_paged_attention_kernel")
        path = f"/tmp/{name}.cubin"
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([NVDISASM, "-c", path], capture_output=True, text=True, check=True).stdout
        found = loops(sass)
        elements = cfg["block_n"] * head_dim * 2
        print(f"{name}: rows {cfg['block_m']}, keys {cfg['block_n']}, warps {cfg['num_warps']}, splits "
              f"{cfg['num_splits']}, keys_as_m {cfg['keys_as_m']}")
        for kind, (size, body) in zip(("unmasked", "masked"), found):
            per_element = size * cfg["num_warps"] * 32 / elements
            top = ", ".join(f"{op} {n}" for op, n in opcodes(body).most_common(12))
            print(f"  {kind} loop, {size} ({per_element:.1f} thread instructions per K/V element): {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
