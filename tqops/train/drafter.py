"""Drafter stage: a DFlash drafter trained on a frozen target's hidden states, saved in the z-lab layout (bf16)."""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ..models.hooks import layer_outputs
from ..models.loading import read_config
from .data import PackedBatches, corpus_splits, eval_sequences
from .distill import SequenceBatches, greedy_anchor_range, greedy_sequences
from .dflash import (DenseDFlashDrafter, block_labels, draft_accuracy, drafter_config, position_weights, sample_anchors,
                     spread_layer_ids)
from .dflash2 import ARCHES, SELECTOR_LOSS_WEIGHT, DenseDFlash2Drafter, DFlash2Settings, dflash2_config
from .loop import LoopConfig, RunOptions, seed_everything, summarize, train_loop
from .report import LOG_FILE, PLOT_FILE, jsonable, plot_or_warn, write_json
from .target import MAX_SHARD_SIZE, autocast_for
from .tokenizer import load_tokenizer, special_ids

EVAL_SEED = 1234  # the evaluation's anchors: the same at every evaluation and in every run


@dataclasses.dataclass
class DrafterOptions:
    target: Path
    out: Path
    num_layers: int = 2
    target_layer_ids: Optional[tuple] = None  # default: 3 layers spread over the target (spread_layer_ids)
    arch: str = "dflash"  # one of ARCHES; "dflash2": z-lab's DFlash2DraftModel (convolutions, candidate selector)
    dflash2: Optional[DFlash2Settings] = None  # arch "dflash2"'s settings (None: DFlash2Settings())
    selector_loss_weight: float = SELECTOR_LOSS_WEIGHT  # arch "dflash2": times the selector's loss, added
    intermediate_size: Optional[int] = None  # the drafter's MLP width (None: the target's, as z-lab's drafters)
    block_size: int = 16
    blocks_per_sequence: int = 128
    loss_decay: float = 7.0  # DFlash's gamma for 16-token blocks
    run: RunOptions = dataclasses.field(default_factory=lambda: RunOptions(LoopConfig(lr=2e-3, minutes=8.0)))
    # "greedy": train and evaluate on the target's greedy continuations of corpus prompts (distill.py says why);
    # "corpus": on the corpus text itself
    data: str = "greedy"
    greedy_sequences: int = 16384  # at most this many train sequences of run.seq_len tokens
    greedy_minutes: float = 1.5  # no generation batch starts after this (the step budget is run.loop.minutes)
    greedy_batch_size: int = 1024
    greedy_new_tokens: int = 256  # generated after each prompt (prompts are 16 .. seq_len - this tokens)
    greedy_eval_sequences: int = 128  # per evaluation split
    accept_prompts: int = 8  # held-out prompts for the acceptance run after training (0: none)
    accept_prompt_tokens: int = 128
    accept_new_tokens: int = 128


class TargetStates:
    """The target's ``hidden_states[i + 1]`` for ``i`` in ``layer_ids`` (the last layer's after the final norm, as
    tqops' target and z-lab's DFlash give them), concatenated in that order: ``states(input_ids [B, T])`` ->
    ``[B, T, len(layer_ids) * hidden]``."""

    def __init__(self, model: nn.Module, layer_ids):
        self.model, self.layer_ids = model, tuple(layer_ids)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        with layer_outputs(self.model.model, self.layer_ids) as outputs:
            self.model.model(input_ids=input_ids, use_cache=False)
        return torch.cat([outputs[i] for i in self.layer_ids], -1)


def load_frozen_target(path, device: torch.device) -> nn.Module:
    """The transformers Qwen3 target, eval mode, no gradients; bf16 on CUDA (as saved), fp32 elsewhere."""
    import transformers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    return model


def build_drafter(opts: DrafterOptions, target_raw: dict, layer_ids, mask_token_id: int) -> DenseDFlashDrafter:
    """The untrained training model ``opts.arch`` names for the target of config ``target_raw`` (its MLP
    ``opts.intermediate_size`` wide where given, else the target's)."""
    kwargs = dict(num_layers=opts.num_layers, target_layer_ids=layer_ids, mask_token_id=mask_token_id,
                  block_size=opts.block_size)
    if opts.intermediate_size is not None:  # drafter_config copies the target's width
        target_raw = dict(target_raw, intermediate_size=int(opts.intermediate_size))
    if opts.arch == "dflash":
        return DenseDFlashDrafter(drafter_config(target_raw, **kwargs))
    if opts.arch == "dflash2":
        return DenseDFlash2Drafter(dflash2_config(target_raw, opts.dflash2 or DFlash2Settings(), **kwargs))
    raise ValueError(f"unknown drafter arch {opts.arch!r} (one of {ARCHES})")


def total_loss(losses: dict, selector_weight: float) -> torch.Tensor:
    """The block loss plus ``selector_weight`` times the selector's (when the drafter has one)."""
    loss = losses["block"]
    return loss + selector_weight * losses["selector"] if "selector" in losses else loss


def save_drafter(drafter: DenseDFlashDrafter, out: Path) -> list[Path]:
    """config.json plus bf16 safetensors (sharded above ``MAX_SHARD_SIZE``) under the z-lab names."""
    from huggingface_hub import save_torch_state_dict

    out.mkdir(parents=True, exist_ok=True)
    # copies: the parts of a merged projection are views of one tensor, and safetensors refuses shared memory
    state = {k: v.detach().to("cpu", torch.bfloat16, copy=True) for k, v in drafter.state_dict().items()}
    save_torch_state_dict(state, out, max_shard_size=MAX_SHARD_SIZE)
    write_json(out / "config.json", drafter.raw_config)
    return sorted(out.iterdir())


@dataclasses.dataclass
class DrafterSetup:
    """What every part of the drafter stage works with: the frozen target, its tokenizer's special ids, the drafter
    being trained (on ``device``) and the pieces of its loss."""

    device: torch.device
    target: nn.Module
    tok: object
    ids: dict
    layer_ids: tuple
    drafter: DenseDFlashDrafter
    states_of: TargetStates
    weights: torch.Tensor  # the block positions' loss weights
    autocast: Callable


@dataclasses.dataclass
class DrafterData:
    """The stage's data: ``data`` (the corpus split's statistics, its documents under "docs", the greedy generation's
    under "greedy"), the ``evals`` sequences per split (``(input_ids, first allowed anchor or None)``), their
    anchors, and the training ``batches`` (``PackedBatches`` or ``SequenceBatches``)."""

    data: dict
    evals: dict
    eval_anchors: dict
    batches: object

    def train_batches(self, greedy: bool):
        """``(input_ids, first allowed anchor or None)`` from either source, as ``step`` takes them."""
        return self.batches if greedy else ((b, None) for b in self.batches)


def set_up(opts: DrafterOptions) -> DrafterSetup:
    """Seed, load the frozen target and its tokenizer, and build the initialized drafter on the run's device."""
    run = opts.run
    seed_everything(run.seed)
    device = torch.device(run.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    target = load_frozen_target(opts.target, device)
    target_raw = read_config(opts.target)
    tok = load_tokenizer(opts.target)
    ids = special_ids(tok)
    layer_ids = opts.target_layer_ids or spread_layer_ids(target_raw["num_hidden_layers"])
    drafter = build_drafter(opts, target_raw, layer_ids, ids["mask"])
    drafter.init_weights(torch.Generator().manual_seed(run.seed))
    drafter.to(device)
    return DrafterSetup(device, target, tok, ids, layer_ids, drafter, TargetStates(target, layer_ids),
                        position_weights(opts.block_size, opts.loss_decay, device), autocast_for(device))


def loss_functions(setup: DrafterSetup, opts: DrafterOptions) -> tuple[Callable, Callable]:
    """``(outputs, loss_of)``: the hidden states and logits of the blocks' mask rows, ``[B, K, bs - 1, H]`` and
    ``[B, K, bs - 1, V]``, and the total loss, each of ``(states, input_ids, anchors)``."""
    drafter = setup.drafter
    embed, lm_head = setup.target.get_input_embeddings(), setup.target.get_output_embeddings()

    def outputs(states, input_ids, anchors):
        hidden = drafter(states, input_ids, anchors, embed)[:, :, 1:]
        return hidden, lm_head(hidden)

    def loss_of(states, input_ids, anchors):
        losses = drafter.losses(*outputs(states, input_ids, anchors), input_ids, anchors, setup.weights)
        return total_loss(losses, opts.selector_loss_weight)

    return outputs, loss_of


def training_step(setup: DrafterSetup, opts: DrafterOptions, loss_of: Callable) -> Callable:
    """``step(batch, compiled)`` for ``train_loop``: the target's states of the batch, fresh anchors, the loss
    (``torch.compile``d where the loop compiles)."""
    compiled_loss = torch.compile(loss_of) if opts.run.loop.compile else None

    def step(batch, compiled):
        input_ids, bounds = batch
        input_ids = input_ids.to(setup.device, non_blocking=True)
        with setup.autocast():
            states = setup.states_of(input_ids)
            anchors = sample_anchors(len(input_ids), input_ids.shape[1], opts.blocks_per_sequence, opts.block_size,
                                     setup.device, bounds=bounds)
            return (compiled_loss if compiled else loss_of)(states, input_ids, anchors)

    return step


def greedy_data(setup: DrafterSetup, opts: DrafterOptions, data: dict) -> dict:
    """The target's greedy continuations of each split's prompts, ``{split: (sequences, first allowed anchors)}``
    (the train split's within ``greedy_minutes``); their counts and seconds go to ``data["greedy"]``."""
    run, generated = opts.run, {}
    for k, count in (("train", opts.greedy_sequences), ("valid", opts.greedy_eval_sequences),
                     ("heldout", opts.greedy_eval_sequences)):
        started_k = time.perf_counter()
        seqs, prompt_lens = greedy_sequences(
            setup.target, data["docs"][k], count=count, seq_len=run.seq_len, new_tokens=opts.greedy_new_tokens,
            batch_size=opts.greedy_batch_size, seed=run.seed + len(generated), device=setup.device,
            pad_id=setup.ids["pad"], minutes=opts.greedy_minutes if k == "train" else None, desc=f"greedy {k} data")
        generated[k] = (seqs, greedy_anchor_range(prompt_lens, opts.greedy_new_tokens, opts.block_size))
        data.setdefault("greedy", {})[k] = {"sequences": len(seqs), "tokens": int(seqs.numel()),
                                            "seconds": round(time.perf_counter() - started_k, 1)}
    return generated


def training_data(setup: DrafterSetup, opts: DrafterOptions) -> DrafterData:
    """The corpus split, then the training batches and evaluation sequences of ``opts.data``'s source, and the
    evaluations' anchors (the same at every evaluation and in every run: ``EVAL_SEED``)."""
    run = opts.run
    data = corpus_splits(setup.tok, setup.ids["eos"], run.train_files, run.eval_files)
    if opts.data == "greedy":
        generated = greedy_data(setup, opts, data)
        evals = {k: list(zip(*generated[k])) for k in ("valid", "heldout")}
        batches = SequenceBatches(*generated["train"], run.batch_size, seed=run.seed)
    else:
        evals = {k: [(s, None) for s in eval_sequences(data["docs"][k], run.seq_len) if len(s) == run.seq_len]
                 for k in ("valid", "heldout")}
        batches = PackedBatches(data["docs"]["train"], run.seq_len, run.batch_size, seed=run.seed)
    if not all(evals.values()):
        raise ValueError(f"the validation or held-out texts hold no full {run.seq_len}-token sequence")
    gen = torch.Generator().manual_seed(EVAL_SEED)
    eval_anchors = {k: sample_anchors(len(v), run.seq_len, opts.blocks_per_sequence, opts.block_size, generator=gen,
                                      bounds=None if v[0][1] is None else torch.stack([b for _, b in v]))
                    for k, v in evals.items()}
    return DrafterData(data, evals, eval_anchors, batches)


def evaluator(setup: DrafterSetup, opts: DrafterOptions, outputs: Callable, data: DrafterData) -> Callable:
    """``evaluate()`` for ``train_loop``: each split's loss (and, for DFlash2, its block and selector losses), and
    on the held-out split the first draft's top-1 accuracy and the teacher-forced acceptance length."""
    run, drafter = opts.run, setup.drafter

    def evaluate():
        out = {}
        for k, seqs in data.evals.items():
            loss, parts, acc, accept = 0.0, {}, 0.0, 0.0
            for i in range(0, len(seqs), run.eval_batch_size):
                input_ids = torch.stack([ids for ids, _ in seqs[i:i + run.eval_batch_size]]).to(setup.device)
                anchors = data.eval_anchors[k][i:i + run.eval_batch_size].to(setup.device)
                with setup.autocast():
                    hidden, logits = outputs(setup.states_of(input_ids), input_ids, anchors)
                    drafts = drafter.drafts(hidden, logits, input_ids, anchors)
                    losses = drafter.losses(hidden, logits, input_ids, anchors, setup.weights)
                share = len(input_ids) / len(seqs)
                loss += total_loss(losses, opts.selector_loss_weight).item() * share
                for name, value in losses.items():
                    parts[name] = parts.get(name, 0.0) + value.item() * share
                per_position, accepted = draft_accuracy(drafts, block_labels(input_ids, anchors, opts.block_size))
                acc += per_position[0].item() * share
                accept += accepted.item() * share
            out[f"{k}_loss"] = round(loss, 5)
            if len(parts) > 1:  # DFlash2: the block and selector losses apart as well
                out.update({f"{k}_{name}_loss": round(v, 5) for name, v in parts.items()})
            if k == "heldout":
                out.update(heldout_top1_first=round(acc, 4), heldout_accept_len=round(accept, 3))
        return out

    return evaluate


def stage_log(opts: DrafterOptions, setup: DrafterSetup, data: DrafterData) -> dict:
    """The training log's head: the stage, its title, options, drafter config, parameter count and data."""
    n_params = sum(p.numel() for p in setup.drafter.parameters())
    name = "DFlash2" if opts.arch == "dflash2" else "DFlash"
    return {"stage": "drafter", "title": f"{name} drafter, {n_params / 1e6:.2f}M parameters, target layers "
            f"{list(setup.layer_ids)}", "options": jsonable(opts), "config": setup.drafter.raw_config,
            "parameters": n_params, "data": {k: v for k, v in data.data.items() if k != "docs"}}


def acceptance_or_error(opts: DrafterOptions, out: Path, device: torch.device) -> dict:
    """``measure_acceptance`` of the saved drafter, or why it failed (the drafter stays saved either way)."""
    from .accept import measure_acceptance

    try:
        return measure_acceptance(opts.target, out, prompts=opts.accept_prompts,
                                  prompt_tokens=opts.accept_prompt_tokens, new_tokens=opts.accept_new_tokens,
                                  device=device)
    except Exception as e:  # noqa: BLE001  (the trained drafter is saved; say why the measurement failed)
        print(f"acceptance run failed: {type(e).__name__}: {e}", file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"}


def train_drafter(opts: DrafterOptions) -> dict:
    """Train on the frozen target, keep the weights of the lowest validation loss, save them with log and plot, then
    (``accept_prompts`` > 0) measure acceptance with tqops' generate(); returns the summary."""
    started, run = time.perf_counter(), opts.run
    setup = set_up(opts)
    outputs, loss_of = loss_functions(setup, opts)
    step = training_step(setup, opts, loss_of)
    data = training_data(setup, opts)
    evaluate = evaluator(setup, opts, outputs, data)
    steps_per_epoch = data.batches.tokens / (run.seq_len * run.batch_size)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    log = stage_log(opts, setup, data)
    result = train_loop(setup.drafter, step, data.train_batches(opts.data == "greedy"), evaluate, "valid_loss",
                        run.loop, setup.device, epoch_of=lambda: data.batches.epoch, steps_per_epoch=steps_per_epoch,
                        on_eval=lambda partial: write_json(out / LOG_FILE, {**log, **partial}), desc="drafter")
    blocks_per_step = run.batch_size * opts.blocks_per_sequence
    summary = {
        **summarize(result, steps_per_epoch),
        "blocks_per_second": round(blocks_per_step / result.step_seconds) if result.step_seconds else None,
        "parameters": log["parameters"],
    }
    files = save_drafter(setup.drafter, out)
    summary["weight_bytes"] = sum(f.stat().st_size for f in files if f.suffix == ".safetensors")
    log.update(result=summary, train=result.train, evals=result.evals)
    write_json(out / LOG_FILE, log)
    plot_or_warn(log, out / PLOT_FILE)
    if opts.accept_prompts > 0:
        summary["acceptance"] = acceptance_or_error(opts, out, setup.device)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    write_json(out / LOG_FILE, log)
    return summary
