"""Command line for the benchmarks: prints a Markdown table and writes JSON (and plots) under --out."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .attention import bench_attention, plot_attention
from .e2e import bench_e2e, plot_e2e
from .quality import attention_quality
from .store import bench_store
from .table import markdown_table


def _store(args) -> list[dict]:
    return bench_store(num_tokens=args.tokens, num_kv_heads=args.kv_heads, head_dim=args.head_dim)


def _attention(args) -> list[dict]:
    rows = bench_attention()
    if args.out:
        plot_attention(rows, os.path.join(args.out, "attention.png"))
    return rows


def _quality(args) -> list[dict]:
    rows = attention_quality(device="cuda" if torch.cuda.is_available() else "cpu")
    # Cosines close to 1 need more digits than the table's default 3 significant ones.
    return [{k: f"{v:.5f}" if isinstance(v, float) else v for k, v in row.items()} for row in rows]


def _e2e(args) -> list[dict]:
    rows = bench_e2e()
    if args.out:
        try:
            plot_e2e(rows, os.path.join(args.out, "e2e.png"))
        except ImportError as e:  # matplotlib is the optional "plot" extra
            print(f"no plot: {e}", file=sys.stderr)
    return rows


BENCHES = {"store": _store, "attention": _attention, "quality": _quality, "e2e": _e2e}
CPU_OK = {"quality"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tqops.bench", description=__doc__)
    parser.add_argument("which", choices=sorted(BENCHES))
    parser.add_argument("--out", default=None, help="folder for <which>.json/.md (and plots)")
    parser.add_argument("--tokens", type=int, default=16384, help="store: tokens per call")
    parser.add_argument("--kv-heads", type=int, default=8, help="store: kv heads")
    parser.add_argument("--head-dim", type=int, default=128, help="store: head_dim")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and args.which not in CPU_OK:
        print("the benchmarks time Triton kernels and need a CUDA device", file=sys.stderr)
        return 2
    rows = BENCHES[args.which](args)
    table = markdown_table(rows)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    header = f"`python -m tqops.bench {args.which}` on {where}, torch {torch.__version__}"
    print(header + "\n\n" + table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.which}.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, f"{args.which}.md"), "w") as f:
            f.write(header + "\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
