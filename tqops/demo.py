"""Demo: a Qwen3 target + DFlash drafter generating on a compressed KV cache, then bytes and capacity per format."""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

import tqops
from tqops.cli import Parser, device_or_exit, folder_with_or_exit, load_or_exit, torchrun_env_or_exit
from tqops.models import (DFlashDrafter, OracleProposer, Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, generate)
from tqops.models.checkpoints import checkpoint_config_or_exit, drafter_config_or_exit
from tqops.models.dflash import draft_value
from tqops.models.generate import timed_generate
from tqops.models.loading import read_config
from tqops.models.parallel import load_full_state
from tqops import shipped
from tqops.shipped import PROMPT_TOKENS, demo_pair, folder_tokenizer, kv_bytes_per_token, train_command
from tqops.train.heldout import heldout_windows

RANDOM_BLOCK_SIZE = 8
TRAINED_NEW_TOKENS, RANDOM_NEW_TOKENS = 128, 48
TRAINED_PROMPTS, RANDOM_PROMPTS = 1, 4
TEXT_LINES = 6  # prompt lines shown above a continuation
RANDOM_HEADS = dict(num_attention_heads=4, num_key_value_heads=2)  # of both random models


def random_models(cache_format: str, device, dtype, block_size: int = RANDOM_BLOCK_SIZE, tp_group=None,
                  hybrid: bool = False):
    """A randomly initialised 4-layer Qwen3 and a 1-layer DFlash drafter reading its layers 1 and 3 (with
    ``tp_group``, this rank's part of the same models); ``hybrid``: the target is a 4-layer Qwen3.5 instead (three
    Gated DeltaNet layers, then gated full attention)."""
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, **RANDOM_HEADS, head_dim=128,
                  rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    torch.manual_seed(0)
    if hybrid:
        target = Qwen3_5ForCausalLM(Qwen3_5Config.from_dict(dict(
            common, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64, full_attention_interval=4)), cache_format=cache_format)
    else:
        target = Qwen3ForCausalLM(Qwen3Config.from_dict(dict(common, num_hidden_layers=4)), cache_format=cache_format)
    draft_cfg = dict(common, num_hidden_layers=1, block_size=block_size,
                     dflash_config={"target_layer_ids": [1, 3], "mask_token_id": 511})
    drafter = DFlashDrafter(Qwen3Config.from_dict(draft_cfg), cache_format=cache_format, target=target)
    for module in (target, drafter):
        for name, p in module.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                torch.nn.init.normal_(p, std=p.shape[1] ** -0.5)
            elif name.endswith("conv1d.weight"):
                torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    if tp_group is not None:  # every rank builds the same full models (same seed), then keeps its own part
        full_target, full_drafter = target.state_dict(), drafter.state_dict()
        target = Qwen3ForCausalLM(target.config, cache_format=cache_format, tp_group=tp_group)
        drafter = DFlashDrafter(drafter.config, cache_format=cache_format, target=target)
        load_full_state(target, full_target)
        load_full_state(drafter, full_drafter)
    return target.to(device, dtype), drafter.to(device, dtype)


def model_folders(args: argparse.Namespace) -> tuple[Optional[Path], Optional[Path]]:
    """The target and drafter folders this run loads: the flags', else the shipped pair's, else none (random)."""
    if args.target:
        return Path(args.target), Path(args.draft) if args.draft else None
    pair = None if args.random_weights else demo_pair()
    return pair if pair else (None, None)


def check_tp(parser: Parser, args: argparse.Namespace) -> None:
    """``--tp N`` needs N torchrun processes (WORLD_SIZE), and a CUDA device per local rank on CUDA."""
    world = os.environ.get("WORLD_SIZE")
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if args.tp > 1 and world is None:
        parser.error(f"--tp {args.tp} runs one process per rank: torchrun --nproc-per-node {args.tp} -m tqops.demo "
                     f"--tp {args.tp}")
    if world is not None and world != str(args.tp):
        parser.error(f"--tp {args.tp} must equal the number of torchrun processes (WORLD_SIZE={world})")
    torchrun_env_or_exit(parser, "tqops.demo")
    if args.tp > 1 and torch.device(args.device).type == "cuda":
        device_or_exit(parser, f"cuda:{os.environ.get('LOCAL_RANK', '0')}", "--tp (one CUDA device per rank)")


def check_tp_heads(parser: Parser, args: argparse.Namespace, folders) -> None:
    """``--tp N`` splits every model's attention and kv heads N ways: N must divide both, read from config.json (or
    the random models'), before the process group or any model is built."""
    if args.tp == 1:
        return
    target_dir, draft_dir = folders
    shipped_label = "the shipped pair's" if target_dir is not None and not args.target else None
    for flag, name, folder in (("--target", "target", target_dir), ("--draft", "drafter", draft_dir)):
        if folder is None and target_dir is not None:
            continue  # no drafter
        label = f"{shipped_label} {name}" if shipped_label else flag
        config = load_or_exit(parser, label, folder, read_config) if folder is not None else RANDOM_HEADS
        where = label if folder is not None else f"the random {name}"
        heads = config.get("num_attention_heads")
        for key in ("num_attention_heads", "num_key_value_heads"):
            n = config.get(key, heads)  # Qwen3Config's default: as many kv heads as attention heads
            if isinstance(n, int) and n % args.tp:
                parser.error(f"--tp {args.tp} must divide the {key} of {where} ({n}): tensor parallelism splits "
                             f"the heads evenly over the ranks")


@contextlib.contextmanager
def tensor_parallel(args: argparse.Namespace):
    """The process group of a ``--tp N`` torchrun run (None for ``--tp 1``), destroyed on exit; on CUDA each rank
    takes the device of its LOCAL_RANK. Ranks above 0 print nothing but an uncaught exception's traceback."""
    if args.tp == 1:
        yield None
        return
    import torch.distributed as dist

    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        args.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        torch.cuda.set_device(args.device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device(args.device) if cuda else None)
    try:
        with contextlib.ExitStack() as quiet:
            if dist.get_rank() > 0:
                devnull = quiet.enter_context(open(os.devnull, "w"))
                quiet.enter_context(contextlib.redirect_stdout(devnull))
                quiet.enter_context(contextlib.redirect_stderr(devnull))  # tqdm's bars
            print(f"tensor parallel over {args.tp} ranks ({dist.get_backend()}); KV-cache bytes below are per rank")
            yield dist.group.WORLD
        # every rank done with its collectives before any tears the group down: without it a gloo rank at times
        # aborted at exit ("terminate called without an active exception"); not on error, where it could hang
        dist.barrier()
    finally:
        gc.collect()  # the run's models and their captured graphs: NCCL cannot destroy a group they captured
        dist.destroy_process_group()


def check_args(parser: Parser, args: argparse.Namespace) -> None:
    """Reject bad flags before any model is built."""
    if args.hybrid:
        if args.target:
            parser.error("--hybrid builds a random hybrid pair; it excludes --target")
        if args.tp > 1:
            parser.error("--hybrid runs on one device: tensor parallelism of the hybrid target is not built yet")
        args.random_weights = True
    for flag in ("prompts", "prompt_tokens", "max_new_tokens", "rounds"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if not (math.isfinite(args.budget_gib) and args.budget_gib > 0):
        parser.error(f"--budget-gib must be a positive finite number, got {args.budget_gib}")
    device_or_exit(parser, args.device)
    check_tp(parser, args)
    if args.draft and not args.target:
        parser.error("--draft needs --target (a drafter reads the hidden states of its own target)")
    if args.random_weights and args.target:
        parser.error("--random-weights and --target exclude each other")

    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if path:
            folder_with_or_exit(parser, flag, path, "config.json")
    target_dir, draft_dir = model_folders(args)
    if args.all_formats and target_dir is not None and draft_dir is None:
        parser.error("--all-formats measures the drafter's acceptance per format: pass --draft with --target")
    if args.all_formats and args.oracle_k is not None:
        parser.error("--all-formats measures the drafter's acceptance per format, --oracle-k replaces the drafter")
    if args.oracle_k is not None:
        if target_dir is not None and draft_dir is None:
            parser.error("--oracle-k needs a drafter: pass --draft with --target")
        # read from config.json so a bad k fails before loading weights; 16 is DFlashDrafter's default
        block_size = int(draft_value(load_or_exit(parser, "--draft", draft_dir, read_config), "block_size", 16)) \
            if draft_dir else RANDOM_BLOCK_SIZE
        if not 0 <= args.oracle_k <= block_size:
            parser.error(f"--oracle-k must be in [0, {block_size}] (the drafter's block size), got {args.oracle_k}")
    check_tp_heads(parser, args, (target_dir, draft_dir))


def build_parser() -> Parser:
    parser = Parser(prog="python -m tqops.demo", description=__doc__)
    parser.add_argument("--cache-format", default="turboquant_4bit_nc", choices=tqops.FORMATS)
    parser.add_argument("--target", help="Qwen3 checkpoint folder (config.json + safetensors; its tokenizer.json, if "
                                         "any, gives held-out prompts and text); default: the shipped trained pair")
    parser.add_argument("--draft", help="DFlash drafter checkpoint folder")
    parser.add_argument("--random-weights", action="store_true",
                        help="random models even where the shipped trained pair is present")
    parser.add_argument("--hybrid", action="store_true",
                        help="a random hybrid target (Qwen3.5: Gated DeltaNet + gated attention) under the drafter "
                             "(implies --random-weights)")
    parser.add_argument("--prompts", type=int, default=None,
                        help=f"prompts per batch (default: {TRAINED_PROMPTS} held-out with a tokenizer, "
                             f"{RANDOM_PROMPTS} random without)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="tokens per held-out prompt")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"default: {TRAINED_NEW_TOKENS} with a tokenizer, {RANDOM_NEW_TOKENS} without")
    parser.add_argument("--rounds", type=int, default=3, help="generate calls to time (after one warm-up)")
    parser.add_argument("--oracle-k", type=int, default=None,
                        help="replace the drafter by a proposer right for k tokens per block "
                             "(random weights accept ~0)")
    parser.add_argument("--all-formats", action=argparse.BooleanOptionalAction, default=None,
                        help="measure acceptance and losslessness on every cache format for the table (default: on "
                             "for the shipped pair)")
    parser.add_argument("--budget-gib", type=float, default=16.0, help="KV memory budget for the capacity table")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks; run under torchrun --nproc-per-node N with --tp N")
    return parser


def drafter_name(drafter) -> str:
    """What the run line calls the drafter: DFlash2 (its step walks the candidate selector), DFlash, or none."""
    if drafter is None:
        return "none"
    return "DFlash2" if drafter.selects_in_step else "DFlash"


def speculative_and_greedy(target, drafter, prompts, max_new_tokens: int, eos, options: dict) -> dict:
    """Mean acceptance length of DFlash decoding and whether every continuation equals plain greedy decoding."""
    spec = generate(target, prompts, max_new_tokens, drafter=drafter, eos_token_id=eos, **options)
    plain = generate(target, prompts, max_new_tokens, eos_token_id=eos, **options)
    return {"acceptance": spec.mean_acceptance_length, "lossless": spec.tokens == plain.tokens}


def print_continuations(tok, named_prompts, result) -> None:
    """Each prompt's last lines, then its continuation, as text."""
    for (path, ids), new in zip(named_prompts, result.tokens):
        tail = "\n".join(tok.decode(ids).splitlines()[-TEXT_LINES:])
        print(f"--- held-out {path}: the last lines of the {len(ids)}-token prompt ---\n{tail}")
        print(f"--- generated ({len(new)} tokens) ---\n{tok.decode(new)}\n--- end ---\n")


def print_format_table(target, drafter, cache_format: str, budget_gib: float, measured: dict) -> None:
    """KV bytes per token of target and drafter, capacity in the budget, and acceptance where measured, per format."""
    cfg = target.config
    layers = target.attention_layers
    states = len(getattr(target, "state_layers", ()))
    where = (f"the target ({len(layers)} attention layers x {cfg.num_key_value_heads} kv heads x head_dim "
             f"{cfg.head_dim}{f'; its {states} Gated DeltaNet layers keep states, no KV' if states else ''})"
             + (f" + the drafter ({len(drafter.attention_layers)} layers)" if drafter is not None else ""))
    print(f"KV cache per token of {where} and tokens that fit in {budget_gib:g} GiB:")
    extra = f" {'acceptance':>11} {'lossless':>9}" if measured else ""
    print(f"{'format':<20} {'target B/token':>15} {'with drafter':>13} {'vs bf16':>8} {'tokens in budget':>17}{extra}")

    def total(fmt):
        return kv_bytes_per_token(target, fmt) + (kv_bytes_per_token(drafter, fmt) if drafter is not None else 0)

    for name in tqops.FORMATS:
        per_token = total(name)
        cells = (f"{name:<20} {kv_bytes_per_token(target, name):>15,} {per_token:>13,} "
                 f"{total('bf16') / per_token:>7.2f}x {int(budget_gib * 2**30 // per_token):>17,}")
        if name in measured:
            m = measured[name]
            cells += f" {m['acceptance']:>11.2f} {'yes' if m['lossless'] else 'NO':>9}"
        elif measured:
            cells += f" {'':>11} {'':>9}"
        print(cells + ("  <- this run" if name == cache_format else ""))


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    with tensor_parallel(args) as tp_group:
        run(parser, args, tp_group)


def run(parser: Parser, args: argparse.Namespace, tp_group=None) -> None:
    """The demo in this process: the whole model, or this rank's part of it with ``tp_group``."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    use_compile = device.type == "cuda"
    target_dir, draft_dir = model_folders(args)
    is_shipped = target_dir is not None and not args.target
    build = _model_builder(parser, args, (target_dir, draft_dir), is_shipped, device, dtype, tp_group)
    # the tokenizer and held-out prompts before the models: a bad tokenizer.json or length fails before loading
    tok = load_or_exit(parser, "the shipped pair's target" if is_shipped else "--target", target_dir, folder_tokenizer,
                       errors=(Exception,), what="cannot read its tokenizer.json")
    eos = tok.token_to_id("<|endoftext|>") if tok is not None else None
    max_new_tokens = args.max_new_tokens or (TRAINED_NEW_TOKENS if tok is not None else RANDOM_NEW_TOKENS)
    windows = _heldout_or_exit(parser, args, tok, max_new_tokens)
    if args.target:  # the configs and the weight files' headers against them, before loading any tensor
        _, target_config = checkpoint_config_or_exit(parser, "--target", args.target, "a Qwen3 checkpoint")
        if args.draft:
            drafter_config_or_exit(parser, "--draft", args.draft, target_config)
    target, drafter = build(args.cache_format)
    named_prompts = [(w.path, w.prompt(args.prompt_tokens)) for w in windows]
    prompts = [ids for _, ids in named_prompts] if named_prompts else _random_prompts(args, target)
    proposer = None
    if args.oracle_k is not None:
        reference = generate(target, prompts, max_new_tokens, eos_token_id=eos).tokens
        proposer = OracleProposer(reference, args.oracle_k, drafter.block_size, target.config.vocab_size)

    print(f"device {device}, cache format {args.cache_format}, compile and CUDA graphs={use_compile}, "
          f"drafter={'oracle k=%d' % args.oracle_k if proposer else drafter_name(drafter)}")
    result, measured = _timed_decoding(args, (target, drafter, proposer), prompts, max_new_tokens, eos, use_compile,
                                       measure=target_dir is not None)
    if tok is not None:
        print()
        print_continuations(tok, named_prompts, result)
    else:
        print(f"first continuation: {result.tokens[0][:16]} ...\n")

    all_formats = args.all_formats if args.all_formats is not None else is_shipped and proposer is None
    if all_formats:
        # eager steps (captured on CUDA): compiling every format's models would dominate the demo's runtime
        others = [f for f in tqops.FORMATS if f not in measured]
        for fmt in tqdm(others, desc="acceptance per format"):
            models = build(fmt)
            measured[fmt] = speculative_and_greedy(*models, prompts, max_new_tokens, eos,
                                                   dict(cudagraph=device.type == "cuda"))
        print()
    print_format_table(target, drafter, args.cache_format, args.budget_gib, measured)


def _model_builder(parser: Parser, args: argparse.Namespace, folders, is_shipped: bool, device, dtype, tp_group):
    """``build(cache_format) -> (target, drafter or None)``: the checkpoints in ``folders`` loaded, or without a
    target folder the random models; says which it builds."""
    target_dir, draft_dir = folders

    def load(fmt: str):
        label = "the shipped pair's target" if is_shipped else "--target"
        target = load_or_exit(parser, label, target_dir, lambda path: Qwen3ForCausalLM.from_pretrained(
            path, cache_format=fmt, dtype=dtype, device=device, tp_group=tp_group))
        label = "the shipped pair's drafter" if is_shipped else "--draft"
        drafter = load_or_exit(parser, label, draft_dir, lambda path: DFlashDrafter.from_pretrained(
            path, target=target, cache_format=fmt)) if draft_dir else None
        return target, drafter

    if target_dir is None:
        if not args.random_weights:
            print(f"random weights: the trained pair is not in {os.path.relpath(shipped.TRAINED_DIR)} yet "
                  f"(train it: {train_command()})")
        return lambda fmt: random_models(fmt, device, dtype, tp_group=tp_group, hybrid=args.hybrid)
    where = (f"the shipped trained pair from {os.path.relpath(shipped.TRAINED_DIR)} ({target_dir.name}/, "
             f"{draft_dir.name}/)") if is_shipped else target_dir
    print(f"loading {where}")
    return load


def _heldout_or_exit(parser: Parser, args: argparse.Namespace, tok, max_new_tokens: int) -> list:
    """The held-out prompt windows (none without a tokenizer), or a parser error when no held-out text fits."""
    # held-out prompts by the rule of the drafter stage's acceptance run and the acceptance study
    windows = heldout_windows(tok, args.prompts or TRAINED_PROMPTS, args.prompt_tokens, max_new_tokens) if tok else []
    if tok is not None and not windows:
        if not heldout_windows(tok, 1, 1, max_new_tokens):  # too long whatever the prompt
            parser.error(f"--max-new-tokens {max_new_tokens}: no held-out text has that many tokens after a line "
                         f"start (held-out continuations must fit in one text)")
        parser.error(f"--prompt-tokens {args.prompt_tokens}: no held-out text has a line start at or after that token "
                     f"with {max_new_tokens} tokens (--max-new-tokens) after it")
    return windows


def _random_prompts(args: argparse.Namespace, target) -> list:
    """``--prompts`` (default ``RANDOM_PROMPTS``) random prompts of 8 to 39 tokens, the same every run."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, target.config.vocab_size - 1, (int(n),), generator=gen).tolist()
            for n in torch.randint(8, 40, (args.prompts or RANDOM_PROMPTS,), generator=gen)]


def _timed_decoding(args: argparse.Namespace, models, prompts, max_new_tokens: int, eos, use_compile: bool,
                    measure: bool) -> tuple:
    """Times decoding with ``models`` (target, drafter, proposer), then plain greedy decoding when anything drafts,
    and prints both -> (the first one's result, {cache format: acceptance, lossless}: this run's format when
    ``measure`` (checkpoint weights) and the drafter, not a proposer, drafts)."""
    target, drafter, proposer = models
    steps = dict(compile=use_compile, cudagraph=use_compile)
    # greedy steps: every round gives the same tokens and acceptance, the last one stands for all
    result, seconds = timed_generate(target, prompts, max_new_tokens, rounds=args.rounds, progress="generating",
                                     eos_token_id=eos, drafter=drafter, proposer=proposer, **steps)
    tokens_per_s, mean_acceptance = sum(map(len, result.tokens)) / seconds, result.mean_acceptance_length
    print(f"\n{tokens_per_s:,.1f} tokens/s over {args.rounds} rounds of {len(prompts)} prompts; "
          f"mean acceptance length {mean_acceptance:.2f}")
    measured = {}
    if drafter is not None or proposer is not None:
        plain, seconds = timed_generate(target, prompts, max_new_tokens, rounds=args.rounds,
                                        progress="plain decoding", eos_token_id=eos, **steps)
        plain_per_s = sum(map(len, plain.tokens)) / seconds
        print(f"plain greedy decoding, the same way ({'compiled and captured' if use_compile else 'eager'}): "
              f"{plain_per_s:,.1f} tokens/s; speculative decoding is {tokens_per_s / plain_per_s:.2f}x that")
        if proposer is None and measure:
            measured[args.cache_format] = {"acceptance": mean_acceptance, "lossless": plain.tokens == result.tokens}
            print(f"same tokens as plain greedy decoding on this cache: "
                  f"{'yes' if plain.tokens == result.tokens else 'NO'}")
    return result, measured


if __name__ == "__main__":
    main()
