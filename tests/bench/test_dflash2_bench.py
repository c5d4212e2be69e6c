"""The DFlash2 modules-cost benchmark runs its v1 and DFlash2 draft steps (CPU: the compiled steps, untimed); its
trained-pair part decodes the shipped target with the v1 drafter and a DFlash2 drafter (CPU: eager, a few tokens)."""
import json

import pytest
import torch

from tqops.bench import dflash2 as bench
from tqops.bench import e2e
from tqops.bench.acceptance import drafter_label
from tqops.models.dflash2 import DFlash2Drafter

from ..cli_errors import assert_one_line_error, run_cli

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


def test_compiled_steps_take_the_sampled_steps_uniforms_too():
    """A DFlash2 step at temperature > 0 takes (input_ids, positions, uniforms); the compiled step passes all three
    on, one graph for every token count."""
    step = e2e._compiled(lambda ids, pos, uniforms: (ids + pos).float() * uniforms)
    for n in (3, 5):
        ids, pos, uniforms = torch.arange(n), torch.arange(n) + 1, torch.full((n,), 0.5)
        torch.testing.assert_close(step(ids, pos, uniforms), (2 * torch.arange(n) + 1) * 0.5)
    assert e2e._compiled(lambda ids, pos: ids * pos)(torch.arange(4), torch.arange(4)).tolist() == [0, 1, 4, 9]


PAIR = dict(batches=(1, 2), prompt_tokens=16, new_tokens=8, rounds=1, device="cpu")


@pytest.fixture(scope="module")
def pair_rows(shipped_pair, v1_as_dflash2):
    target, v1 = shipped_pair
    seen = []
    rows = bench.bench_pair(v1_as_dflash2, v1, target, on_batch=lambda so_far: seen.append(len(so_far)), **PAIR)
    assert seen == [3, 6]  # handed over after each batch: plain, v1, DFlash2
    return rows


def test_pair_rows_are_plain_v1_and_dflash2_per_batch(pair_rows, shipped_pair, v1_as_dflash2):
    assert [(r["batch"], r["decoder"], r["drafter"]) for r in pair_rows] == [
        (b, d, p and drafter_label(p)) for b in PAIR["batches"]
        for d, p in (("plain", None), ("v1 (DFlash)", shipped_pair[1]), ("dflash2 (DFlash2)", v1_as_dflash2))]
    for plain, v1, d2 in zip(pair_rows[::3], pair_rows[1::3], pair_rows[2::3]):
        assert plain["acceptance"] == 1.0 and plain["speedup vs plain"] == 1.0 and plain["tok/s vs v1"] is None
        assert all(r["lossless"] is True and r["tok/s"] > 0 and r["ms/step"] > 0 for r in (plain, v1, d2))
        for r in (v1, d2):
            assert r["speedup vs plain"] == pytest.approx(r["tok/s"] / plain["tok/s"])
            assert r["tok/s vs v1"] == pytest.approx(r["tok/s"] / v1["tok/s"])
            assert r["tokens"] == plain["tokens"] and len(r["tokens"]) == plain["batch"]
        assert 1 < v1["acceptance"] <= 16
        # the DFlash2 drafter that starts as v1 drafts as v1 greedily
        assert d2["acceptance"] == v1["acceptance"]


def test_pair_command_line_writes_its_table(shipped_pair, v1_as_dflash2, tmp_path, capsys):
    code = bench.main(["--no-modules", "--trained", str(v1_as_dflash2), "--device", "cpu", "--batches", "1",
                       "--prompt-tokens", "16", "--new-tokens", "8", "--rounds", "1", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| format | batch | decoder | drafter | tok/s | acceptance | speedup vs plain | tok/s vs v1 |" in out
    saved = json.loads((tmp_path / "dflash2-pair.json").read_text())
    assert [r["decoder"] for r in saved] == ["plain", "v1 (DFlash)", "dflash2 (DFlash2)"]
    assert saved[1]["drafter"] == drafter_label(shipped_pair[1])  # --v1 defaults to the shipped drafter
    assert (tmp_path / "dflash2-pair.md").read_text().startswith("`python -m tqops.bench.dflash2 --no-modules")
    assert not (tmp_path / "dflash2.json").exists()  # no modules' cost


ERROR = "python -m tqops.bench.dflash2: error: "


@pytest.mark.parametrize("argv, words", [
    pytest.param("--no-modules", "--trained", id="nothing-to-run"),
    pytest.param("--no-modules --v1 {v1}", "--v1", id="v1-without-trained"),
    pytest.param("--no-modules --trained {target}", "--trained", id="trained-is-a-target"),
    pytest.param("--no-modules --trained {tmp}", "--trained", id="trained-without-weights"),
    pytest.param("--no-modules --trained {d2} --batches 0", "--batches", id="batch-zero"),
    pytest.param("--no-modules --trained {d2} --rounds 0", "--rounds", id="rounds-zero"),
    pytest.param("--no-modules --trained {d2} --prompt-tokens 2000", "max_position_embeddings", id="too-long"),
    pytest.param("--format nope", "--format", id="format-unknown"),
    pytest.param("--temperatures 0,x", "--temperatures", id="temperature-not-a-number"),
    pytest.param("--temperatures -1", "--temperatures", id="temperature-negative"),
])
def test_bad_flag_is_one_line_and_exit_2(argv, words, shipped_pair, v1_as_dflash2, tmp_path, capsys):
    argv = argv.format(v1=shipped_pair[1], target=shipped_pair[0], tmp=tmp_path, d2=v1_as_dflash2).split()
    code, stderr = run_cli(bench.main, argv, capsys)
    assert_one_line_error(code, stderr, ERROR, words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the modules' cost runs with CUDA")
def test_modules_cost_without_cuda_is_one_line_and_exit_2(capsys):
    code, stderr = run_cli(bench.main, [], capsys)
    assert_one_line_error(code, stderr, ERROR, "--no-modules")
