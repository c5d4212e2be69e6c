"""The DFlash2 modules-cost benchmark runs its v1 and DFlash2 draft steps (CPU: the compiled steps, untimed)."""
import pytest
import torch

from tqops.bench import dflash2 as bench
from tqops.bench import e2e
from tqops.models.dflash2 import DFlash2Drafter

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
            rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
TINY_DRAFTER = dict(TINY, num_hidden_layers=2, block_size=4,
                    dflash_config={"target_layer_ids": [1, 2], "mask_token_id": 63})


def test_dflash2_config_declares_the_architecture_and_keeps_v1_fields():
    cfg = bench.dflash2_config(TINY_DRAFTER, dict(bench.DFLASH2_FIELDS, conv_group_size=16))
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2]
    assert cfg["dflash_config"]["selector_top_k"] == bench.DFLASH2_FIELDS["selector_top_k"]
    assert "architectures" not in TINY_DRAFTER  # the v1 config is not changed


def test_rows_for_every_temperature_and_batch(monkeypatch):
    monkeypatch.setitem(e2e.SHAPES, "tiny", (TINY, TINY_DRAFTER, 24))
    monkeypatch.setattr(bench, "DFLASH2_FIELDS", dict(bench.DFLASH2_FIELDS, conv_group_size=16))
    ran = []
    built = []
    original = bench.draft_runner

    def draft_runner(drafter, *args):
        built.append(type(drafter))
        return original(drafter, *args)

    def fake_median_ms(fn):  # CPU: no CUDA events; run the step once and check it returns drafts
        out = fn()
        ran.append(out)
        return 2.0 if len(ran) % 2 == 0 else 1.0

    monkeypatch.setattr(bench, "draft_runner", draft_runner)
    monkeypatch.setattr(bench, "median_ms", fake_median_ms)
    monkeypatch.setattr(bench, "_compiled", lambda step: step)  # eager: the compiled path is the GPU's
    rows = bench.bench_dflash2("tiny", "bf16", batches=(1, 2), temperatures=(0.0, 1.0), device="cpu")
    assert [(r["temperature"], r["batch"]) for r in rows] == [(0.0, 1), (0.0, 2), (1.0, 1), (1.0, 2)]
    assert all(r["dflash2/v1"] == pytest.approx(2.0) for r in rows)
    assert built.count(DFlash2Drafter) == 2 and len(built) == 4
    v1_logits, v2_drafts = ran[0], ran[1]
    assert v1_logits.shape == (1, 3, 64)  # a v1 step: the mask positions' logits
    assert v2_drafts.tokens.shape == (1, 3) and v2_drafts.candidates.shape[-1] == bench.DFLASH2_FIELDS["selector_top_k"]
    assert ran[-1].q is not None and torch.isfinite(ran[-1].q).all()  # sampled at temperature 1
