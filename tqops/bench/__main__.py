"""Command line for the benchmarks: prints a Markdown table and writes JSON (and plots) under --out."""
from __future__ import annotations

import json
import os
import sys

import torch

from ..cli import Parser, folder_with_or_exit, out_dir_or_exit, subset_or_exit
from ..formats import FORMATS
from . import acceptance
from .attention import bench_attention, plot_attention
from .e2e import SHAPES, bench_e2e, plot_e2e
from .hf import bench_hf
from .hybrid import SHAPES as HYBRID_SHAPES, bench_hybrid
from .kernels import STEPS, bench_kernels
from .linear import bench_linear
from .programs import bench_programs
from .perplexity import TOKENS, WINDOWS, bench_perplexity, plot_perplexity
from .quality import attention_quality
from .store import bench_store, sweep_configs
from .table import markdown_table


def _store(args) -> list[dict]:
    configs = sweep_configs(args.head_dim) if args.sweep else None
    return bench_store(num_tokens=args.tokens, num_kv_heads=args.kv_heads, head_dim=args.head_dim, configs=configs)


def _attention(args) -> list[dict]:
    rows = bench_attention()
    if args.out:
        plot_attention(rows, os.path.join(args.out, "attention.png"))
    return rows


def _quality(args) -> list[dict]:
    if args.attention:
        rows = attention_quality(device="cuda" if torch.cuda.is_available() else "cpu")
        # Cosines close to 1 need more digits than the table's default 3 significant ones.
        return [{k: f"{v:.5f}" if isinstance(v, float) else v for k, v in row.items()} for row in rows]
    rows = bench_perplexity(args.model, args.formats, args.windows, args.tokens)
    if args.out:
        try:
            plot_perplexity(rows, os.path.join(args.out, "perplexity.png"), f"{args.model or 'the shipped target'}")
        except ImportError as e:  # matplotlib is the optional "plot" extra
            print(f"no plot: {e}", file=sys.stderr)
    return [{k: f"{v:.4f}" if isinstance(v, float) else v for k, v in row.items()} for row in rows]


def _add_quality_arguments(parser: Parser) -> None:
    parser.add_argument("--model", default=None,
                        help="a transformers checkpoint folder (default: the shipped target)")
    parser.add_argument("--formats", default=None, help="comma-separated cache formats (default: all)")
    parser.add_argument("--windows", type=int, default=WINDOWS, help="held-out windows")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens per window")
    parser.add_argument("--attention", action="store_true",
                        help="instead: paged attention's output per format against float64 attention on the "
                             "original K/V (cosines over structured keys and peaky queries)")


def _check_quality(parser: Parser, args) -> None:
    for flag in ("windows", "tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.model is not None:
        folder_with_or_exit(parser, "--model", args.model, "config.json")
    args.formats = subset_or_exit(parser, "--formats", args.formats, FORMATS) if args.formats else list(FORMATS)


def _e2e(args) -> list[dict]:
    if args.shape in HYBRID_SHAPES:
        return bench_hybrid(args.shape, transformers=not args.no_transformers)
    rows = bench_e2e(shape=args.shape)
    if args.out:
        try:
            plot_e2e(rows, os.path.join(args.out, "e2e.png"))
        except ImportError as e:  # matplotlib is the optional "plot" extra
            print(f"no plot: {e}", file=sys.stderr)
    return rows


def _linear(args) -> list[dict]:
    return bench_linear()


def _programs(args) -> list[dict]:
    return bench_programs(num_kv_heads=args.kv_heads, num_q_heads=4 * args.kv_heads)


def _hf(args) -> list[dict]:
    return bench_hf()


def _kernels(args) -> list[dict]:
    # the top kernels as one cell each, so the table stays one row per (format, batch); one layer's launch
    # sequence stays in the JSON
    return [dict(row, top="; ".join(f"{t['name']} x{t['launches']} {t['us']} us" for t in row["top"][:5]))
            for row in bench_kernels(shape=args.shape or "qwen3-0.6b", pdl=args.pdl, step=args.step)]


def _acceptance(args) -> list[dict]:
    rows = acceptance.run(args)
    if args.out:
        try:
            acceptance.plot_acceptance(rows, os.path.join(args.out, "acceptance.png"))
        except ImportError as e:  # matplotlib is the optional "plot" extra
            print(f"no plot: {e}", file=sys.stderr)
    return rows


def _positive(parser: Parser, args, *flags: str) -> None:
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")


def _check_store(parser: Parser, args) -> None:
    _positive(parser, args, "--tokens", "--kv-heads", "--head-dim")


def _check_programs(parser: Parser, args) -> None:
    from tqops.attention.cuda_paged import ALL_HEADS_KV_HEADS

    if args.kv_heads not in ALL_HEADS_KV_HEADS:
        parser.error(f"--kv-heads must be one of {ALL_HEADS_KV_HEADS} (the all-heads programs' head counts), "
                     f"got {args.kv_heads}")


BENCHES = {"store": _store, "attention": _attention, "quality": _quality, "e2e": _e2e, "acceptance": _acceptance,
           "hf": _hf, "kernels": _kernels, "linear": _linear, "programs": _programs}
CPU_OK = {"quality", "acceptance"}
# flag checks that run before any work (each subcommand's parser takes only the flags it uses)
CHECKS = {"acceptance": acceptance.check_arguments, "store": _check_store, "programs": _check_programs,
          "quality": _check_quality}


def _add_store_arguments(parser: Parser) -> None:
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per call")
    parser.add_argument("--kv-heads", type=int, default=8, help="kv heads")
    parser.add_argument("--head-dim", type=int, default=128, help="head_dim")
    parser.add_argument("--sweep", action="store_true", help="time every candidate launch config per format")


def _add_shape_argument(parser: Parser, hybrid: bool = True) -> None:
    shapes = SHAPES | HYBRID_SHAPES if hybrid else SHAPES
    parser.add_argument("--shape", choices=sorted(shapes), default=None,
                        help="the model shape (default qwen3-0.6b; e2e also reads TQOPS_E2E_SHAPE"
                             f"{'; qwen3.5-9b: the hybrid Qwen3.5 target' if hybrid else ''})")


def _add_e2e_arguments(parser: Parser) -> None:
    _add_shape_argument(parser)
    parser.add_argument("--no-transformers", action="store_true",
                        help="hybrid shapes: leave out the rows of transformers' own Qwen3.5 on its own cache")


def _add_programs_arguments(parser: Parser) -> None:
    parser.add_argument("--kv-heads", type=int, default=8,
                        help="kv heads (8: Qwen3; 4: a rank of it under 2-way tensor parallelism), 4 query heads each")


def _add_kernels_arguments(parser: Parser) -> None:
    _add_shape_argument(parser, hybrid=False)
    parser.add_argument("--pdl", action="store_true",
                        help="profile with programmatic dependent launch, as the library runs (each kernel's time "
                             "then also counts its early start); default off, so each time is the kernel's own")
    parser.add_argument("--step", choices=STEPS, default="decode",
                        help="the captured step to profile: the target's decode step (default), the verify step "
                             "(the target over a 16-token block) or the draft step (the drafter over a block)")


EXTRA_ARGUMENTS = {"store": _add_store_arguments, "e2e": _add_e2e_arguments, "kernels": _add_kernels_arguments,
                   "acceptance": acceptance.add_arguments, "programs": _add_programs_arguments,
                   "quality": _add_quality_arguments}


def make_parser() -> tuple[Parser, dict]:
    """The top-level parser and each subcommand's parser (by name); a subcommand takes only the flags it uses."""
    parser = Parser(prog="python -m tqops.bench", description=__doc__)
    which = parser.add_subparsers(dest="which", metavar="{" + ",".join(sorted(BENCHES)) + "}", required=True)
    subs = {}
    for name in sorted(BENCHES):
        sub = which.add_parser(name, help=("CPU or CUDA" if name in CPU_OK else "CUDA"))
        sub.add_argument("--out", default=None, help="folder for <which>.json/.md (and plots)")
        if name in EXTRA_ARGUMENTS:
            EXTRA_ARGUMENTS[name](sub)
        subs[name] = sub
    return parser, subs


def main(argv=None) -> int:
    parser, subs = make_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = parser.parse_known_args(argv)
    sub = subs[args.which]
    if unknown:
        sub.error(f"unrecognized arguments: {' '.join(unknown)} (not flags of {args.which}; see its --help)")
    if args.which in CHECKS:
        CHECKS[args.which](sub, args)
    if not torch.cuda.is_available() and args.which not in CPU_OK:
        sub.error("needs a CUDA device (the benchmarks time Triton kernels); only quality and acceptance run on CPU")
    if args.out is not None:
        out_dir_or_exit(sub, args.out)  # before the benchmark, which may write its plot there
    rows = BENCHES[args.which](args)
    table = markdown_table(rows)
    on_cpu = not torch.cuda.is_available() or str(getattr(args, "device", None) or "cuda").startswith("cpu")
    where = "CPU" if on_cpu else torch.cuda.get_device_name()
    header = f"`python -m tqops.bench {' '.join(argv)}` on {where}, torch {torch.__version__}"
    print(header + "\n\n" + table)
    if args.out:
        with open(os.path.join(args.out, f"{args.which}.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, f"{args.which}.md"), "w") as f:
            f.write(header + "\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
