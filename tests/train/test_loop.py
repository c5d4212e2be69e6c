"""The shared loop: a wall-clock budget plans the steps, a failing compiled step falls back, divergence stops it."""
import itertools
import time

import torch
from torch import nn

from tqops.train.loop import LoopConfig, lr_at, train_loop

BATCH = torch.randn(8, 4)


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = LoopConfig(lr=1.0, steps=100, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg, 100) for s in range(100)]
    assert lrs[:10] == [(s + 1) / 10 for s in range(10)] and lrs[10] == 1.0
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and abs(lrs[-1] - 0.1) < 1e-3
    short = LoopConfig(lr=1.0, steps=20, warmup_steps=100)  # warmup cut to a tenth of the run
    assert [lr_at(s, short, 20) for s in range(3)] == [0.5, 1.0, 1.0] and lr_at(3, short, 20) < 1.0


def test_minutes_plan_the_steps_and_the_run_ends_in_time():
    torch.optim.AdamW(nn.Linear(1, 1).parameters())  # the first AdamW of a process imports for a second
    torch.manual_seed(0)
    model = nn.Linear(4, 1)

    def slow_step(batch, compiled):
        time.sleep(0.01)
        return model(batch).pow(2).mean()

    result = train_loop(model, slow_step, itertools.repeat(BATCH), lambda: {"loss": model(BATCH).pow(2).mean().item()},
                        "loss", LoopConfig(lr=0.1, minutes=1.0 / 60, evals=3, warmup_steps=2), "cpu")
    # planned after 3 + 10 timed steps from what was left of the second: about 85 steps of 10 ms
    assert result.seconds < 1.3 and result.step_seconds >= 0.01
    assert 40 < result.planned_steps < 100 and result.steps >= 40 and len(result.evals) >= 4


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
