"""Demo: a small Qwen3 target + DFlash drafter generating on a compressed KV cache, then bytes and capacity per format."""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
from tqdm import tqdm

import tqops
from tqops.cli import Parser, device_or_exit
from tqops.models import DFlashDrafter, OracleProposer, Qwen3Config, Qwen3ForCausalLM, generate
from tqops.models.dflash import draft_value
from tqops.models.loading import read_config

RANDOM_BLOCK_SIZE = 8
LOAD_ERRORS = (ValueError, KeyError, OSError, NotImplementedError)


def random_models(cache_format: str, device, dtype, block_size: int = RANDOM_BLOCK_SIZE):
    """A randomly initialised 4-layer Qwen3 and a 1-layer DFlash drafter reading its layers 1 and 3."""
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config.from_dict(dict(common, num_hidden_layers=4)), cache_format=cache_format)
    draft_cfg = dict(common, num_hidden_layers=1, block_size=block_size,
                     dflash_config={"target_layer_ids": [1, 3], "mask_token_id": 511})
    drafter = DFlashDrafter(Qwen3Config.from_dict(draft_cfg), cache_format=cache_format, target=target)
    for module in (target, drafter):
        for name, p in module.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                torch.nn.init.normal_(p, std=p.shape[1] ** -0.5)
    return target.to(device, dtype), drafter.to(device, dtype)


def load_or_exit(parser: Parser, flag: str, path: str, load):
    """``load(path)``, with a checkpoint's loading errors reported as a command-line error naming ``flag``."""
    try:
        return load(path)
    except LOAD_ERRORS as e:
        parser.error(f"{flag} {path!r}: cannot load ({type(e).__name__}: {e})")


def check_args(parser: Parser, args: argparse.Namespace) -> None:
    """Reject bad flags before any model is built."""
    for flag in ("prompts", "max_new_tokens", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not (math.isfinite(args.budget_gib) and args.budget_gib > 0):
        parser.error(f"--budget-gib must be a positive finite number, got {args.budget_gib}")
    device_or_exit(parser, args.device)
    if args.draft and not args.target:
        parser.error("--draft needs --target (the random target cannot host a real drafter)")
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if path and not os.path.isfile(os.path.join(path, "config.json")):
            what = "has no config.json" if os.path.isdir(path) else "is not a folder"
            parser.error(f"{flag} {path!r} {what}")
    if args.oracle_k is not None:
        if args.target and not args.draft:
            parser.error("--oracle-k needs a drafter: pass --draft with --target")
        # read from config.json so a bad k fails before loading weights; 16 is DFlashDrafter's default
        block_size = int(draft_value(load_or_exit(parser, "--draft", args.draft, read_config), "block_size", 16)) \
            if args.draft else RANDOM_BLOCK_SIZE
        if not 0 <= args.oracle_k <= block_size:
            parser.error(f"--oracle-k must be in [0, {block_size}] (the drafter's block size), got {args.oracle_k}")


def main(argv=None) -> None:
    parser = Parser(prog="python -m tqops.demo", description=__doc__)
    parser.add_argument("--cache-format", default="turboquant_4bit_nc", choices=tqops.FORMATS)
    parser.add_argument("--target", help="Qwen3 checkpoint folder (config.json + safetensors)")
    parser.add_argument("--draft", help="DFlash drafter checkpoint folder")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3, help="generate calls to time (after one warm-up)")
    parser.add_argument("--oracle-k", type=int, default=None,
                        help="replace the drafter by a proposer right for k tokens per block (random weights accept ~0)")
    parser.add_argument("--budget-gib", type=float, default=16.0, help="KV memory budget for the capacity table")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    check_args(parser, args)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    use_compile = device.type == "cuda"

    if args.target:
        target = load_or_exit(parser, "--target", args.target, lambda path: Qwen3ForCausalLM.from_pretrained(
            path, cache_format=args.cache_format, dtype=dtype, device=device))
        drafter = load_or_exit(parser, "--draft", args.draft, lambda path: DFlashDrafter.from_pretrained(
            path, target=target, cache_format=args.cache_format)) if args.draft else None
    else:
        target, drafter = random_models(args.cache_format, device, dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompts = [torch.randint(0, vocab - 1, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 40, (args.prompts,), generator=gen)]
    proposer = None
    if args.oracle_k is not None:
        reference = generate(target, prompts, args.max_new_tokens).tokens
        proposer = OracleProposer(reference, args.oracle_k, drafter.block_size, vocab)

    print(f"device {device}, cache format {args.cache_format}, compile and CUDA graphs={use_compile}, "
          f"drafter={'oracle k=%d' % args.oracle_k if proposer else ('DFlash' if drafter else 'none')}")
    options = dict(drafter=drafter, proposer=proposer, compile=use_compile, cudagraph=use_compile)
    generate(target, prompts, 4, **options)  # warm-up: compile (and capture) once before timing
    new_tokens, seconds, acceptance = 0, 0.0, []
    for _ in tqdm(range(args.rounds), desc="generating"):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = generate(target, prompts, args.max_new_tokens, **options)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - start
        new_tokens += sum(map(len, result.tokens))
        acceptance.append(result.mean_acceptance_length)
    print(f"\n{new_tokens / seconds:,.1f} tokens/s over {args.rounds} rounds of {args.prompts} prompts; "
          f"mean acceptance length {sum(acceptance) / len(acceptance):.2f}")
    print(f"first continuation: {result.tokens[0][:16]} ...\n")

    layers = target.attention_layers
    cfg = target.config
    print(f"KV cache per token of this target ({len(layers)} layers x {cfg.num_key_value_heads} kv heads x "
          f"head_dim {cfg.head_dim}) and tokens that fit in {args.budget_gib:g} GiB:")
    print(f"{'format':<20} {'bytes/token':>12} {'vs bf16':>8} {'tokens in budget':>17}")
    bf16 = tqops.get_format("bf16").slot_bytes(cfg.head_dim)
    for name in tqops.FORMATS:
        slot = tqops.get_format(name).slot_bytes(cfg.head_dim)
        per_token = slot * cfg.num_key_value_heads * len(layers)
        mark = "  <- this run" if name == args.cache_format else ""
        print(f"{name:<20} {per_token:>12,} {bf16 / slot:>7.2f}x {int(args.budget_gib * 2**30 // per_token):>17,}{mark}")


if __name__ == "__main__":
    main()
