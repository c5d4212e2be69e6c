"""The training loop both stages share: AdamW, warmup + cosine, a step count or a wall-clock budget, evaluations."""
from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

# step(batch, compiled) -> the loss to backpropagate; evaluate() -> {metric name: value}
StepFn = Callable[[torch.Tensor, bool], torch.Tensor]
EvalFn = Callable[[], dict]


@dataclasses.dataclass
class LoopConfig:
    """Optimizer, schedule and length of a run: ``steps`` fixed, or planned from ``minutes`` (the loop's wall time,
    compilation and evaluations included) after timing ``probe_steps`` steps, at most ``max_epochs`` epochs."""

    lr: float
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    steps: Optional[int] = None
    minutes: Optional[float] = None
    max_epochs: Optional[float] = None
    evals: int = 30
    probe_steps: int = 10
    compile: bool = False

    def __post_init__(self):
        if (self.steps is None) == (self.minutes is None):
            raise ValueError("give exactly one of steps and minutes")


@dataclasses.dataclass
class RunOptions:
    """What both stages' runs share: the loop, the packed sequences, the device and seed, and (for tests) how many
    files of each split to read."""

    loop: LoopConfig
    seq_len: int = 2048
    batch_size: int = 16
    eval_batch_size: int = 16
    device: str = "cuda"
    seed: int = 0
    train_files: Optional[int] = None  # only the first N files of each split (tests)
    eval_files: Optional[int] = None


@dataclasses.dataclass
class LoopResult:
    steps: int
    planned_steps: int
    stopped_early: bool  # the wall-clock budget ran out before the planned steps
    diverged_at: Optional[int]  # the first step whose loss was not finite (training stopped there)
    compiled: bool
    seconds: float
    step_seconds: float  # mean over the steps after the first (compilation) ones, evaluations left out
    best_step: int
    best: dict  # evaluation metrics at best_step (the weights the model holds on return)
    final: dict  # evaluation metrics after the last step
    train: list  # [step, loss, lr] per step
    evals: list  # {"step", "epoch", "seconds", **metrics} per evaluation


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_at(step: int, cfg: LoopConfig, total: Optional[int]) -> float:
    """Linear warmup over ``warmup_steps`` (shortened to a tenth of a short run), then cosine to ``min_lr_ratio``."""
    warmup = cfg.warmup_steps if total is None else max(1, min(cfg.warmup_steps, total // 10))
    if step < warmup or total is None:
        return cfg.lr * min(1.0, (step + 1) / warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw(model: nn.Module, cfg: LoopConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only: not on norm gains and biases, nor on DFlash2's ``[2, kernel,
    hidden]`` convolution base kernels, per-channel gains that start at the identity as norm gains start at 1."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() == 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=device.type == "cuda")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _snapshot(model: nn.Module) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class _Run:
    """One ``train_loop`` run's records and clocks: the step losses, the evaluations and the best weights, and the
    step timing that plans a wall-clock budget."""

    warm = 3  # steps kept out of the timing (compilation, allocator warm-up)

    def __init__(self, model: nn.Module, evaluate: EvalFn, select: str, cfg: LoopConfig, device,
                 epoch_of: Callable[[], float], steps_per_epoch: Optional[float],
                 on_eval: Optional[Callable[[dict], None]]):
        self.start = time.perf_counter()
        self.model, self.evaluate, self.select, self.cfg = model, evaluate, select, cfg
        self.epoch_of, self.steps_per_epoch, self.on_eval = epoch_of, steps_per_epoch, on_eval
        self.device = torch.device(device)
        self.opt = adamw(model, cfg, self.device)
        self.budget = cfg.minutes * 60 if cfg.minutes is not None else None
        self.train, self.evals = [], []
        self.pending: list = []  # detached step losses, read in bulk so the loop does not sync every step
        self.best_value, self.best_state, self.best_step, self.best = math.inf, None, 0, {}
        self.eval_seconds = 0.0  # all evaluations so far, kept out of the step timing
        self.probe_start, self.probe_evals = None, 0.0

    def run_eval(self, at: int) -> None:
        """Evaluate after step ``at``, keeping a copy of the weights if its ``select`` metric is the lowest yet."""
        t0 = time.perf_counter()
        self.model.eval()
        with torch.no_grad():
            metrics = self.evaluate()
        self.model.train()
        _sync(self.device)
        seconds = time.perf_counter() - t0
        self.eval_seconds += seconds
        self.evals.append({"step": at, "epoch": round(self.epoch_of(), 4),
                           "seconds": round(time.perf_counter() - self.start, 2), **metrics})
        if metrics[self.select] < self.best_value:
            self.best_value, self.best_state, self.best_step, self.best = (metrics[self.select],
                                                                           _snapshot(self.model), at, metrics)
        if self.on_eval is not None:
            self.on_eval({"train": self.train, "evals": self.evals})

    def flush(self) -> Optional[int]:
        """Record the pending losses; the first step whose loss is not finite, if any."""
        pending = self.pending
        values = torch.stack([loss for loss, _, _ in pending]).float().cpu().tolist() if pending else []
        self.train.extend([s, round(v, 5), lr] for (_, s, lr), v in zip(pending, values))
        bad = next((s for (_, s, _), v in zip(pending, values) if not math.isfinite(v)), None)
        pending.clear()
        return bad

    def out_of_time(self) -> bool:
        return self.budget is not None and time.perf_counter() - self.start > self.budget

    def start_probe(self) -> None:
        """Start the step timing (after the first ``warm`` steps)."""
        _sync(self.device)
        self.probe_start, self.probe_evals = time.perf_counter(), self.eval_seconds

    def seconds_per_step(self, n: int) -> float:
        """Mean wall time of the steps since the first ``warm``, evaluations left out (syncs the device)."""
        _sync(self.device)
        return (time.perf_counter() - self.probe_start - (self.eval_seconds - self.probe_evals)) / (n - self.warm)

    def eval_count(self) -> int:
        """Evaluations for a budgeted run: at most a tenth of what is left, fewer of them where they are slow."""
        left = self.budget - (time.perf_counter() - self.start)
        return max(1, min(self.cfg.evals, int(0.1 * left * len(self.evals) / max(self.eval_seconds, 1e-9))))

    def plan(self, n: int, per_step: float, evals_left: int) -> int:
        """The step count that fits what is left of the budget after ``evals_left`` evaluations, at most
        ``max_epochs``; re-planned at every evaluation, so a slower or faster stretch moves the cosine's end."""
        left = self.budget - (time.perf_counter() - self.start) - evals_left * self.eval_seconds / len(self.evals)
        planned = n + max(1, int(0.98 * left / per_step))
        if self.cfg.max_epochs is not None and self.steps_per_epoch:
            planned = max(n, min(planned, int(self.cfg.max_epochs * self.steps_per_epoch)))
        return planned

    def result(self, n: int, total: Optional[int], stopped_early: bool, diverged_at: Optional[int], compiled: bool,
               step_seconds: float) -> LoopResult:
        """The last losses recorded and a final evaluation; the model left with the best evaluation's weights."""
        diverged_at = diverged_at or self.flush()
        if n > self.warm:
            step_seconds = self.seconds_per_step(n)
        self.run_eval(n)
        final = self.evals[-1]
        best_step, best = self.best_step, self.best
        if self.best_state is not None:
            self.model.load_state_dict(self.best_state)
        else:  # no evaluation had a finite selection metric: keep the last weights
            best_step, best = n, {k: v for k, v in final.items() if k not in ("step", "epoch", "seconds")}
        return LoopResult(steps=n, planned_steps=total if total is not None else n, stopped_early=stopped_early,
                          diverged_at=diverged_at, compiled=compiled,
                          seconds=round(time.perf_counter() - self.start, 2), step_seconds=step_seconds,
                          best_step=best_step, best=best,
                          final={k: v for k, v in final.items() if k not in ("step", "epoch", "seconds")},
                          train=self.train, evals=self.evals)


def _fixed_total(cfg: LoopConfig, steps_per_epoch: Optional[float]) -> Optional[int]:
    """The step count of a run of ``cfg.steps`` (at most ``max_epochs``); None for a budgeted run, planned later."""
    total = cfg.steps
    if total is not None and cfg.max_epochs is not None and steps_per_epoch:
        total = max(1, min(total, int(cfg.max_epochs * steps_per_epoch)))
    return total


def train_loop(model: nn.Module, step: StepFn, batches: Iterable[torch.Tensor], evaluate: EvalFn, select: str,
               cfg: LoopConfig, device, *, epoch_of: Callable[[], float] = lambda: 0.0,
               steps_per_epoch: Optional[float] = None, on_eval: Optional[Callable[[dict], None]] = None,
               desc: str = "training") -> LoopResult:
    """Train ``model``'s parameters with ``step``; evaluate before the first step, every planned ``1 / evals`` of the
    run and after the last step; return with the weights of the evaluation whose ``select`` metric was lowest.

    ``step(batch, compiled)`` runs forward and returns the loss; if the compiled variant raises on the first step the
    loop warns and goes on eagerly. ``on_eval(partial_log)`` is called after each evaluation (to write logs early).
    """
    run = _Run(model, evaluate, select, cfg, device, epoch_of, steps_per_epoch, on_eval)
    model.train()
    run.run_eval(0)
    total = _fixed_total(cfg, steps_per_epoch)
    n_evals = cfg.evals
    eval_every = max(1, total // n_evals) if total is not None else None
    compiled, step_seconds, stopped_early, diverged_at = cfg.compile, 0.0, False, None
    it: Iterator[torch.Tensor] = iter(batches)
    bar = tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=2.0)
    n = 0
    while total is None or n < total:
        if run.out_of_time():
            stopped_early = True
            break
        lr = lr_at(n, cfg, total)
        for g in run.opt.param_groups:
            g["lr"] = lr
        loss, compiled = _step_or_eager(model, step, next(it), compiled, n, run.opt, cfg)
        n += 1
        run.pending.append((loss, n, lr))
        bar.update(1)
        if n == run.warm:
            run.start_probe()
        if n == run.warm + cfg.probe_steps:
            step_seconds = run.seconds_per_step(n)
            if total is None:
                n_evals = run.eval_count()
                total = run.plan(n, step_seconds, n_evals)
                eval_every = max(1, total // n_evals)
                bar.total = total
        evaluate_now = eval_every is not None and n % eval_every == 0 and n < total
        if n % 20 == 0 or evaluate_now:
            diverged_at = run.flush()
            if diverged_at is not None:
                print(f"loss is not finite at step {diverged_at}; stopping", file=sys.stderr)
                break
            bar.set_postfix(loss=f"{run.train[-1][1]:.3f}", lr=f"{lr:.2e}", epoch=f"{epoch_of():.2f}", refresh=False)
        if evaluate_now:
            run.run_eval(n)
            if run.budget is not None and n > run.warm + cfg.probe_steps:
                step_seconds = run.seconds_per_step(n)
                total = run.plan(n, step_seconds, max(0, n_evals - (len(run.evals) - 1)))
                bar.total = total
    bar.close()
    return run.result(n, total, stopped_early, diverged_at, compiled, step_seconds)


def _step_or_eager(model: nn.Module, step: StepFn, batch: torch.Tensor, compiled: bool, n: int, opt,
                   cfg: LoopConfig) -> tuple[torch.Tensor, bool]:
    """Training step ``n`` -> (its detached loss, whether steps still run compiled): if the compiled variant raises
    on the first step, the loop warns and runs it eagerly, as every later step."""
    try:
        return _train_step(model, step, batch, compiled, opt, cfg), compiled
    except Exception as e:  # noqa: BLE001  (any compiler failure: the eager step is the fallback)
        if not compiled or n > 0:
            raise
        print(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
              "training eagerly", file=sys.stderr)
        return _train_step(model, step, batch, False, opt, cfg), False


def _train_step(model: nn.Module, step: StepFn, batch: torch.Tensor, compiled: bool, opt, cfg: LoopConfig):
    opt.zero_grad(set_to_none=True)
    loss = step(batch, compiled)
    loss.backward()
    if cfg.grad_clip:
        nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], cfg.grad_clip)
    opt.step()
    return loss.detach()


def validation_trend(result: LoopResult) -> str:
    """Whether the kept (best) evaluation came last or earlier: a hint on whether the run was too short or too long."""
    if result.best_step == result.steps:
        return "best at the last evaluation: a longer run (more --max-epochs or --minutes) may still gain"
    return (f"best at step {result.best_step} of {result.steps} (weights kept from there): a shorter run, or more "
            "regularization, would end there annealed")


def summarize(result: LoopResult, steps_per_epoch: float) -> dict:
    """The run's headline numbers for a stage's summary: length, timing, best and final evaluations."""
    return {
        "validation": validation_trend(result),
        "steps": result.steps, "planned_steps": result.planned_steps, "stopped_early": result.stopped_early,
        "diverged_at": result.diverged_at, "compiled": result.compiled,
        "epochs": round(result.steps / steps_per_epoch, 2), "train_seconds": result.seconds,
        "step_seconds": round(result.step_seconds, 4), "best_step": result.best_step,
        **{f"best_{k}": v for k, v in result.best.items()}, **{f"final_{k}": v for k, v in result.final.items()},
    }
