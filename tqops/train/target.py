"""Target stage: a small Qwen3 causal LM (transformers' own classes) trained on packed stdlib source, saved in bf16."""
from __future__ import annotations

import dataclasses
import math
import shutil
import time
from pathlib import Path
import torch
import torch.nn.functional as F
from torch import nn

from .data import PackedBatches, corpus_splits, eval_batches
from .loop import LoopConfig, RunOptions, seed_everything, summarize, train_loop
from .report import LOG_FILE, PLOT_FILE, jsonable, plot_or_warn, write_json
from .tokenizer import FILES as TOKENIZER_FILES, SHIPPED_DIR, load_tokenizer, special_ids

MAX_SHARD_SIZE = "15MB"  # transformers reads this as 15 * 10**6 bytes per weight file


@dataclasses.dataclass
class TargetShape:
    """Qwen3 dimensions. The default: 11.0M parameters (22.0 MB in bf16), head_dim 64 as tqops' attention needs."""

    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0


@dataclasses.dataclass
class TargetOptions:
    out: Path
    tokenizer: Path = SHIPPED_DIR
    shape: TargetShape = dataclasses.field(default_factory=TargetShape)
    # about 30 passes over the corpus is where repeated data stops paying (Muennighoff et al. 2023 find returns
    # fading past ~16 epochs without dropout); the best validation checkpoint is kept either way
    run: RunOptions = dataclasses.field(
        default_factory=lambda: RunOptions(LoopConfig(lr=2e-3, minutes=8.0, max_epochs=30.0)))
    # residual dropout: transformers' Qwen3 has none, and the run sees the ~3M-token corpus tens of times
    dropout: float = 0.1


def target_config(shape: TargetShape, vocab_size: int, ids: dict):
    """A ``transformers.Qwen3Config`` with tied embeddings and the tokenizer's special ids."""
    import transformers

    return transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=True, use_cache=False,
        bos_token_id=ids["eos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
    )


def build_target(config) -> nn.Module:
    """``transformers.Qwen3ForCausalLM(config)`` with transformers' initialization, fp32."""
    import transformers

    return transformers.Qwen3ForCausalLM(config).float()


def add_residual_dropout(model: nn.Module, p: float) -> list:
    """Dropout on every attention and MLP output before it joins the residual stream (training mode only)."""
    def drop(module, args, output):
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, module.training),) + tuple(output[1:])
        return F.dropout(output, p, module.training)

    if p <= 0:
        return []
    return [m.register_forward_hook(drop) for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]


def causal_lm_loss(model: nn.Module, ids: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy of ``ids`` ``[B, T]`` (fp32 over the logits), ``reduction`` as in F.cross_entropy."""
    logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction=reduction)


def mean_loss(model: nn.Module, batches, device, autocast) -> float:
    """Token-weighted mean next-token loss over ``batches``."""
    total, count = torch.zeros((), device=device, dtype=torch.float64), 0
    for batch in batches:
        ids = batch.to(device)
        with autocast():
            total += causal_lm_loss(model, ids, reduction="sum").double()
        count += ids[:, 1:].numel()
    return total.item() / max(1, count)


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA; fp32 elsewhere (CPU runs are tests and smoke runs)."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return lambda: torch.autocast("cpu", enabled=False)


def save_target(model: nn.Module, out: Path, tokenizer_dir: Path) -> list[Path]:
    """bf16 ``save_pretrained`` (no weight file over ``MAX_SHARD_SIZE``) plus the tokenizer files, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size=MAX_SHARD_SIZE)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).resolve() != (out / name).resolve():  # training into the shipped folder
            shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    return sorted(out.iterdir())


def train_target(opts: TargetOptions) -> dict:
    """Train, keep the weights of the lowest validation loss, save them with log and plot; returns the summary."""
    started, run = time.perf_counter(), opts.run
    seed_everything(run.seed)
    device = torch.device(run.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    tok = load_tokenizer(opts.tokenizer)
    ids = special_ids(tok)
    data = corpus_splits(tok, ids["eos"], run.train_files, run.eval_files)
    config = target_config(opts.shape, tok.get_vocab_size(), ids)
    model = build_target(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    hooks = add_residual_dropout(model, opts.dropout)
    autocast = autocast_for(device)
    compiled_model = torch.compile(model) if run.loop.compile else None

    def step(batch, compiled):
        with autocast():
            return causal_lm_loss(compiled_model if compiled else model, batch.to(device, non_blocking=True))

    evals = {k: eval_batches(data["docs"][k], run.seq_len, run.eval_batch_size) for k in ("valid", "heldout")}
    if not all(evals.values()):
        raise ValueError("the validation or held-out texts are empty")

    def evaluate():
        return {f"{k}_loss": round(mean_loss(model, b, device, autocast), 5) for k, b in evals.items()}

    batches = PackedBatches(data["docs"]["train"], run.seq_len, run.batch_size, seed=run.seed)
    steps_per_epoch = batches.tokens / (run.seq_len * run.batch_size)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    log = {"stage": "target", "title": f"Qwen3 target, {n_params / 1e6:.2f}M parameters",
           "options": jsonable(opts), "config": config.to_dict(), "parameters": n_params,
           "data": {k: v for k, v in data.items() if k != "docs"}}
    result = train_loop(model, step, batches, evaluate, "valid_loss", run.loop, device,
                        epoch_of=lambda: batches.epoch, steps_per_epoch=steps_per_epoch,
                        on_eval=lambda partial: write_json(out / LOG_FILE, {**log, **partial}), desc="target")
    for h in hooks:
        h.remove()
    tokens_per_step = run.seq_len * run.batch_size
    heldout = result.best["heldout_loss"]
    summary = {
        **summarize(result, steps_per_epoch),
        "tokens_per_second": round(tokens_per_step / result.step_seconds) if result.step_seconds else None,
        # nats per predicted token times tokens per byte, in bits (sequence starts are not predicted: approximate)
        "heldout_bits_per_byte": round(heldout * data["tokens"]["heldout"] / data["bytes"]["heldout"] / math.log(2), 4),
        "heldout_chars_per_token": round(data["chars"]["heldout"] / data["tokens"]["heldout"], 3),
        "parameters": n_params,
    }
    files = save_target(model, out, opts.tokenizer)
    summary["weight_bytes"] = sum(f.stat().st_size for f in files if f.suffix == ".safetensors")
    summary["seconds"] = round(time.perf_counter() - started, 1)
    log.update(result=summary, train=result.train, evals=result.evals)
    write_json(out / LOG_FILE, log)
    plot_or_warn(log, out / PLOT_FILE)
    return summary

