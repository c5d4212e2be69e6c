"""Train a small Qwen3 target and its DFlash drafter on the Python standard library (stages: see --help of each)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

from .. import FORMATS
from ..cli import Parser, device_or_exit, folder_with_or_exit, load_or_exit, out_dir_or_exit, out_file_or_exit
from ..models.checkpoints import checkpoint_config_or_exit, drafter_config_or_exit
from . import corpus
from .loop import LoopConfig, RunOptions

ATTENTION_HEAD_DIMS = (64, 128, 256)  # what tqops' paged attention takes


def _positive(parser: Parser, args, *flags: str) -> None:
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"{flag} must be a positive number, got {value}")


def _tokenizer_or_exit(parser: Parser, flag: str, path: str, files=("tokenizer.json",)):
    """The ``tokenizers`` object of the folder ``path`` (which must also hold ``files``), with the special tokens the
    stages use; else a command-line error naming ``flag``."""
    for file in files:
        folder_with_or_exit(parser, flag, path, file)
    from .tokenizer import SPECIAL_TOKENS, load_tokenizer

    tok = load_or_exit(parser, flag, path, load_tokenizer, errors=(Exception,), what="unreadable tokenizer.json")
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        parser.error(f"{flag} {path!r}: tokenizer.json lacks the special tokens {missing} (train one with "
                     f"python -m tqops.train tokenizer)")
    return tok


TARGET = "a target checkpoint (python -m tqops.train target)"


def _layer_ids(parser: Parser, text: str) -> tuple:
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        parser.error(f"--target-layer-ids must be comma-separated layer indices, got {text!r}")
    if not ids or min(ids) < 0:
        parser.error(f"--target-layer-ids must be non-negative layer indices, got {text!r}")
    return ids


def _add_loop_flags(p: argparse.ArgumentParser, lr: float, max_epochs=None) -> None:
    length = p.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=None,
                        help="wall-clock budget of the training loop (compilation and evaluations included); "
                             "the step count is planned from it (default 8)")
    length.add_argument("--steps", type=int, default=None, help="a fixed number of steps instead of --minutes")
    p.add_argument("--max-epochs", type=float, default=max_epochs,
                   help=f"plan no more steps than this many epochs (default {max_epochs})")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (AdamW, warmup then cosine)")
    p.add_argument("--warmup", type=int, default=100, help="warmup steps (at most a tenth of the run)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--evals", type=int, default=30, help="evaluations over the run")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per packed sequence")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the training step (default: on CUDA only; falls back to eager on failure)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-files", type=int, default=None, help="use only the first N train files (smoke runs)")
    p.add_argument("--eval-files", type=int, default=None, help="use only the first N validation / held-out files")


def _check_run_flags(parser: Parser, args) -> RunOptions:
    _positive(parser, args, "--minutes", "--steps", "--max-epochs", "--lr", "--evals", "--batch-size", "--seq-len",
              "--train-files", "--eval-files")
    if args.warmup < 0 or not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        parser.error(f"--warmup and --weight-decay must be >= 0, got {args.warmup} and {args.weight_decay}")
    device = device_or_exit(parser, args.device)
    compile_step = device.type == "cuda" if args.compile is None else args.compile
    minutes = args.minutes if args.minutes is not None or args.steps is not None else 8.0
    loop = LoopConfig(lr=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup, steps=args.steps,
                      minutes=minutes, max_epochs=args.max_epochs, evals=args.evals, compile=compile_step)
    return RunOptions(loop, seq_len=args.seq_len, batch_size=args.batch_size, device=args.device, seed=args.seed,
                      train_files=args.train_files, eval_files=args.eval_files)


def _heldout(parser: Parser, args) -> dict:
    out_file_or_exit(parser, args.out)
    files = corpus.write_heldout(Path(args.out))
    return {"file": args.out, "files": len(files), "bytes": os.path.getsize(args.out)}


def _tokenizer(parser: Parser, args) -> dict:
    if args.vocab_size < 512:
        parser.error(f"--vocab-size must be >= 512 (256 byte tokens, specials and merges), got {args.vocab_size}")
    out_dir_or_exit(parser, args.out)
    from .tokenizer import chars_per_token, save_tokenizer, train_tokenizer

    tok = train_tokenizer([f.text for f in corpus.iter_sources("train")], args.vocab_size)
    files = save_tokenizer(tok, args.out)
    return {"folder": args.out, "vocab_size": tok.get_vocab_size(),
            "heldout_chars_per_token": round(chars_per_token(tok, (f.text for f in corpus.read_heldout())), 3),
            "bytes": {f.name: f.stat().st_size for f in files}}


def _target(parser: Parser, args) -> dict:
    run = _check_run_flags(parser, args)
    _positive(parser, args, "--hidden-size", "--layers", "--heads", "--kv-heads", "--intermediate-size")
    if args.head_dim not in ATTENTION_HEAD_DIMS:
        parser.error(f"--head-dim must be one of {ATTENTION_HEAD_DIMS} (tqops' paged attention), got {args.head_dim}")
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    from .tokenizer import FILES as TOKENIZER_FILES

    _tokenizer_or_exit(parser, "--tokenizer", args.tokenizer, TOKENIZER_FILES)
    tokenizer = Path(args.tokenizer)
    out_dir_or_exit(parser, args.out)
    from .target import TargetOptions, TargetShape, train_target

    shape = TargetShape(hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                        intermediate_size=args.intermediate_size, max_position_embeddings=max(2048, args.seq_len))
    return train_target(TargetOptions(
        out=Path(args.out), tokenizer=tokenizer, shape=shape, run=run, dropout=args.dropout))


# --arch dflash2's flags: (flag, DFlash2Settings field or None for the loss weight)
DFLASH2_FLAGS = (("--conv-kernel-size", "conv_kernel_size"), ("--conv-group-size", "conv_group_size"),
                 ("--selector-rank", "selector_rank"), ("--selector-top-k", "selector_top_k"),
                 ("--selector-loss-weight", None))


def _dflash2_settings(parser: Parser, args, target_config):
    """``--arch dflash2``'s settings (each flag left out takes ``DFlash2Settings``' default), checked against the
    target of ``target_config``; None for ``--arch dflash``, where giving any of them is an error."""
    given = [flag for flag, _ in DFLASH2_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None]
    if args.arch != "dflash2":
        if given:
            parser.error(f"{given[0]} applies to --arch dflash2 only (got --arch {args.arch})")
        return None
    from .dflash2 import DFlash2Settings

    _positive(parser, args, *(flag for flag, field in DFLASH2_FLAGS if field))
    settings = DFlash2Settings(**{field: getattr(args, field) for _, field in DFLASH2_FLAGS
                                  if field and getattr(args, field) is not None})
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    if hidden % settings.conv_group_size:
        parser.error(f"--conv-group-size must divide the target's hidden size ({hidden}), got "
                     f"{settings.conv_group_size}")
    if settings.selector_top_k > vocab:
        parser.error(f"--selector-top-k must be at most the target's vocabulary ({vocab}), got "
                     f"{settings.selector_top_k}")
    weight = args.selector_loss_weight
    if weight is not None and not (math.isfinite(weight) and weight >= 0):
        parser.error(f"--selector-loss-weight must be >= 0, got {weight}")
    return settings


def _drafter(parser: Parser, args) -> dict:
    run = _check_run_flags(parser, args)
    _positive(parser, args, "--layers", "--block-size", "--blocks-per-sequence", "--accept-new-tokens")
    if args.intermediate_size is not None:
        _positive(parser, args, "--intermediate-size")
    target = Path(args.target)
    _, target_config = checkpoint_config_or_exit(parser, "--target", args.target, TARGET)
    target_layers = target_config.num_hidden_layers
    _tokenizer_or_exit(parser, "--target", args.target)
    layer_ids = _layer_ids(parser, args.target_layer_ids) if args.target_layer_ids is not None else None
    if layer_ids and max(layer_ids) >= target_layers:
        parser.error(f"--target-layer-ids {args.target_layer_ids}: the target has {target_layers} layers")
    if args.block_size < 2:
        parser.error(f"--block-size must be >= 2, got {args.block_size}")
    if args.blocks_per_sequence > args.seq_len - args.block_size:
        parser.error(f"--blocks-per-sequence {args.blocks_per_sequence} does not fit distinct anchors in "
                     f"--seq-len {args.seq_len} with --block-size {args.block_size}")
    _positive(parser, args, "--greedy-sequences", "--greedy-minutes", "--greedy-batch-size", "--greedy-new-tokens",
              "--greedy-eval-sequences")
    if args.data == "greedy" and not args.block_size <= args.greedy_new_tokens < args.seq_len:
        parser.error(f"--greedy-new-tokens must be in [--block-size, --seq-len) = [{args.block_size}, "
                     f"{args.seq_len}), got {args.greedy_new_tokens}")
    if args.data == "greedy" and args.blocks_per_sequence > args.greedy_new_tokens - args.block_size + 1:
        parser.error(f"--blocks-per-sequence {args.blocks_per_sequence} does not fit distinct anchors in "
                     f"--greedy-new-tokens {args.greedy_new_tokens} with --block-size {args.block_size}")
    if not (math.isfinite(args.loss_decay) and args.loss_decay >= 0) or args.accept_prompts < 0:
        parser.error(f"--loss-decay and --accept-prompts must be >= 0, got {args.loss_decay} and "
                     f"{args.accept_prompts}")
    dflash2 = _dflash2_settings(parser, args, target_config)
    out_dir_or_exit(parser, args.out)
    from .dflash2 import SELECTOR_LOSS_WEIGHT
    from .drafter import DrafterOptions, train_drafter

    return train_drafter(DrafterOptions(
        target=target, out=Path(args.out), num_layers=args.layers, intermediate_size=args.intermediate_size,
        target_layer_ids=layer_ids, arch=args.arch,
        dflash2=dflash2, selector_loss_weight=(SELECTOR_LOSS_WEIGHT if args.selector_loss_weight is None
                                             else args.selector_loss_weight),
        block_size=args.block_size, blocks_per_sequence=args.blocks_per_sequence, loss_decay=args.loss_decay,
        run=run, data=args.data, greedy_sequences=args.greedy_sequences, greedy_minutes=args.greedy_minutes,
        greedy_batch_size=args.greedy_batch_size, greedy_new_tokens=args.greedy_new_tokens,
        greedy_eval_sequences=args.greedy_eval_sequences, accept_prompts=args.accept_prompts,
        accept_new_tokens=args.accept_new_tokens))


def _accept(parser: Parser, args) -> dict:
    _positive(parser, args, "--prompts", "--prompt-tokens", "--new-tokens")
    raw, target_config = checkpoint_config_or_exit(parser, "--target", args.target, TARGET)
    tok = _tokenizer_or_exit(parser, "--target", args.target)
    drafter_config_or_exit(parser, "--drafter", args.drafter, target_config)
    target, drafter = Path(args.target), Path(args.drafter)
    device = device_or_exit(parser, args.device)
    positions = raw.get("max_position_embeddings")
    if isinstance(positions, int) and args.prompt_tokens + args.new_tokens > positions:
        parser.error(f"--prompt-tokens {args.prompt_tokens} plus --new-tokens {args.new_tokens} exceed the target's "
                     f"max_position_embeddings ({positions})")
    from .heldout import heldout_windows

    if not heldout_windows(tok, 1, args.prompt_tokens, args.new_tokens):
        parser.error(f"--prompt-tokens {args.prompt_tokens} plus --new-tokens {args.new_tokens}: no held-out text is "
                     f"that long; use fewer tokens")
    from .accept import measure_acceptance

    return measure_acceptance(target, drafter, prompts=args.prompts, prompt_tokens=args.prompt_tokens,
                              new_tokens=args.new_tokens, device=device, cache_format=args.cache_format)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _log_problem(log) -> str:
    """What keeps ``log`` from being a training log as the stages write it (``{"train": [[step, loss, lr], ...],
    "evals": [{"step": ..., "<split>_loss": ...}, ...], ...}``), or "" when it is one."""
    if not isinstance(log, dict):
        return f"a JSON {type(log).__name__}, not an object"
    missing = [k for k in ("train", "evals") if k not in log]
    if missing:
        return f"no {' or '.join(repr(k) for k in missing)}"
    train, evals = log["train"], log["evals"]
    if not isinstance(train, list) or not all(isinstance(r, list) and len(r) >= 2 and all(map(_is_number, r[:2]))
                                              for r in train):
        return "'train' is not a list of [step, loss, ...] rows"
    if not isinstance(evals, list) or not all(isinstance(e, dict) and _is_number(e.get("step")) for e in evals):
        return "'evals' is not a list of objects with a step"
    if not train and not evals:
        return "no train rows and no evaluations"
    if evals:
        keys = [k for k, v in evals[0].items() if _is_number(v)]
        if not all(_is_number(e.get(k)) for e in evals for k in keys):
            return f"the evaluations do not all hold numbers for {keys}"
    if "title" in log and not isinstance(log["title"], str):
        return "'title' is not a string"
    return ""


def _plot(parser: Parser, args) -> dict:
    from .report import LOG_FILE, PLOT_FILE, plot_or_warn

    try:
        with open(args.log) as f:
            log = json.load(f)
    except (OSError, ValueError) as e:
        parser.error(f"log {args.log!r}: cannot read ({type(e).__name__}: {e})")
    problem = _log_problem(log)
    if problem:
        parser.error(f"log {args.log!r} is not a training log ({problem}; expected the {LOG_FILE} of "
                     f"python -m tqops.train target or drafter)")
    out = out_file_or_exit(parser, args.out if args.out is not None else str(Path(args.log).parent / PLOT_FILE))
    return {"plot": out if plot_or_warn(log, Path(out)) else None}


def build_parser() -> Parser:
    from .dflash2 import ARCHES, SELECTOR_LOSS_WEIGHT, DFlash2Settings
    from .tokenizer import SHIPPED_DIR, VOCAB_SIZE

    parser = Parser(prog="python -m tqops.train", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    p = sub.add_parser("heldout", help="rewrite the committed held-out texts from this interpreter's stdlib")
    p.add_argument("--out", default=str(corpus.HELDOUT_FILE))
    p = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer on the train split")
    p.add_argument("--out", default=str(SHIPPED_DIR))
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    p = sub.add_parser("target", help="train the Qwen3 target")
    p.add_argument("--out", required=True, help="checkpoint folder (weights, tokenizer, log, plot)")
    p.add_argument("--tokenizer", default=str(SHIPPED_DIR), help="tokenizer folder")
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate-size", type=int, default=1024)
    p.add_argument("--dropout", type=float, default=0.1, help="residual dropout while training")
    _add_loop_flags(p, lr=2e-3, max_epochs=30.0)
    p = sub.add_parser("drafter", help="train the DFlash drafter on a trained target")
    p.add_argument("--target", required=True, help="target checkpoint folder (from the target stage)")
    p.add_argument("--out", required=True, help="drafter checkpoint folder (weights, log, plot)")
    p.add_argument("--arch", choices=ARCHES, default="dflash",
                   help="dflash: z-lab's DFlashDraftModel; dflash2: DFlash2DraftModel, with a dynamic causal conv "
                        "around each layer's attention and MLP and a candidate selector (default dflash)")
    # None: not given, so --arch dflash can refuse them; the defaults shown are what --arch dflash2 then takes
    dflash2 = p.add_argument_group("--arch dflash2 only")
    dflash2.add_argument("--conv-kernel-size", type=int, default=None,
                         help=f"taps of each block's causal conv (default {DFlash2Settings.conv_kernel_size})")
    dflash2.add_argument("--conv-group-size", type=int, default=None,
                         help=f"channels sharing one dynamic tap weight; divides the hidden size (default "
                              f"{DFlash2Settings.conv_group_size})")
    dflash2.add_argument("--selector-rank", type=int, default=None,
                         help=f"rank of the selector's pair term (default {DFlash2Settings.selector_rank})")
    dflash2.add_argument("--selector-top-k", type=int, default=None,
                         help=f"candidates per block position (default {DFlash2Settings.selector_top_k})")
    dflash2.add_argument("--selector-loss-weight", type=float, default=None,
                         help=f"the selector's cross entropy is added to the block loss times this (default "
                              f"{SELECTOR_LOSS_WEIGHT})")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="the drafter's MLP width (default: the target's, as z-lab's drafters have)")
    p.add_argument("--target-layer-ids", default=None, help="e.g. 1,3,5 (default: 3 spread over the target)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks-per-sequence", type=int, default=128, help="anchors sampled per packed sequence")
    p.add_argument("--loss-decay", type=float, default=7.0, help="position weight exp(-(k-1)/decay); 0: uniform")
    p.add_argument("--data", choices=("greedy", "corpus"), default="greedy",
                   help="greedy: the target's greedy continuations of corpus prompts (what the drafter meets at "
                        "inference); corpus: the corpus text (default greedy)")
    p.add_argument("--greedy-sequences", type=int, default=16384, help="greedy: at most this many train sequences")
    p.add_argument("--greedy-minutes", type=float, default=1.5,
                   help="greedy: no train-data generation batch starts after this many minutes")
    p.add_argument("--greedy-batch-size", type=int, default=1024, help="greedy: sequences generated at once")
    p.add_argument("--greedy-new-tokens", type=int, default=256,
                   help="greedy: tokens generated after each prompt (prompts are 16 .. seq-len minus this)")
    p.add_argument("--greedy-eval-sequences", type=int, default=128,
                   help="greedy: sequences per evaluation split (validation and held-out)")
    p.add_argument("--accept-prompts", type=int, default=8, help="held-out prompts for the acceptance run (0: skip)")
    p.add_argument("--accept-new-tokens", type=int, default=128)
    _add_loop_flags(p, lr=2e-3)
    p = sub.add_parser("accept", help="mean acceptance length of a target + drafter with tqops' generate()")
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--cache-format", default="bf16", choices=FORMATS)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p = sub.add_parser("plot", help="draw a training log's loss plot")
    p.add_argument("log", help="training_log.json")
    p.add_argument("--out", default=None, help="PNG path (default: loss.png beside the log)")
    return parser


COMMANDS = {"heldout": _heldout, "tokenizer": _tokenizer, "target": _target, "drafter": _drafter,
            "accept": _accept, "plot": _plot}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    summary = COMMANDS[args.command](parser, args)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
