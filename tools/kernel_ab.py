"""Same-machine A/B timing of the default attention and store kernels of two trees (needs CUDA).

Where a change alters the kernels' generated code (``tools/kernel_hashes.py``), time the old and the new tree in one
call, alternating, and compare the best of each:

    for i in 1 2 3; do
      PYTHONPATH=/path/to/old/tree python tools/kernel_ab.py > old_$i.json
      PYTHONPATH=$PWD python tools/kernel_ab.py > new_$i.json
    done
    python tools/kernel_ab.py --compare old_*.json --against new_*.json

Each run prints one JSON object: microseconds per CUDA-graph replay of paged attention (32 q / 8 kv heads,
head_dim 128, {8, 32} x 8K keys, q_len 1 causal and q_len 16 causal / non-causal) and of a 16K-token store, per
format.
"""
import argparse
import json
import sys


def time_kernels() -> dict:
    import torch

    import tqops
    from tqops.attention.triton_paged import paged_attention_triton
    from tqops.bench.attention import _fill_cache
    from tqops.bench.timing import time_graph
    from tqops.kv import triton_store

    times = {"tqops": tqops.__file__}
    for name in tqops.FORMATS:
        fmt = tqops.get_format(name)
        for batch, context in ((8, 8192), (32, 8192)):
            cache, table = _fill_cache(name, batch, context, 8, 128, 16)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            for q_len in (1, 16):
                query = torch.randn(batch * q_len, 32, 128, device="cuda", dtype=torch.bfloat16)
                qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda")
                for causal in (True, False) if q_len > 1 else (True,):
                    times[f"attention {name} {batch}x{context} q{q_len} {'causal' if causal else 'noncausal'}"] = \
                        time_graph(lambda: paged_attention_triton(query, cache, table, seq_lens, qsl, fmt, causal,
                                                                  None, None, 128**-0.5, 1.0, 1.0))
        n = 16384
        key = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16)
        value = torch.randn_like(key)
        cache = tqops.allocate_kv_cache(fmt, 2 * n // 16, 16, 8, 128, device="cuda")
        slots = torch.randperm(2 * n, device="cuda")[:n]
        times[f"store {name} 16K"] = time_graph(
            lambda: triton_store.kv_store_triton(key, value, cache, slots, fmt, 1.0, 1.0))
    return times


def compare(old_files, new_files) -> None:
    """Per timing: the best old and new microseconds and new / old."""
    old, new = ([json.load(open(f)) for f in files] for files in (old_files, new_files))
    for key in (k for k in old[0] if k != "tqops"):
        best_old = min(r[key] for r in old)
        best_new = min(r[key] for r in new if key in r)
        print(f"{key:50s} {best_old:9.1f} {best_new:9.1f}  {best_new / best_old:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", nargs="+", metavar="OLD_JSON")
    parser.add_argument("--against", nargs="+", metavar="NEW_JSON")
    args = parser.parse_args()
    if args.compare or args.against:
        if not (args.compare and args.against):
            parser.error("--compare and --against go together")
        compare(args.compare, args.against)
    else:
        print(json.dumps(time_kernels()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
