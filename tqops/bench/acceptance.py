"""Acceptance of a trained target + DFlash drafter per cache format and mixed layout, on held-out prompts."""
from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

import tqops
from tqops.cli import Parser, device_or_exit
from tqops.shipped import (PROMPT_TOKENS, TRAINED_DIR, folder_tokenizer, has_weights, kv_bytes_per_token,
                           mid_file_prompts, train_command, trained_pair)
from tqops.models import DFlashDrafter, Qwen3ForCausalLM, generate

# What each layout stores in the format under test; the rest is bf16.
LAYOUTS = {
    "both": "target and drafter",
    "target-only": "target (drafter bf16)",
    "drafter-only": "drafter (target bf16)",
    "ends-bf16": "target and drafter, but the target's first two and last two layers bf16 (as vLLM does)",
}
ENDS = (0, 1, -2, -1)
BUDGET_GIB = 16.0
PROMPTS, NEW_TOKENS = 16, 128


@dataclasses.dataclass(frozen=True)
class Layout:
    """The cache formats of one measured configuration: ``target_layers`` overrides the target's format by layer
    index (negative from the end), as ``Qwen3ForCausalLM.from_pretrained(layer_cache_formats=...)`` takes it."""

    name: str
    format: str
    target_format: str
    drafter_format: str
    target_layers: tuple = ()  # ((layer, format), ...)

    @property
    def target_key(self) -> tuple:
        """What the target's greedy output depends on (the drafter never changes it)."""
        return self.target_format, self.target_layers


def layouts(formats: Sequence[str] = tqops.FORMATS, names: Sequence[str] = tuple(LAYOUTS)) -> list[Layout]:
    """The bf16 baseline, then every format in every named layout (the mixed layouts of bf16 are bf16 throughout)."""
    plan = [Layout("both", "bf16", "bf16", "bf16")]
    for fmt in (f for f in formats if f != "bf16"):
        for name in names:
            ends = tuple((i, "bf16") for i in ENDS) if name == "ends-bf16" else ()
            plan.append(Layout(name, fmt, "bf16" if name == "drafter-only" else fmt,
                               "bf16" if name == "target-only" else fmt, ends))
    return plan


def describe_target(target, layout: Layout) -> str:
    """The target's cache: one format, or the format with the layers stored otherwise named."""
    formats = [attn.fmt.name for attn in target.attention_layers]
    others = [i for i, f in enumerate(formats) if f != layout.target_format]
    if not others:
        return layout.target_format
    return f"{layout.target_format}, layers {','.join(map(str, others))} {formats[others[0]]}"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def timed_generate(target, prompts, new_tokens: int, timed: bool, **options):
    """``generate(...)`` and its seconds; ``timed`` (CUDA) runs it once untimed first to capture its graphs."""
    if timed:
        generate(target, prompts, new_tokens, **options)
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = generate(target, prompts, new_tokens, **options)
    if timed:
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


@torch.no_grad()
def bench_acceptance(target_dir, drafter_dir, *, formats: Sequence[str] = tqops.FORMATS,
                     layout_names: Sequence[str] = tuple(LAYOUTS), prompts: int = PROMPTS,
                     prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS, budget_gib: float = BUDGET_GIB,
                     device=None, compile: bool = False) -> list[dict]:
    """One row per layout: mean acceptance length of greedy DFlash decoding, whether every continuation equals plain
    greedy decoding on the same cache (lossless), the mean leading tokens shared with the bf16 cache's greedy
    continuation, KV bytes per token of target and drafter, tokens in ``budget_gib``, and on CUDA tokens/s of the
    captured speculative loop (``compile``: compiled steps; one generate() call after an untimed one, prefill
    included) against captured plain greedy decoding and against the bf16 row.

    Prompts: ``mid_file_prompts`` (the ``prompt_tokens`` tokens before the middle line of each held-out text, the
    first ``prompts`` texts long enough), all in one batch, ``new_tokens`` new tokens each, stopping at end-of-text.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timed = device.type == "cuda"
    tok = folder_tokenizer(target_dir)
    if tok is None:
        raise ValueError(f"{str(target_dir)!r} has no tokenizer.json to cut held-out prompts with")
    batch = [ids for _, ids in mid_file_prompts(tok, prompts, prompt_tokens)]
    if not batch:
        raise ValueError(f"no held-out text has {prompt_tokens} tokens before its middle")
    eos = tok.token_to_id("<|endoftext|>")
    options = dict(eos_token_id=eos, compile=compile, cudagraph=timed)
    tqdm.write(f"{len(batch)} held-out prompts of {prompt_tokens} tokens, {new_tokens} new tokens each, on {device}")
    greedy, rows = {}, []
    plan = layouts(formats, layout_names)
    bar = tqdm(plan, desc="acceptance")
    for layout in bar:
        bar.set_postfix_str(f"{layout.format} {layout.name}")
        if compile:  # fresh models per layout: drop the last layout's graphs, start the recompile count over
            torch._dynamo.reset()
        target = Qwen3ForCausalLM.from_pretrained(target_dir, cache_format=layout.target_format,
                                                  layer_cache_formats=dict(layout.target_layers) or None,
                                                  dtype=dtype, device=device)
        drafter = DFlashDrafter.from_pretrained(drafter_dir, target=target, cache_format=layout.drafter_format)
        spec, spec_seconds = timed_generate(target, batch, new_tokens, timed, drafter=drafter, **options)
        if layout.target_key not in greedy:
            greedy[layout.target_key] = timed_generate(target, batch, new_tokens, timed, **options)
        plain, plain_seconds = greedy[layout.target_key]
        equal = sum(a == b for a, b in zip(spec.tokens, plain.tokens))
        baseline = greedy[plan[0].target_key][0].tokens
        target_bytes, drafter_bytes = kv_bytes_per_token(target), kv_bytes_per_token(drafter)
        row = {"format": layout.format, "layout": layout.name, "target cache": describe_target(target, layout),
               "drafter cache": layout.drafter_format,
               "acceptance": spec.mean_acceptance_length, "lossless": equal == len(batch),
               "greedy-equal prompts": f"{equal}/{len(batch)}",
               "bf16-greedy prefix": sum(map(common_prefix, spec.tokens, baseline)) / len(batch),
               "target B/token": target_bytes, "drafter B/token": drafter_bytes,
               "kv B/token": target_bytes + drafter_bytes,
               f"tokens in {budget_gib:g} GiB": int(budget_gib * 2**30 // (target_bytes + drafter_bytes))}
        if timed:
            row["tok/s"] = sum(map(len, spec.tokens)) / spec_seconds
            row["greedy tok/s"] = sum(map(len, plain.tokens)) / plain_seconds
            row["speedup vs greedy"] = row["tok/s"] / row["greedy tok/s"]
        rows.append(row)
        del target, drafter
    bf16 = rows[0]
    for row in rows:
        row["capacity vs bf16"] = bf16["kv B/token"] / row["kv B/token"]
        if timed:
            row["tok/s vs bf16"] = row["tok/s"] / bf16["tok/s"]
    return rows


def plot_acceptance(rows: list[dict], path: str) -> None:
    """PNG, one bar per format and layout: mean acceptance length (hatched where not lossless), KV tokens in the
    budget, and on CUDA tokens/s against the bf16 row."""
    import matplotlib  # the optional "plot" extra, imported only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    formats = list(dict.fromkeys(r["format"] for r in rows))
    names = [n for n in LAYOUTS if any(r["layout"] == n for r in rows)]
    budget = next(c for c in rows[0] if c.startswith("tokens in "))
    panels = [("acceptance", "mean acceptance length (tokens per step)"), (budget, f"KV {budget} (target + drafter)")]
    if "tok/s vs bf16" in rows[0]:
        panels.append(("tok/s vs bf16", "speculative tokens/s vs bf16 (captured)"))
    width = 0.8 / len(names)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(7.0, 1.3 * len(formats)), 4 * len(panels)), sharex=True)
    for j, name in enumerate(names):
        at = {r["format"]: r for r in rows if r["layout"] == name}
        xs = [i + (j - (len(names) - 1) / 2) * width for i, f in enumerate(formats) if f in at]
        picked = [at[f] for f in formats if f in at]
        for ax, (column, _) in zip(axes, panels):
            ax.bar(xs, [r[column] for r in picked], width, color=f"C{j}")
        for bar, r in zip(axes[0].patches[-len(picked):], picked):
            if not r["lossless"]:
                bar.set_hatch("//")
    for ax, (_, label) in zip(axes, panels):
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_title("greedy DFlash decoding on held-out stdlib code (hatched: output differs from plain greedy)")
    handles = [Patch(color=f"C{j}", label=name) for j, name in enumerate(names)]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="not lossless"))
    axes[1].legend(handles=handles, fontsize=8, loc="upper left")
    axes[-1].set_xticks(range(len(formats)), formats, rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser) -> None:
    """The acceptance benchmark's flags (on ``python -m tqops.bench``'s parser)."""
    parser.add_argument("--target", default=None, help="acceptance: Qwen3 target folder with tokenizer.json "
                                                       f"(default: {os.path.relpath(TRAINED_DIR)}/target)")
    parser.add_argument("--draft", default=None, help="acceptance: DFlash drafter folder (default: the shipped one)")
    parser.add_argument("--formats", default=",".join(tqops.FORMATS), help="acceptance: comma-separated formats")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help="acceptance: comma-separated layouts: "
                             + "; ".join(f"{name}: {what}" for name, what in LAYOUTS.items()))
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="acceptance: held-out prompts (one batch)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="acceptance: tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="acceptance: greedy tokens per prompt")
    parser.add_argument("--budget-gib", type=float, default=BUDGET_GIB, help="acceptance: KV memory budget")
    parser.add_argument("--device", default=None, help="acceptance: cpu or cuda (default: cuda when present)")
    parser.add_argument("--compile", action="store_true",
                        help="acceptance: compile the steps before capturing them (CUDA; compiles once per layout)")


def check_arguments(parser: Parser, args) -> None:
    """Reject bad acceptance flags, and a missing trained pair, with one line before anything runs."""
    for flag in ("prompts", "prompt_tokens", "new_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not (math.isfinite(args.budget_gib) and args.budget_gib > 0):
        parser.error(f"--budget-gib must be a positive finite number, got {args.budget_gib}")
    args.device = str(device_or_exit(parser, args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    for flag, value, known in (("--formats", args.formats, tqops.FORMATS), ("--layouts", args.layouts, LAYOUTS)):
        unknown = [v for v in value.split(",") if v not in known]
        if unknown:
            parser.error(f"{flag}: unknown {unknown}; expected a comma-separated subset of {', '.join(known)}")
    if bool(args.target) != bool(args.draft):
        parser.error("--target and --draft go together (a drafter reads the hidden states of its own target)")
    if not args.target:
        pair = trained_pair()
        if pair is None:
            parser.error(f"not trained yet: run {train_command()} (or pass --target and --draft)")
        args.target, args.draft = map(str, pair)
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if not has_weights(path):
            parser.error(f"{flag} {path!r} has no config.json and safetensors weights")
    if not (Path(args.target) / "tokenizer.json").is_file():
        parser.error(f"--target {args.target!r} has no tokenizer.json (the held-out prompts are cut with it)")


def run(args) -> list[dict]:
    """``bench_acceptance`` with the command line's flags (checked by ``check_arguments``)."""
    return bench_acceptance(args.target, args.draft, formats=args.formats.split(","),
                            layout_names=args.layouts.split(","), prompts=args.prompts,
                            prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                            budget_gib=args.budget_gib, device=args.device, compile=args.compile)

