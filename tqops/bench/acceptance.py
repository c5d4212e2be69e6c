"""Acceptance of a trained target + DFlash drafter per cache format, mixed layout and context length, on held-out
text: greedy and temperature-1 acceptance, the target's held-out loss through the cache, KV bytes, and (CUDA) speed.

Held-out prompts: ``tqops.train.heldout``; the target's loss: ``tqops.bench.heldout``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

import tqops
from tqops.cli import Parser, device_or_exit, load_or_exit, subset_or_exit
from tqops.models import DFlashDrafter, Qwen3ForCausalLM, generate
from tqops.models.checkpoints import checkpoint_config_or_exit, drafter_config_or_exit
from tqops.models.generate import GenerateResult, timed_generate
from tqops.shipped import TRAINED_DIR, folder_tokenizer, has_weights, kv_bytes_per_token, train_command, trained_pair
from tqops.train.heldout import heldout_windows

from .heldout import position_limit, token_losses

# What each layout stores in the format under test; the rest is bf16.
LAYOUTS = {
    "both": "target and drafter",
    "target-only": "target (drafter bf16)",
    "drafter-only": "drafter (target bf16)",
    "ends-bf16": "target and drafter, but the target's first two and last two layers bf16 (as vLLM does)",
}
ENDS = (0, 1, -2, -1)
TIMED_LAYOUTS = ("both",)  # where the step cost is measured on CUDA
BUDGET_GIB = 16.0
PROMPTS, NEW_TOKENS, SEED = 8, 128, 0
BOOTSTRAP, LEVEL = 2000, 0.95  # resamples of the prompts, and the intervals' coverage
RATIO_COLUMNS = ("greedy ratio", "greedy ratio 95% lo", "greedy ratio 95% hi", "t=1 ratio", "t=1 ratio 95% lo",
                 "t=1 ratio 95% hi")
CONTEXTS = (128, 512, 1536)  # prompt tokens; the shipped target's max_position_embeddings is 2048


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
        """What the target's greedy output and loss depend on (the drafter never changes them)."""
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


@dataclasses.dataclass
class DrafterRuns:
    """One drafter's runs at one layout and context: greedy (with its seconds where timed) and temperature 1."""

    greedy: GenerateResult
    greedy_seconds: float
    sampled: GenerateResult


def prompt_totals(result: GenerateResult) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and decode steps of each prompt, float64 ``[B]`` each: ``mean_acceptance_length`` is the ratio of
    their sums."""
    return (torch.tensor([sum(a) for a in result.acceptance_lengths], dtype=torch.float64),
            torch.tensor([len(a) for a in result.acceptance_lengths], dtype=torch.float64))


def resample_prompts(prompts: int, resamples: int = BOOTSTRAP, seed: int = SEED) -> torch.Tensor:
    """``[resamples, prompts]`` prompt indices drawn with replacement (seeded): the bootstrap over prompts."""
    return torch.randint(prompts, (resamples, prompts), generator=torch.Generator().manual_seed(seed))


def resampled_acceptance(result: GenerateResult, draws: torch.Tensor) -> torch.Tensor:
    """Mean acceptance length (tokens over steps, pooled as ``mean_acceptance_length`` pools them) of each bootstrap
    resample of the prompts ``draws`` ``[R, B]`` -> ``[R]`` (NaN for a resample without a decode step)."""
    tokens, steps = prompt_totals(result)
    steps = steps[draws].sum(-1)
    return torch.where(steps > 0, tokens[draws].sum(-1) / steps, torch.nan)


def interval(samples: torch.Tensor, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval of bootstrap ``samples`` holding ``level`` of them."""
    low, high = torch.nanquantile(samples, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=samples.dtype))
    return low.item(), high.item()


def acceptance_intervals(runs: DrafterRuns, base: Optional[DrafterRuns], draws: torch.Tensor) -> dict:
    """``runs``' bootstrap 95% intervals of greedy and temperature-1 acceptance; with ``base`` (another drafter on
    the same prompts) the ratios of ``runs``' acceptance to ``base``'s, each with its paired-bootstrap interval (both
    drafters' acceptance from the same resamples of the prompts)."""
    out = {}
    for name, pick in (("greedy", lambda r: r.greedy), ("t=1", lambda r: r.sampled)):
        samples = resampled_acceptance(pick(runs), draws)
        out[f"{name} 95% lo"], out[f"{name} 95% hi"] = interval(samples)
        if base is not None:
            ratio = samples / resampled_acceptance(pick(base), draws)
            out[f"{name} ratio"] = pick(runs).mean_acceptance_length / pick(base).mean_acceptance_length
            out[f"{name} ratio 95% lo"], out[f"{name} ratio 95% hi"] = interval(ratio)
    return out


def drafter_label(path) -> str:
    """How the rows name a drafter: its folder as given, relative to the working directory where that is shorter."""
    relative = os.path.relpath(path)
    return relative if len(relative) < len(str(path)) else str(path)


def load_layout(target_dir, drafter_dirs: Sequence, layout: Layout, dtype, device) -> tuple:
    """The target in ``layout``'s formats and every drafter on it (they share its embeddings and head)."""
    target = Qwen3ForCausalLM.from_pretrained(target_dir, cache_format=layout.target_format,
                                              layer_cache_formats=dict(layout.target_layers) or None,
                                              dtype=dtype, device=device)
    return target, [DFlashDrafter.from_pretrained(d, target=target, cache_format=layout.drafter_format)
                    for d in drafter_dirs]


def run_drafter(target, drafter, batch, new_tokens: int, *, timed: bool, seed: int, options: dict) -> DrafterRuns:
    """Greedy (timed on CUDA after an untimed call where ``timed``) and seeded temperature-1 DFlash decoding. The
    sampled run is never timed, so it never compiles: its steps are captured eagerly where ``timed`` (a DFlash2
    drafter's step at temperature 1 is a graph of its own, which would cost a compile per layout for no figure)."""
    spec, seconds = timed_generate(target, batch, new_tokens, warm_up=timed, drafter=drafter, cudagraph=timed,
                                   **options)
    sampled = generate(target, batch, new_tokens, drafter=drafter, temperature=1.0, seed=seed, cudagraph=timed,
                       **dict(options, compile=False))
    return DrafterRuns(spec, seconds, sampled)


def plain_and_loss(target, windows, context: int, new_tokens: int, *, timed: bool, options: dict) -> dict:
    """Plain greedy decoding of the windows' prompts (timed where ``timed``) and the target's held-out loss."""
    batch = [w.prompt(context) for w in windows]
    plain, seconds = timed_generate(target, batch, new_tokens, warm_up=timed, cudagraph=timed, **options)
    nats = token_losses(target, [w.sequence(context) for w in windows], new_tokens)
    scored_bytes = sum(w.continuation_bytes for w in windows)
    return dict(plain=plain, seconds=seconds, loss=nats.mean().item(),
                bits=nats.sum().item() / math.log(2) / scored_bytes)


def acceptance_columns(runs: DrafterRuns, intervals: dict, ratio_to: Optional[str], compare: bool) -> dict:
    """The acceptance columns of a row, each mean beside its interval; with ``compare`` the ratio columns too
    (None on the rows of the drafter the others are compared with)."""
    columns = {"acceptance greedy": runs.greedy.mean_acceptance_length,
               "greedy 95% lo": intervals["greedy 95% lo"], "greedy 95% hi": intervals["greedy 95% hi"],
               "acceptance t=1": runs.sampled.mean_acceptance_length,
               "t=1 95% lo": intervals["t=1 95% lo"], "t=1 95% hi": intervals["t=1 95% hi"]}
    if compare:
        columns["ratio to"] = ratio_to
        columns.update({c: intervals.get(c) for c in RATIO_COLUMNS})
    return columns


def acceptance_row(layout: Layout, context: int, label: str, target, drafter, runs: DrafterRuns, plain: dict,
                   baseline: dict, acceptance: dict, budget_gib: float) -> dict:
    """One row of ``bench_acceptance`` without its bf16 ratios (``plain``/``baseline``: this target's and the bf16
    target's ``plain_and_loss`` at ``context``; ``acceptance``: ``acceptance_columns``)."""
    spec, n = runs.greedy, len(runs.greedy.tokens)
    equal = sum(a == b for a, b in zip(spec.tokens, plain["plain"].tokens))
    target_bytes, drafter_bytes = kv_bytes_per_token(target), kv_bytes_per_token(drafter)
    return {"format": layout.format, "layout": layout.name, "context": context, "drafter": label,
            "target cache": describe_target(target, layout), "drafter cache": layout.drafter_format, **acceptance,
            "lossless": equal == n, "greedy-equal prompts": f"{equal}/{n}",
            "bf16-greedy prefix": sum(map(common_prefix, spec.tokens, baseline["plain"].tokens)) / n,
            "loss nats/token": plain["loss"], "loss vs bf16": plain["loss"] - baseline["loss"],
            "bits/byte": plain["bits"], "target B/token": target_bytes, "drafter B/token": drafter_bytes,
            "kv B/token": target_bytes + drafter_bytes,
            f"tokens in {budget_gib:g} GiB": int(budget_gib * 2**30 // (target_bytes + drafter_bytes)),
            "capacity vs bf16": None,  # these two against the bf16 rows once all rows are in
            "tok/s": None, "greedy tok/s": None, "speedup vs greedy": None, "tok/s vs bf16": None, "ms/step": None}


def add_speed(row: dict, runs: DrafterRuns, plain: dict) -> None:
    """``row``'s CUDA speed columns from the timed greedy and plain runs."""
    spec = runs.greedy
    row["tok/s"] = sum(map(len, spec.tokens)) / runs.greedy_seconds
    row["greedy tok/s"] = sum(map(len, plain["plain"].tokens)) / plain["seconds"]
    row["speedup vs greedy"] = row["tok/s"] / row["greedy tok/s"]
    row["ms/step"] = 1e3 * runs.greedy_seconds / max(map(len, spec.acceptance_lengths))  # the batch's loop steps


def group_rows(layout: Layout, context: int, labels: Sequence[str], target, drafters, all_runs, plain: dict,
               baseline: dict, *, timed: bool, budget_gib: float, seed: int) -> list[dict]:
    """The rows of one layout and context, one per drafter: acceptance with its bootstrap intervals over the prompts
    and, for every drafter after the first, its ratio to the first's (paired: the same resamples for all)."""
    draws = resample_prompts(len(all_runs[0].greedy.tokens), seed=seed)
    rows = []
    for i, (label, drafter, runs) in enumerate(zip(labels, drafters, all_runs)):
        intervals = acceptance_intervals(runs, all_runs[0] if i else None, draws)
        columns = acceptance_columns(runs, intervals, labels[0] if i else None, compare=len(drafters) > 1)
        row = acceptance_row(layout, context, label, target, drafter, runs, plain, baseline, columns, budget_gib)
        if timed:
            add_speed(row, runs, plain)
        rows.append(row)
    return rows


def against_bf16(rows: list[dict]) -> None:
    """Fill ``capacity vs bf16`` and ``tok/s vs bf16``: against the bf16 row of the same context and drafter."""
    bf16 = {(r["context"], r["drafter"]): r for r in rows if r["format"] == "bf16"}
    for row in rows:
        base = bf16[(row["context"], row["drafter"])]
        row["capacity vs bf16"] = base["kv B/token"] / row["kv B/token"]
        row["tok/s vs bf16"] = row["tok/s"] / base["tok/s"] if row["tok/s"] is not None else None


def study_windows(target_dir, prompts: int, contexts: Sequence[int], new_tokens: int) -> tuple:
    """``(sorted distinct contexts, held-out windows, end-of-text id)``, or a ValueError saying why there are none."""
    contexts = sorted(set(contexts))
    limit = position_limit(target_dir)
    if limit is not None and contexts[-1] + new_tokens > limit:
        raise ValueError(f"context {contexts[-1]} + {new_tokens} new tokens exceeds the target's "
                         f"max_position_embeddings {limit}")
    tok = folder_tokenizer(target_dir)
    if tok is None:
        raise ValueError(f"{str(target_dir)!r} has no tokenizer.json to cut held-out prompts with")
    windows = heldout_windows(tok, prompts, contexts[-1], new_tokens)
    if not windows:
        raise ValueError(f"no held-out text has {contexts[-1]} + {new_tokens} tokens around a line break")
    return contexts, windows, tok.token_to_id("<|endoftext|>")


@torch.no_grad()
def bench_acceptance(target_dir, drafter_dir, *, formats: Sequence[str] = tqops.FORMATS,
                     layout_names: Sequence[str] = tuple(LAYOUTS), prompts: int = PROMPTS,
                     contexts: Sequence[int] = CONTEXTS, new_tokens: int = NEW_TOKENS, seed: int = SEED,
                     budget_gib: float = BUDGET_GIB, device=None, compile: bool = False,
                     on_row: Optional[Callable[[list[dict]], None]] = None) -> list[dict]:
    """One row per layout, context length and drafter (the bf16 baseline's rows first), columns:

    - ``drafter``: the folder (``drafter_dir`` is one, or a sequence of drafters of the same target to compare).
    - ``acceptance greedy``: mean acceptance length (tokens per step) of greedy DFlash decoding; ``lossless``: every
      continuation equals plain greedy decoding on the same cache (``greedy-equal prompts`` counts them);
      ``bf16-greedy prefix``: mean leading tokens shared with the bf16 cache's greedy continuation.
    - ``acceptance t=1``: the same at temperature 1 with rejection sampling (seeded by ``seed``).
    - ``greedy 95% lo``/``hi``, ``t=1 95% lo``/``hi``: percentile intervals of those means from ``BOOTSTRAP``
      resamples of the prompts (seeded by ``seed``; each resample pools its prompts' tokens and steps as the mean
      does). With several drafters, ``ratio to`` names the first and each later drafter's rows hold ``greedy ratio``
      and ``t=1 ratio`` (its mean over the first's) with their paired-bootstrap intervals (``... ratio 95% lo/hi``:
      both drafters' means from the same resamples); the first drafter's rows hold None there.
    - ``loss nats/token``, ``bits/byte``: the target's cross entropy on the held-out reference continuations through
      its cache (``token_losses``); ``loss vs bf16``: minus the bf16 baseline's at that context.
    - ``target B/token``, ``drafter B/token``, ``kv B/token``: KV bytes per token; ``tokens in <budget_gib> GiB``
      and ``capacity vs bf16``.
    - ``tok/s`` (speculative), ``greedy tok/s``, ``speedup vs greedy``, ``tok/s vs bf16`` (same context and
      drafter) and ``ms/step`` (speculative seconds over its decode steps): on CUDA, of one captured generate() call
      (compiled steps with ``compile``) after an untimed one, prefill included, for the layouts in
      ``TIMED_LAYOUTS``; None elsewhere (on CPU nothing is captured; the other layouts' speed is their formats', and
      timing each would double the study's runs).

    Work shared by the drafters: each layout loads its target once with every drafter on it, so its compiled steps
    (with ``compile``) serve them all, and plain decoding and the loss run once per target cache and context.
    ``on_row(rows so far)`` runs after every row, so a study cut short still leaves what it measured.

    Prompts: ``heldout_windows`` (up to ``prompts`` held-out files, all in one batch), the ``C`` tokens before each
    cut for every ``C`` in ``contexts``, ``new_tokens`` new tokens each, stopping at end-of-text.
    """
    drafter_dirs = [drafter_dir] if isinstance(drafter_dir, (str, os.PathLike)) else list(drafter_dir)
    labels = [drafter_label(d) for d in drafter_dirs]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    contexts, windows, eos = study_windows(target_dir, prompts, contexts, new_tokens)
    # captured only where timed: a capture costs seconds per row, and the untimed rows need only their tokens
    options = dict(eos_token_id=eos, compile=compile)
    tqdm.write(f"{len(windows)} held-out prompts of {', '.join(map(str, contexts))} tokens, {new_tokens} new tokens "
               f"each, {len(drafter_dirs)} drafter{'s' * (len(drafter_dirs) > 1)}, on {device}")
    plan = layouts(formats, layout_names)
    plains, rows, loaded = {}, [], None
    bar = tqdm([(layout, c) for layout in plan for c in contexts], desc="acceptance")
    for layout, context in bar:
        bar.set_postfix_str(f"{layout.format} {layout.name} {context}")
        if layout is not loaded:
            if compile:  # fresh models per layout: drop the last layout's graphs, start the recompile count over
                torch._dynamo.reset()
            target = drafters = None  # free the last layout's models and caches before loading the next
            target, drafters = load_layout(target_dir, drafter_dirs, layout, dtype, device)
            loaded = layout
        timed = device.type == "cuda" and layout.name in TIMED_LAYOUTS
        batch = [w.prompt(context) for w in windows]
        runs = [run_drafter(target, d, batch, new_tokens, timed=timed, seed=seed, options=options) for d in drafters]
        key = (layout.target_key, context)
        if key not in plains:
            plains[key] = plain_and_loss(target, windows, context, new_tokens, timed=timed, options=options)
        rows += group_rows(layout, context, labels, target, drafters, runs, plains[key],
                           plains[(plan[0].target_key, context)], timed=timed, budget_gib=budget_gib, seed=seed)
        if on_row is not None:
            on_row(rows)
    target = drafters = None
    against_bf16(rows)
    return rows


def plot_acceptance(rows: list[dict], path: str) -> None:
    """PNG against context length, one colour per format, for layout "both" (else the first measured layout): mean
    acceptance length (greedy solid, crossed where not lossless; temperature 1 dashed), the target's held-out loss
    above bf16's, and on CUDA speculative tokens/s, all of the first drafter; the other drafters' greedy acceptance
    dotted in the first panel."""
    import matplotlib  # the optional "plot" extra, imported only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    others = [r["layout"] for r in rows if r["format"] != "bf16"]
    layout = "both" if "both" in others or not others else others[0]
    drafters = list(dict.fromkeys(r.get("drafter") for r in rows))
    compared = [r for r in rows if (r["layout"] == layout or r["format"] == "bf16") and r.get("drafter") != drafters[0]]
    rows = [r for r in rows if r.get("drafter") == drafters[0]]
    shown = [r for r in rows if r["layout"] == layout or r["format"] == "bf16"]
    formats = list(dict.fromkeys(r["format"] for r in shown))
    contexts = sorted({r["context"] for r in rows})
    panels = [("acceptance greedy", "mean acceptance length (tokens per step)"),
              ("loss vs bf16", "held-out loss - bf16's (nats/token)")]
    if rows[0]["tok/s"] is not None:
        panels.append(("tok/s", "speculative tokens/s (captured)"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(8.0, 3.6 * len(panels)), sharex=True)
    for j, fmt in enumerate(formats):
        picked = sorted((r for r in shown if r["format"] == fmt), key=lambda r: r["context"])
        xs = [r["context"] for r in picked]
        for ax, (column, _) in zip(axes, panels):
            ax.plot(xs, [r[column] for r in picked], "o-", color=f"C{j}", label=fmt)
        axes[0].plot(xs, [r["acceptance t=1"] for r in picked], "s--", color=f"C{j}", alpha=0.8)
        lossy = [r for r in picked if not r["lossless"]]
        axes[0].plot([r["context"] for r in lossy], [r["acceptance greedy"] for r in lossy], "kx", markersize=9)
        for k, drafter in enumerate(drafters[1:]):
            theirs = sorted((r for r in compared if r["format"] == fmt and r.get("drafter") == drafter),
                            key=lambda r: r["context"])
            axes[0].plot([r["context"] for r in theirs], [r["acceptance greedy"] for r in theirs],
                         "^v<>"[k % 4] + ":", color=f"C{j}", alpha=0.9)
    for ax, (_, label) in zip(axes, panels):
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_title(f"DFlash decoding on held-out stdlib code, layout {layout!r}: {LAYOUTS[layout]}"
                      + (f"\ndrafter {drafters[0]} (others: greedy, dotted)" if len(drafters) > 1 else ""),
                      fontsize=10 if len(drafters) > 1 else None)
    styles = [Line2D([], [], color="gray", linestyle="-", marker="o", label="greedy"),
              Line2D([], [], color="gray", linestyle="--", marker="s", label="temperature 1"),
              Line2D([], [], color="k", linestyle="", marker="x", label="greedy not lossless")]
    styles += [Line2D([], [], color="gray", linestyle=":", marker="^v<>"[k % 4], label=f"greedy, {drafter}")
               for k, drafter in enumerate(drafters[1:])]
    axes[0].legend(handles=styles, fontsize=8, loc="best")
    axes[1].legend(fontsize=8, loc="best")
    axes[-1].set_xscale("log", base=2)
    axes[-1].set_xticks(contexts, [str(c) for c in contexts])
    axes[-1].minorticks_off()
    axes[-1].set_xlabel("context (prompt tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser) -> None:
    """The acceptance benchmark's flags (on ``python -m tqops.bench``'s parser)."""
    parser.add_argument("--target", default=None, help="acceptance: Qwen3 target folder with tokenizer.json "
                                                       f"(default: {os.path.relpath(TRAINED_DIR)}/target)")
    parser.add_argument("--draft", default=None,
                        help="acceptance: DFlash or DFlash2 drafter folder (default: the shipped one), or several, "
                             "comma-separated, of the same target, to compare them: rows for each drafter, and each "
                             "later drafter's greedy and t=1 acceptance over the first's with a paired-bootstrap 95%% "
                             "interval over the prompts (e.g. --draft tqops/pretrained/stdlib-py/drafter,d2/); every "
                             "layout loads its target once for all of them")
    parser.add_argument("--formats", default=",".join(tqops.FORMATS), help="acceptance: comma-separated formats")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help="acceptance: comma-separated layouts: "
                             + "; ".join(f"{name}: {what}" for name, what in LAYOUTS.items()))
    parser.add_argument("--prompts", type=int, default=PROMPTS,
                        help="acceptance: held-out prompts (one batch); the 95%% intervals of acceptance are "
                             f"percentile intervals over {BOOTSTRAP} resamples of them")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                        help="acceptance: comma-separated prompt lengths in tokens (each + --new-tokens within the "
                             "target's max_position_embeddings; default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="acceptance: new tokens per prompt")
    parser.add_argument("--seed", type=int, default=SEED, help="acceptance: seed of the temperature-1 sampling")
    parser.add_argument("--budget-gib", type=float, default=BUDGET_GIB, help="acceptance: KV memory budget")
    parser.add_argument("--device", default=None, help="acceptance: cpu or cuda (default: cuda when present)")
    parser.add_argument("--compile", action="store_true",
                        help="acceptance: compile the timed steps (greedy speculative and plain) before capturing "
                             "them (CUDA; each layout compiles its own, the temperature-1 runs stay eager)")


def parse_contexts(parser: Parser, text: str) -> tuple[int, ...]:
    """``--contexts``' sorted distinct token counts, or a one-line error."""
    try:
        contexts = sorted({int(c) for c in text.split(",")})
    except ValueError:
        parser.error(f"--contexts: expected comma-separated token counts, got {text!r}")
    if contexts[0] < 1:
        parser.error(f"--contexts must all be >= 1, got {text!r}")
    return tuple(contexts)


def check_arguments(parser: Parser, args) -> None:
    """Reject bad acceptance flags, and a missing trained pair, with one line before anything runs; ``args.contexts``
    becomes a tuple of ints."""
    for flag in ("prompts", "new_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not (math.isfinite(args.budget_gib) and args.budget_gib > 0):
        parser.error(f"--budget-gib must be a positive finite number, got {args.budget_gib}")
    args.contexts = parse_contexts(parser, args.contexts)
    args.device = str(device_or_exit(parser, args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    if args.compile and not args.device.startswith("cuda"):
        parser.error(f"--compile needs a CUDA device (it compiles the captured CUDA steps); got --device {args.device}")
    subset_or_exit(parser, "--formats", args.formats, tqops.FORMATS)
    subset_or_exit(parser, "--layouts", args.layouts, LAYOUTS)
    if bool(args.target) != bool(args.draft):
        parser.error("--target and --draft go together (a drafter reads the hidden states of its own target)")
    if not args.target:
        pair = trained_pair()
        if pair is None:
            parser.error(f"not trained yet: run {train_command()} (or pass --target and --draft)")
        args.target, args.draft = map(str, pair)
    args.drafts = args.draft.split(",")
    if not all(args.drafts):
        parser.error(f"--draft: expected comma-separated drafter folders, got {args.draft!r}")
    for flag, path in (("--target", args.target), *(("--draft", d) for d in args.drafts)):
        if not has_weights(path):
            parser.error(f"{flag} {path!r} has no config.json and safetensors weights")
    if not (Path(args.target) / "tokenizer.json").is_file():
        parser.error(f"--target {args.target!r} has no tokenizer.json (the held-out prompts are cut with it)")
    limit = load_or_exit(parser, "--target", args.target, position_limit, what="unreadable config.json")
    if limit is not None and args.contexts[-1] + args.new_tokens > limit:
        parser.error(f"--contexts {args.contexts[-1]} + --new-tokens {args.new_tokens} exceeds the target's "
                     f"max_position_embeddings {limit}")
    check_pair(parser, args)


def check_pair(parser: Parser, args) -> None:
    """The tokenizer loads and the pair's configs make a target and drafters that fit it (built on the meta device,
    no weights read), so a broken --target or --draft is one line before the study rather than a traceback after its
    first rows."""
    tok = load_or_exit(parser, "--target", args.target, folder_tokenizer, errors=(Exception,),
                       what="unreadable tokenizer.json")
    if tok is None:
        parser.error(f"--target {args.target!r}: tokenizer.json needs the tokenizers package (pip install tokenizers)")
    _, target = checkpoint_config_or_exit(parser, "--target", args.target, "a Qwen3 target checkpoint")
    for drafter in args.drafts:
        drafter_config_or_exit(parser, "--draft", drafter, target)


def run(args) -> list[dict]:
    """``bench_acceptance`` with the command line's flags (checked by ``check_arguments``); with ``--out`` it
    rewrites ``acceptance.json`` after every row, so a run cut short keeps its rows."""
    def save(rows):
        with open(os.path.join(args.out, "acceptance.json"), "w") as f:
            json.dump(rows, f, indent=1)

    return bench_acceptance(args.target, args.drafts, formats=args.formats.split(","),
                            layout_names=args.layouts.split(","), prompts=args.prompts, contexts=args.contexts,
                            new_tokens=args.new_tokens, seed=args.seed, budget_gib=args.budget_gib,
                            device=args.device, compile=args.compile, on_row=save if args.out else None)
