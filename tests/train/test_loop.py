"""The shared loop: a wall-clock budget plans the steps (timed on a fake clock), a failing compiled step falls back,
divergence stops it."""
import itertools

import pytest
import torch
from torch import nn

from tqops.train import loop
from tqops.train.loop import LoopConfig, lr_at, train_loop

BATCH = torch.randn(8, 4)


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = LoopConfig(lr=1.0, steps=100, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg, 100) for s in range(100)]
    assert lrs[:10] == [(s + 1) / 10 for s in range(10)] and lrs[10] == 1.0
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and abs(lrs[-1] - 0.1) < 1e-3
    short = LoopConfig(lr=1.0, steps=20, warmup_steps=100)  # warmup cut to a tenth of the run
    assert [lr_at(s, short, 20) for s in range(3)] == [0.5, 1.0, 1.0] and lr_at(3, short, 20) < 1.0


class FakeClock:
    """``time.perf_counter`` for the loop: it moves only when a step or an evaluation says it took time."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_minutes_plan_the_steps_and_the_run_ends_in_time(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(loop, "time", clock)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)

    def step(batch, compiled):  # 10 ms a step
        clock.advance(0.01)
        return model(batch).pow(2).mean()

    def evaluate():  # 20 ms an evaluation, which the step timing leaves out
        clock.advance(0.02)
        return {"loss": model(BATCH).pow(2).mean().item()}

    result = train_loop(model, step, itertools.repeat(BATCH), evaluate, "loss",
                        LoopConfig(lr=0.1, minutes=1.0 / 60, evals=3, warmup_steps=2), "cpu")
    assert result.step_seconds == pytest.approx(0.01)
    # planned after 3 + 10 timed steps (0.13 s, and 0.02 s of the first evaluation) from the 0.85 s left, less three
    # evaluations: 13 + int(0.98 * 0.79 / 0.01) = 90 steps, re-planned at each evaluation from what is left then
    assert [e["step"] for e in result.evals] == [0, 30, 60, 90, 91]
    assert result.planned_steps == result.steps == 91 and not result.stopped_early
    # 91 steps and 5 evaluations: the budget's second, overrun by at most one step and one evaluation
    assert result.seconds == pytest.approx(1.01) and result.seconds <= 1.0 + 0.01 + 0.02 + 1e-9


def test_a_budget_that_runs_out_stops_the_run_early(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(loop, "time", clock)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    steps = itertools.count()

    def step(batch, compiled):  # 10 ms a step until the plan is made, then 50 ms
        clock.advance(0.01 if next(steps) < 13 else 0.05)
        return model(batch).pow(2).mean()

    result = train_loop(model, step, itertools.repeat(BATCH), lambda: {"loss": model(BATCH).pow(2).mean().item()},
                        "loss", LoopConfig(lr=0.1, minutes=1.0 / 60, evals=1, warmup_steps=2), "cpu")
    assert result.stopped_early and result.steps < result.planned_steps
    # the budget is checked before each step: the run ends within one step of it
    assert 1.0 < result.seconds <= 1.0 + 0.05 + 1e-9


def test_compile_failure_falls_back_to_eager(capsys):
    model_loss = {}

    def step(batch, compiled):
        if compiled:
            raise RuntimeError("backend exploded\nmore lines")
        return model_loss["fn"]()

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model_loss["fn"] = lambda: model(BATCH).pow(2).mean()
    result = train_loop(model, step, itertools.repeat(BATCH), lambda: {"loss": model_loss["fn"]().item()}, "loss",
                        LoopConfig(lr=0.1, steps=5, evals=1, compile=True), "cpu")
    assert result.compiled is False and result.steps == 5
    err = capsys.readouterr().err
    assert "torch.compile failed (RuntimeError: backend exploded); training eagerly" in err


def test_divergence_stops_and_keeps_the_best_weights(capsys):
    calls = itertools.count()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    good = model.weight.detach().clone()

    def step(batch, compiled):
        loss = model(BATCH).pow(2).mean()
        return loss * float("nan") if next(calls) >= 2 else loss * 0

    result = train_loop(model, step, itertools.repeat(BATCH), lambda: {"loss": model(BATCH).pow(2).mean().item()},
                        "loss", LoopConfig(lr=0.1, steps=50, evals=10, warmup_steps=1), "cpu")
    assert result.diverged_at == 3 and result.steps == 5 and result.best_step == 0
    assert torch.equal(model.weight, good)
    assert "loss is not finite at step 3" in capsys.readouterr().err
