"""What DFlash2's modules cost: the captured draft step of a v1 drafter and of a DFlash2 drafter of one shape; and,
with a trained DFlash2 drafter, end-to-end tokens/s of the trained target with it against the v1 drafter."""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

import tqops
from tqops.cudagraph import steps as cg
from tqops.graphs import slots_for_positions
from tqops.models import DFlashDrafter, Qwen3Config, Qwen3ForCausalLM
from tqops.models.dflash2 import DFlash2Drafter
from tqops.models.generate import CACHE_BLOCK_SIZE as BLOCK, timed_generate
from tqops.models.steps import drafter_step, step_uniforms
from tqops.shipped import TRAINED_DIR, folder_tokenizer
from tqops.train.heldout import heldout_windows

from .acceptance import drafter_label
from .e2e import SHAPES, _compiled, build_models, fill_caches
from .timing import median_ms

# The modules' sizes at a 4096-wide drafter (no published default to copy: z-lab's config leaves them to the
# checkpoint): a 4-tap conv with one dynamic tap weight per 64 channels, a rank-64 selector over 8 candidates.
DFLASH2_FIELDS = dict(conv_kernel_size=4, conv_group_size=64, selector_rank=64, selector_top_k=8)


def dflash2_config(drafter_cfg: dict, fields: dict = DFLASH2_FIELDS) -> dict:
    """The v1 drafter config ``drafter_cfg`` as a DFlash2 one: ``architectures`` and the modules' ``fields``."""
    return dict(drafter_cfg, architectures=["DFlash2DraftModel"],
                dflash_config={**drafter_cfg["dflash_config"], **fields})


def draft_runner(drafter, batches: Sequence[int], per_seq: int, temperature: float, device):
    """The drafter's compiled step over ``drafter.block_size`` tokens per sequence as a runner for ``batches``."""
    step = drafter_step(drafter, temperature)
    return cg.make_runner(_compiled(step), q_len=drafter.block_size, max_batch=max(batches), max_blocks=per_seq,
                          block_size=BLOCK, device=device, buckets=list(batches), context_dim=drafter.context_dim,
                          context_dtype=drafter.fc.weight.dtype, uniforms=step_uniforms(drafter, temperature))


def fill_draft(runner, drafter, table: torch.Tensor, batch: int, context: int) -> None:
    """Static inputs of ``runner``'s ``batch`` bucket: a block at ``context`` after a block of context rows."""
    dev, bs = table.device, drafter.block_size
    lens, rows = torch.full((batch,), context, device=dev), torch.arange(batch, device=dev)
    pos = (lens[:, None] + torch.arange(bs, device=dev)).flatten()
    ctx_pos = pos - bs
    slots = slots_for_positions(ctx_pos, rows.repeat_interleave(bs), table[:batch], BLOCK)
    states = torch.randn(batch * bs, drafter.context_dim, device=dev, dtype=drafter.fc.weight.dtype)
    uniforms = torch.rand(batch * bs, device=dev) if runner.buffers.uniforms is not None else None
    runner.buffers.fill(batch, torch.randint(0, drafter.config.vocab_size, (batch * bs,), device=dev), pos,
                        (lens + bs).int(), cg.tables(table[:batch]), context_states=states,
                        context_positions=ctx_pos, context_slot_mappings=cg.tables(slots), uniforms=uniforms)


def replay(runner, batch: int):
    """The captured graph of ``batch``; where nothing is captured (CPU), the compiled step it would replay."""
    return runner.graphs[batch].replay if batch in runner.graphs else lambda: runner._run(batch)


@torch.no_grad()
def bench_dflash2(shape: str = "qwen3-8b", fmt: str = "bf16", batches: Sequence[int] = (1, 8),
                  temperatures: Sequence[float] = (0.0, 1.0), device="cuda") -> list[dict]:
    """One row per (temperature, batch): ms of the captured draft step of the shape's v1 drafter and of the same
    drafter with DFlash2's convolutions and selector (``DFLASH2_FIELDS``), random weights, ``context`` cached
    tokens; their ratio is what the modules cost."""
    target_cfg, drafter_cfg, context = SHAPES[shape]
    target, v1 = build_models(fmt, target_cfg, drafter_cfg, device=device)
    with torch.device(device):
        v2 = DFlash2Drafter(Qwen3Config.from_dict(dflash2_config(drafter_cfg)), cache_format=fmt, target=target)
    v2 = v2.to(v1.fc.weight.dtype).eval()
    per_seq = -(-(context + 2 * v1.block_size) // BLOCK)
    tables = {name: fill_caches((d,), max(batches), context, per_seq) for name, d in (("v1", v1), ("dflash2", v2))}
    rows = []
    for temperature in tqdm(temperatures, desc="dflash2 draft step"):
        runners = {}
        for name, drafter in (("v1", v1), ("dflash2", v2)):
            runners[name] = draft_runner(drafter, batches, per_seq, temperature, tables[name].device)
            fill_draft(runners[name], drafter, tables[name], max(batches), context)
            runners[name].capture(progress=False)
        for batch in batches:
            row = dict(format=fmt, shape=shape, context=context, temperature=temperature, batch=batch)
            for name, drafter in (("v1", v1), ("dflash2", v2)):
                fill_draft(runners[name], drafter, tables[name], batch, context)
                row[f"{name}_draft_ms"] = median_ms(replay(runners[name], batch))
            row["dflash2/v1"] = row["dflash2_draft_ms"] / row["v1_draft_ms"]
            rows.append(row)
            tqdm.write(str({c: (round(v, 3) if isinstance(v, float) else v) for c, v in row.items()}))
        del runners
    return rows


# The trained pair's run: batch 1 and 8 held-out prompts, the demo's prompt and continuation lengths and rounds.
PAIR_BATCHES, PAIR_PROMPT_TOKENS, PAIR_NEW_TOKENS, PAIR_ROUNDS = (1, 8), 128, 128, 3


def arch_name(drafter) -> str:
    return "DFlash2" if isinstance(drafter, DFlash2Drafter) else "DFlash"


@torch.no_grad()
def bench_pair(dflash2_dir, v1_dir=None, target_dir=None, *, batches: Sequence[int] = PAIR_BATCHES,
               prompt_tokens: int = PAIR_PROMPT_TOKENS, new_tokens: int = PAIR_NEW_TOKENS, rounds: int = PAIR_ROUNDS,
               fmt: str = "bf16", device=None, compile: Optional[bool] = None,
               on_batch: Optional[Callable[[list[dict]], None]] = None) -> list[dict]:
    """End-to-end speculative decoding of the trained target (``target_dir``, default the shipped one) with the v1
    drafter (``v1_dir``, default the shipped one) and the DFlash2 drafter ``dflash2_dir``, on the first ``batch``
    held-out prompts (``heldout_windows``: ``prompt_tokens`` tokens each, greedy, ``new_tokens`` new tokens, stopping
    at end-of-text) for each batch in ``batches``, as the demo times it: ``rounds`` timed generate() calls after an
    untimed one, steps compiled and captured on CUDA (``compile`` defaults to that), eager elsewhere.

    One row per batch and decoder, plain greedy decoding first: ``tok/s`` (new tokens over seconds, prefill
    included), ``acceptance`` (mean tokens per target step; 1 for plain decoding), ``speedup vs plain``, ``tok/s vs
    v1``, ``lossless`` (every continuation equals plain decoding's) and ``ms/step``; ``drafter`` names the folder as
    ``tqops.bench.acceptance`` does. One target serves both drafters, so its compiled steps are compiled once for
    both (a second batch size recompiles each step once, with a dynamic batch). ``on_batch(rows so far)`` runs after
    every batch, so a run cut short keeps the batches it measured."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    compile = device.type == "cuda" if compile is None else compile
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_dir = Path(target_dir) if target_dir is not None else TRAINED_DIR / "target"
    drafter_dirs = {"v1": Path(v1_dir) if v1_dir is not None else TRAINED_DIR / "drafter", "dflash2": Path(dflash2_dir)}
    tok = folder_tokenizer(target_dir)
    if tok is None:
        raise ValueError(f"{str(target_dir)!r} has no tokenizer.json to cut held-out prompts with")
    windows = heldout_windows(tok, max(batches), prompt_tokens, new_tokens)
    if len(windows) < max(batches):
        raise ValueError(f"only {len(windows)} held-out texts have {prompt_tokens} + {new_tokens} tokens around a "
                         f"line break, fewer than batch {max(batches)}")
    target = Qwen3ForCausalLM.from_pretrained(target_dir, cache_format=fmt, dtype=dtype, device=device)
    drafters = {name: DFlashDrafter.from_pretrained(path, target=target, cache_format=fmt)
                for name, path in drafter_dirs.items()}
    options = dict(eos_token_id=tok.token_to_id("<|endoftext|>"), compile=compile, cudagraph=device.type == "cuda",
                   rounds=rounds)
    rows = []
    for batch in tqdm(batches, desc="trained pair"):
        prompts = [w.prompt(prompt_tokens) for w in windows[:batch]]
        plain = pair_row(fmt, batch, "plain", None, *timed_generate(target, prompts, new_tokens, **options))
        rows.append(plain)
        for name, drafter in drafters.items():
            result, seconds = timed_generate(target, prompts, new_tokens, drafter=drafter, **options)
            rows.append(pair_row(fmt, batch, f"{name} ({arch_name(drafter)})", drafter_label(drafter_dirs[name]),
                                 result, seconds, plain))
        for row in rows[-len(drafters):]:
            row["tok/s vs v1"] = row["tok/s"] / rows[-len(drafters)]["tok/s"]
        tqdm.write(f"batch {batch}: " + "; ".join(f"{r['decoder']} {r['tok/s']:,.0f} tok/s, acceptance "
                                                   f"{r['acceptance']:.2f}" for r in rows[-1 - len(drafters):]))
        if on_batch is not None:
            on_batch(rows)
    return rows


def pair_row(fmt: str, batch: int, decoder: str, drafter: Optional[str], result, seconds: float,
             plain: Optional[dict] = None) -> dict:
    """A row of ``bench_pair`` from one timed generate(); ``plain``: plain decoding's row of the batch (None: this
    is it)."""
    tps = sum(map(len, result.tokens)) / seconds
    return {"format": fmt, "batch": batch, "decoder": decoder, "drafter": drafter, "tok/s": tps,
            "acceptance": result.mean_acceptance_length if plain is not None else 1.0,
            "speedup vs plain": tps / plain["tok/s"] if plain is not None else 1.0, "tok/s vs v1": None,
            "lossless": result.tokens == plain["tokens"] if plain is not None else True,
            "ms/step": 1e3 * seconds / max(map(len, result.acceptance_lengths)),
            "tokens": result.tokens}  # a list: in the JSON, not the table


def release_models() -> None:
    """Drop compiled graphs and the models they hold, and return their memory (between the two parts of a run)."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def batches_arg(text: str) -> tuple[int, ...]:
    try:
        batches = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if min(batches) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return batches


def temperatures_arg(text: str) -> tuple[float, ...]:
    try:
        temperatures = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated temperatures, got {text!r}") from None
    if not all(math.isfinite(t) and t >= 0 for t in temperatures):
        raise argparse.ArgumentTypeError(f"temperatures must be finite and >= 0, got {text!r}")
    return temperatures


def build_parser():
    from tqops.cli import Parser

    p = Parser(prog="python -m tqops.bench.dflash2", description=__doc__)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="modules' cost: the drafters' shape")
    p.add_argument("--format", default="bf16", help="the drafters' cache format (the trained pair's too)")
    p.add_argument("--temperatures", type=temperatures_arg, default=(0.0, 1.0),
                   help="modules' cost: comma-separated temperatures of the draft steps (default 0,1; each compiles "
                        "both drafters' steps)")
    p.add_argument("--no-modules", action="store_true",
                   help="skip the modules' cost (it times captured CUDA steps), for the trained pair alone")
    pair = p.add_argument_group(
        "the trained pair", "with --trained, after the modules' cost: speculative decoding of the trained target with "
        "the v1 drafter and with the DFlash2 drafter on held-out prompts, and plain decoding, as the demo times them "
        "(compiled and captured steps on CUDA): tokens/s, acceptance and speedup over plain decoding per batch")
    pair.add_argument("--trained", metavar="DFLASH2_DIR", default=None, help="the trained DFlash2 drafter folder")
    pair.add_argument("--v1", metavar="V1_DIR", default=None,
                      help=f"the v1 drafter folder (default: {os.path.relpath(TRAINED_DIR / 'drafter')})")
    pair.add_argument("--target", default=None,
                      help=f"their target, with tokenizer.json (default: {os.path.relpath(TRAINED_DIR / 'target')})")
    pair.add_argument("--batches", type=batches_arg, default=PAIR_BATCHES,
                      help="comma-separated batch sizes (default: "
                           f"{','.join(map(str, PAIR_BATCHES))})")
    pair.add_argument("--prompt-tokens", type=int, default=PAIR_PROMPT_TOKENS, help="tokens per held-out prompt")
    pair.add_argument("--new-tokens", type=int, default=PAIR_NEW_TOKENS, help="new tokens per prompt")
    pair.add_argument("--rounds", type=int, default=PAIR_ROUNDS, help="timed generate() calls after a warm-up")
    pair.add_argument("--no-compile", action="store_true", help="captured but not compiled steps (CUDA)")
    pair.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--out", default=None, help="folder for dflash2.json/.md (and dflash2-pair.json/.md; the JSON "
                                                "rewritten after every batch)")
    return p


def check_arguments(parser, args) -> None:
    """One-line errors for flags that cannot run, before any work."""
    from tqops.cli import device_or_exit, out_dir_or_exit
    from tqops.models.checkpoints import checkpoint_config_or_exit, drafter_config_or_exit

    if args.format not in tqops.FORMATS:
        parser.error(f"--format: unknown {args.format!r}; expected one of {', '.join(tqops.FORMATS)}")
    if args.trained is None:
        given = [f for f in ("v1", "target", "device") if getattr(args, f) is not None]
        if given:
            parser.error(f"--{given[0]} applies to the trained pair: pass --trained DFLASH2_DIR")
        if args.no_modules:
            parser.error("--no-modules leaves nothing to run without --trained")
    if not args.no_modules and not torch.cuda.is_available():
        parser.error("the modules' cost times captured CUDA steps: run it on a GPU, or pass --no-modules")
    if args.trained is not None:
        for flag in ("prompt_tokens", "new_tokens", "rounds"):
            if getattr(args, flag) < 1:
                parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
        args.device = str(device_or_exit(parser, args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
        target = args.target or str(TRAINED_DIR / "target")
        raw, config = checkpoint_config_or_exit(parser, "--target", target, "a Qwen3 target checkpoint")
        if not (Path(target) / "tokenizer.json").is_file():
            parser.error(f"--target {target!r} has no tokenizer.json (the held-out prompts are cut with it)")
        for flag, path in (("--v1", args.v1 or str(TRAINED_DIR / "drafter")), ("--trained", args.trained)):
            drafter_config_or_exit(parser, flag, path, config)
        limit = raw.get("max_position_embeddings")
        if limit and args.prompt_tokens + args.new_tokens > limit:
            parser.error(f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens} exceeds the "
                         f"target's max_position_embeddings {limit}")
    if args.out is not None:
        out_dir_or_exit(parser, args.out)


def write_table(rows: list[dict], out: Optional[str], name: str, header: str) -> None:
    """Print ``rows`` as Markdown under ``header`` (flushed, so a run cut short keeps what it printed); with ``out``
    also ``<name>.json`` and ``<name>.md`` there."""
    from .table import markdown_table

    text = f"{header}\n\n{markdown_table(rows)}\n"
    print(text, flush=True)
    if out:
        Path(out, f"{name}.json").write_text(json.dumps(rows, indent=1))
        Path(out, f"{name}.md").write_text(text)


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    header = f"`python -m tqops.bench.dflash2 {' '.join(argv)}` on {where}, torch {torch.__version__}"
    if not args.no_modules:
        write_table(bench_dflash2(args.shape, args.format, temperatures=args.temperatures), args.out, "dflash2",
                    f"{header}: the draft step, v1 and DFlash2 ({args.shape}, random weights), ms")
        release_models()
    if args.trained is not None:
        def save(rows):
            Path(args.out, "dflash2-pair.json").write_text(json.dumps(rows, indent=1))

        rows = bench_pair(args.trained, args.v1, args.target, batches=args.batches, prompt_tokens=args.prompt_tokens,
                          new_tokens=args.new_tokens, rounds=args.rounds, fmt=args.format, device=args.device,
                          compile=False if args.no_compile else None, on_batch=save if args.out else None)
        write_table(rows, args.out, "dflash2-pair", f"{header}: the trained pair end to end, {args.format} cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
