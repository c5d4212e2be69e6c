"""paged_attention alone at the e2e verify (q_len 16) and decode (q_len 1) shapes, 8 x 8K keys, 16 q / 8 kv heads.

Usage: ``python experiments/time_verify_shapes.py FORMATS [REPS]`` (H200): comma-separated format names; prints the
min / median microseconds of REPS CUDA-graph timings (L2 flushed) per shape, with the launch the library picks.
Session 18 compared commits with it (NOTES.md).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from verify_case import verify_case  # noqa: E402

from tqops.attention import triton_paged as tp  # noqa: E402
from tqops.attention.bench_attention import time_graph  # noqa: E402
from tqops.formats import get_format  # noqa: E402


def main(formats: str, reps: str = "5") -> None:
    for name in formats.split(","):
        fmt = get_format(name)
        for batch, q_len in ((8, 16), (8, 1)):
            cache, bt, q, qsl, seq = verify_case(name, batch, q_len=q_len)
            fn = lambda: tp.paged_attention_triton(q, cache, bt, seq, qsl, fmt, True, None, None,  # noqa: E731
                                                   128 ** -0.5, 1.0, 1.0)
            assert not fn().isnan().any(), "the kernel read past a sequence"
            t = sorted(time_graph(fn, rep_ms=50) for _ in range(int(reps)))
            print(name, f"{batch}x8K q{q_len} causal", f"min {t[0]:.1f} med {t[len(t) // 2]:.1f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
