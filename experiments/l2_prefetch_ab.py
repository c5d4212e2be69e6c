"""A/B of paged_attention's L2 prefetch of the next tile's slots, on the e2e verify and decode shapes (H200).

Usage: ``REPS=3 python experiments/l2_prefetch_ab.py FORMATS 0,1 [8x16,8x1]``: comma-separated format names, prefetch
modes (0 off, 1 on) and ``<batch>x<q_len>`` shapes over 8K keys, 16 q / 8 kv heads, d 128. Prints the min / median
microseconds of REPS interleaved CUDA-graph timings per mode, after checking that every mode gives the same output.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from verify_case import verify_case  # noqa: E402

from tqops.attention import triton_paged as tp  # noqa: E402
from tqops.attention.bench_attention import time_graph  # noqa: E402
from tqops.formats import get_format  # noqa: E402


def main(formats: str, modes: str, shapes: str = "8x16,1x16,8x1") -> None:
    reps = int(os.environ.get("REPS", "3"))
    for name in formats.split(","):
        fmt = get_format(name)
        for batch, q_len in (tuple(map(int, s.split("x"))) for s in shapes.split(",")):
            cache, bt, q, qsl, seq = verify_case(name, batch, q_len=q_len)
            for causal in (True, False) if q_len > 1 else (True,):
                fns, times, ref = {}, {}, None
                for mode in map(int, modes.split(",")):
                    fns[mode] = (lambda on: lambda: tp.paged_attention_triton(
                        q, cache, bt, seq, qsl, fmt, causal, None, None, 128 ** -0.5, 1.0, 1.0,
                        prefetch_l2=on))(bool(mode))
                    out = fns[mode]()
                    ref = out if ref is None else ref
                    assert torch.equal(out, ref) and not out.isnan().any(), f"mode {mode} changed the output"
                    times[mode] = []
                for _ in range(reps):
                    for mode, fn in fns.items():
                        times[mode].append(time_graph(fn, rep_ms=50))
                cells = [f"pf{m} {min(t):.1f}/{sorted(t)[len(t) // 2]:.1f}" for m, t in times.items()]
                print(name, f"{batch}x8K q{q_len}", "causal" if causal else "noncausal", " | ".join(cells), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
