"""A tiny target and drafter trained once per session through the stages' own entry points (a few CPU steps)."""
from pathlib import Path

import pytest

from tqops.train.drafter import DrafterOptions, train_drafter
from tqops.train.loop import LoopConfig, RunOptions
from tqops.train.target import TargetOptions, TargetShape, train_target

TINY = TargetShape(hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                   intermediate_size=128)
SEQ_LEN, BLOCK = 64, 8
LAYER_IDS = (2, 0)  # out of order and including the last layer, so the state order and the final norm both matter


def tiny_run() -> RunOptions:
    """Three CPU steps on two packed sequences from four train files, one evaluation."""
    return RunOptions(LoopConfig(lr=3e-3, steps=3, evals=1, warmup_steps=1), seq_len=SEQ_LEN, batch_size=2,
                      eval_batch_size=8, device="cpu", train_files=4, eval_files=1)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("target")
    summary = train_target(TargetOptions(
        out=out, shape=TINY, run=tiny_run()))
    return out, summary


@pytest.fixture(scope="session")
def tiny_drafter(tiny_target, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("drafter")
    summary = train_drafter(DrafterOptions(
        target=tiny_target[0], out=out, num_layers=2, target_layer_ids=LAYER_IDS, block_size=BLOCK,
        blocks_per_sequence=4, run=tiny_run(), greedy_sequences=4, greedy_batch_size=2, greedy_new_tokens=24,
        greedy_eval_sequences=2, accept_prompts=1, accept_prompt_tokens=24, accept_new_tokens=8))
    return out, summary
