"""The drafter's greedy training data: the target's own greedy tokens after corpus prompts, and anchors after them."""
import json
import math

import numpy as np
import pytest
import torch

from tqops.train.dflash import sample_anchors
from tqops.train.distill import (SequenceBatches, greedy_anchor_range, greedy_continue, greedy_sequences,
                                prompt_windows)
from tqops.train.drafter import DrafterOptions, load_frozen_target, train_drafter
from tqops.train.report import LOG_FILE

from .conftest import BLOCK, LAYER_IDS, SEQ_LEN, tiny_run


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_frozen_target(tiny_target[0], torch.device("cpu"))


def test_greedy_continue_is_the_argmax_of_a_full_forward_at_every_step(target):
    prompts = torch.randint(3, 200, (3, 5), generator=torch.Generator().manual_seed(0))
    got = greedy_continue(target, prompts, 17)
    want = prompts
    with torch.no_grad():
        while want.shape[1] < 17:
            want = torch.cat([want, target(input_ids=want).logits[:, -1:].argmax(-1)], 1)
    assert got.tolist() == want.tolist()


def test_greedy_sequences_are_a_corpus_window_its_greedy_tokens_and_padding(target):
    docs = [np.arange(10, 90, dtype=np.int32), np.arange(100, 160, dtype=np.int32)]
    stream = np.concatenate(docs)
    kwargs = dict(count=5, seq_len=24, new_tokens=6, batch_size=2, seed=7, device="cpu", pad_id=1)
    seqs, prompt_lens = greedy_sequences(target, docs, **kwargs)
    assert seqs.shape == (5, 24) and seqs.dtype == torch.int64 and prompt_lens.shape == (5,)
    assert all(16 <= p <= 18 for p in prompt_lens.tolist())
    for row, p in zip(seqs, prompt_lens.tolist()):
        start = int(np.flatnonzero(stream == int(row[0]))[0])
        assert row[:p].tolist() == stream[start:start + p].tolist()
        assert torch.equal(row[:p + 6], greedy_continue(target, row[None, :p], p + 6)[0])
        assert (row[p + 6:] == 1).all()
    again = greedy_sequences(target, docs, **kwargs)
    assert torch.equal(again[0], seqs) and torch.equal(again[1], prompt_lens)


def test_greedy_anchor_range_spans_the_generated_labels():
    bounds = greedy_anchor_range(torch.tensor([16, 40]), new_tokens=24, block_size=8)
    assert bounds.tolist() == [[15, 32], [39, 56]]  # first labels: the first generated token; last: the 24th


def test_prompt_windows_refuses_a_corpus_shorter_than_a_prompt():
    with pytest.raises(ValueError, match="fewer than one 9-token prompt"):
        prompt_windows([np.arange(5, dtype=np.int32)], 2, 9, np.random.default_rng(0))


@pytest.mark.parametrize("bounds", [[[1, 56]] * 3, [[5, 20], [30, 40], [45, 56]], [[0, 4], [12, 30], [53, 70]]],
                         ids=["whole-row", "spread", "clamped"])
def test_anchors_stay_in_each_rows_bounds_and_distinct(bounds):
    seq_len, count, bs = 64, 4, 8
    anchors = sample_anchors(3, seq_len, count, bs, generator=torch.Generator().manual_seed(1),
                             bounds=torch.tensor(bounds))
    for row, (first, last) in zip(anchors.tolist(), bounds):
        assert row == sorted(set(row)) and len(row) == count
        assert max(first, 1) <= min(row) and max(row) <= min(last, seq_len - bs)


def test_anchors_that_cannot_fit_their_bounds_raise():
    with pytest.raises(ValueError, match="do not fit distinct anchors between"):
        sample_anchors(2, 64, 4, 8, bounds=torch.tensor([[1, 30], [50, 52]]))


def test_sequence_batches_deal_every_sequence_once_per_epoch():
    seqs = torch.arange(7 * 3).view(7, 3)
    batches = SequenceBatches(seqs, torch.arange(7), batch_size=3, seed=0)
    it = iter(batches)
    epoch = [next(it) for _ in range(2)]
    rows = torch.cat([ids[:, 0] for ids, _ in epoch]) // 3
    assert len(set(rows.tolist())) == 6 and batches.epoch == 1.0
    assert all(torch.equal(ids[:, 0] // 3, lens) for ids, lens in epoch)
    with pytest.raises(ValueError, match="cannot fill one batch of 8"):
        SequenceBatches(seqs, torch.arange(7), batch_size=8)


def test_drafter_stage_logs_its_greedy_data(tiny_drafter):
    log = json.loads((tiny_drafter[0] / LOG_FILE).read_text())
    greedy = log["data"]["greedy"]
    assert greedy["train"]["sequences"] == 4 and greedy["train"]["tokens"] == 4 * SEQ_LEN
    assert greedy["valid"]["sequences"] == greedy["heldout"]["sequences"] == 2
    assert 1.0 <= log["result"]["best_heldout_accept_len"] <= BLOCK


def test_drafter_stage_still_trains_on_the_corpus(tiny_target, tmp_path):
    summary = train_drafter(DrafterOptions(
        target=tiny_target[0], out=tmp_path, num_layers=1, target_layer_ids=LAYER_IDS, block_size=BLOCK,
        blocks_per_sequence=4, run=tiny_run(), data="corpus", accept_prompts=0))
    assert summary["steps"] == 3 and math.isfinite(summary["best_valid_loss"])
    assert "greedy" not in json.loads((tmp_path / LOG_FILE).read_text())["data"]
