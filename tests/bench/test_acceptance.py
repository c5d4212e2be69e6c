"""The acceptance benchmark on a tiny pair trained for a few CPU steps: its rows per layout and context, the target's
loss on the held-out windows against transformers', the plot, the CLI, bad flags."""
import json
import math
import shutil

import pytest
import torch

import tqops
from tqops import shipped as shipped_pair
from tqops.bench import __main__ as bench_cli
from tqops.bench import acceptance, heldout
from tqops.models import Qwen3ForCausalLM
from tqops.train.heldout import heldout_windows

from ..cli_errors import assert_one_line_error, run_cli
from ..train import conftest as train_conftest

# the session's tiny trained pair (pytest fixtures), bound here rather than imported so pyflakes stays quiet
tiny_target, tiny_drafter, BLOCK = train_conftest.tiny_target, train_conftest.tiny_drafter, train_conftest.BLOCK

CONTEXTS, NEW = (16, 24), 12
TINY_RUN = dict(prompts=2, contexts=CONTEXTS, new_tokens=NEW, device="cpu")
TINY_FLAGS = ["--prompts", "2", "--contexts", "24,16", "--new-tokens", str(NEW), "--device", "cpu"]
LAYOUTS = [("bf16", "both", "bf16", "bf16"), ("turboquant_4bit_nc", "both", "turboquant_4bit_nc", "turboquant_4bit_nc"),
           ("turboquant_4bit_nc", "target-only", "turboquant_4bit_nc", "bf16")]


@pytest.fixture(scope="module")
def rows(tiny_target, tiny_drafter):
    return acceptance.bench_acceptance(tiny_target[0], tiny_drafter[0], formats=("bf16", "turboquant_4bit_nc"),
                                       layout_names=("both", "target-only"), **TINY_RUN)


@pytest.fixture(scope="module")
def windows(tiny_target):
    return heldout_windows(shipped_pair.folder_tokenizer(tiny_target[0]), 2, max(CONTEXTS), NEW)


def kv_bytes(folder, fmt: str) -> int:
    """Bytes per token of every layer of the checkpoint in ``fmt``, from its config and the format's slot size."""
    config = json.loads((folder / "config.json").read_text())
    return tqops.get_format(fmt).slot_bytes(config["head_dim"]) * config["num_key_value_heads"] * \
        config["num_hidden_layers"]


def test_rows_are_the_bf16_baseline_then_each_format_per_layout_each_context(rows):
    assert [(r["format"], r["layout"], r["target cache"], r["drafter cache"], r["context"]) for r in rows] == [
        (*layout, c) for layout in LAYOUTS for c in CONTEXTS]


def test_speculative_decoding_is_lossless_and_acceptance_is_within_the_block(rows):
    for r in rows:
        assert 1 <= r["acceptance greedy"] <= BLOCK and 1 <= r["acceptance t=1"] <= BLOCK
        assert r["lossless"] is True and r["greedy-equal prompts"] == "2/2"
        assert 0 <= r["bf16-greedy prefix"] <= NEW
    assert [r["bf16-greedy prefix"] for r in rows[:len(CONTEXTS)]] == [NEW] * len(CONTEXTS)  # bf16 against itself


def test_temperature_1_acceptance_is_seeded(tiny_target, tiny_drafter, rows):
    again = acceptance.bench_acceptance(tiny_target[0], tiny_drafter[0], formats=(), **TINY_RUN)
    assert [r["acceptance t=1"] for r in again] == [r["acceptance t=1"] for r in rows[:len(CONTEXTS)]]


def test_loss_is_per_target_cache_and_context(rows, windows):
    for r in rows:
        assert math.isfinite(r["loss nats/token"]) and r["loss nats/token"] > 0
        bf16 = next(b for b in rows if b["format"] == "bf16" and b["context"] == r["context"])
        assert r["loss vs bf16"] == pytest.approx(r["loss nats/token"] - bf16["loss nats/token"])
        # nats per token times tokens per byte, in bits: the same held-out continuations at every context
        scored = len(windows) * NEW / sum(w.continuation_bytes for w in windows)
        assert r["bits/byte"] == pytest.approx(r["loss nats/token"] * scored / math.log(2))
    both, target_only = rows[len(CONTEXTS):2 * len(CONTEXTS)], rows[2 * len(CONTEXTS):]
    # the drafter's cache never changes the target's loss; the 4-bit cache does change it
    assert [r["loss nats/token"] for r in both] == [r["loss nats/token"] for r in target_only]
    assert all(r["loss vs bf16"] != 0 for r in both)


@torch.no_grad()
def test_bf16_cache_loss_is_the_dense_transformers_loss(rows, windows, tiny_target):
    transformers = pytest.importorskip("transformers")
    dense = transformers.AutoModelForCausalLM.from_pretrained(tiny_target[0], dtype=torch.float32).eval()
    ours = Qwen3ForCausalLM.from_pretrained(tiny_target[0], cache_format="bf16", dtype=torch.float32)
    for r in rows[:len(CONTEXTS)]:
        sequences = [w.sequence(r["context"]) for w in windows]
        want = torch.stack([torch.nn.functional.cross_entropy(dense(input_ids=torch.tensor([s])).logits[0, -NEW - 1:-1],
                                                              torch.tensor(s[-NEW:]), reduction="none")
                            for s in sequences])
        got = heldout.token_losses(ours, sequences, NEW)
        # the bf16 cache rounds K/V (up to ~1.5e-3 nats a token here; a 4-bit cache moves them by ~0.09)
        torch.testing.assert_close(got, want, rtol=0, atol=5e-3)
        assert r["loss nats/token"] == pytest.approx(want.mean().item(), abs=1e-3)


def test_step_cost_is_absent_on_cpu(rows):
    for r in rows:
        assert all(r[c] is None for c in ("tok/s", "greedy tok/s", "speedup vs greedy", "tok/s vs bf16", "ms/step"))


def test_bytes_per_token_are_the_formats_slot_sizes(rows, tiny_target, tiny_drafter):
    target, drafter = tiny_target[0], tiny_drafter[0]
    for r, (_, _, target_fmt, drafter_fmt) in zip(rows[::len(CONTEXTS)], LAYOUTS):
        total = kv_bytes(target, target_fmt) + kv_bytes(drafter, drafter_fmt)
        assert (r["target B/token"], r["drafter B/token"], r["kv B/token"]) == \
            (kv_bytes(target, target_fmt), kv_bytes(drafter, drafter_fmt), total)
        assert r["tokens in 16 GiB"] == 16 * 2**30 // total
        assert r["capacity vs bf16"] == pytest.approx(rows[0]["kv B/token"] / total)
    assert rows[len(CONTEXTS)]["target B/token"] == 70 * 1 * 3  # 4-bit keys + norm, 4-bit values + scale/zero at d=64


def test_ends_bf16_layout_names_the_bf16_layers(tiny_target, tiny_drafter):
    (row,) = acceptance.bench_acceptance(tiny_target[0], tiny_drafter[0], formats=("fp8_e4m3",),
                                         layout_names=("ends-bf16",), **dict(TINY_RUN, contexts=(16,)))[1:]
    # the tiny target has 3 layers, so the first two and the last two are all of them
    assert row["target cache"] == "fp8_e4m3, layers 0,1,2 bf16" and row["drafter cache"] == "fp8_e4m3"
    assert row["target B/token"] == kv_bytes(tiny_target[0], "bf16") and row["lossless"] is True
    assert row["loss vs bf16"] == 0  # every target layer is bf16, as in the baseline


def test_plot_draws_acceptance_against_context(rows, tmp_path):
    pytest.importorskip("matplotlib")
    acceptance.plot_acceptance(rows, str(tmp_path / "acceptance.png"))
    assert (tmp_path / "acceptance.png").stat().st_size > 0


def test_contexts_beyond_the_targets_positions_are_a_value_error(tiny_target, tiny_drafter):
    with pytest.raises(ValueError, match="max_position_embeddings 2048"):
        acceptance.bench_acceptance(tiny_target[0], tiny_drafter[0], **dict(TINY_RUN, contexts=(2040,)))


def test_command_line_writes_table_json_and_plot(tiny_target, tiny_drafter, tmp_path, capsys):
    code = bench_cli.main(["acceptance", "--target", str(tiny_target[0]), "--draft", str(tiny_drafter[0]),
                           *TINY_FLAGS, "--formats", "turboquant_3bit_nc", "--layouts", "drafter-only",
                           "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert ("| format | layout | context | drafter | target cache | drafter cache | acceptance greedy | "
            "greedy 95% lo | greedy 95% hi | acceptance t=1 | t=1 95% lo | t=1 95% hi | lossless |") in out
    assert "| loss nats/token | loss vs bf16 | bits/byte |" in out
    saved = json.loads((tmp_path / "acceptance.json").read_text())
    assert [(r["format"], r["layout"], r["context"]) for r in saved] == [
        ("bf16", "both", 16), ("bf16", "both", 24), ("turboquant_3bit_nc", "drafter-only", 16),
        ("turboquant_3bit_nc", "drafter-only", 24)]
    assert saved[-1]["tok/s"] is None and saved[-1]["loss vs bf16"] == 0  # the drafter-only target is bf16
    assert (tmp_path / "acceptance.md").read_text().startswith("`python -m tqops.bench acceptance --target")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "acceptance.png").stat().st_size > 0


BENCH_ERROR = "python -m tqops.bench acceptance: error: "


def test_untrained_shipped_pair_is_one_line_naming_the_training_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shipped_pair, "TRAINED_DIR", tmp_path)  # nothing trained there
    code, stderr = run_cli(bench_cli.main, ["acceptance"], capsys)
    assert_one_line_error(code, stderr, BENCH_ERROR, "not trained yet: run python -m tqops.train target --out")


@pytest.mark.parametrize("argv, words", [
    pytest.param("--formats nope", "--formats", id="format-unknown"),
    pytest.param("--layouts both,sideways", "--layouts", id="layout-unknown"),
    pytest.param("--prompts 0", "--prompts", id="prompts-zero"),
    pytest.param("--new-tokens -3", "--new-tokens", id="new-tokens-negative"),
    pytest.param("--contexts 16,x", "--contexts", id="contexts-not-int"),
    pytest.param("--contexts 0,16", "--contexts", id="contexts-zero"),
    pytest.param("--budget-gib nan", "--budget-gib", id="budget-nan"),
    pytest.param("--device mps", "--device", id="device-unsupported"),
    pytest.param("--target {tmp}", "--target and --draft", id="target-without-draft"),
    pytest.param("--target {tmp} --draft {tmp}", "--target", id="target-without-weights"),
    pytest.param("--prompts x", "--prompts", id="prompts-not-int"),
    pytest.param("--tokens -1", "--tokens", id="store-flag"),
    pytest.param("--shape qwen3-8b", "--shape", id="e2e-flag"),
])
def test_bad_flag_is_one_line_and_exit_2(argv, words, tmp_path, capsys):
    code, stderr = run_cli(bench_cli.main, ["acceptance", *argv.format(tmp=tmp_path).split()], capsys)
    assert_one_line_error(code, stderr, BENCH_ERROR, words)


@pytest.mark.parametrize("contexts, new", [("128,2040", "12"), ("1536", "1024")])
def test_contexts_past_the_targets_positions_are_one_line_and_exit_2(contexts, new, tiny_target, tiny_drafter, capsys):
    argv = ["acceptance", "--target", str(tiny_target[0]), "--draft", str(tiny_drafter[0]), "--contexts", contexts,
            "--new-tokens", new]
    code, stderr = run_cli(bench_cli.main, argv, capsys)
    assert_one_line_error(code, stderr, BENCH_ERROR, "--contexts")
    assert "max_position_embeddings 2048" in stderr


def test_every_row_is_handed_over_as_it_is_measured(tiny_target, tiny_drafter):
    seen = []
    rows = acceptance.bench_acceptance(tiny_target[0], tiny_drafter[0], formats=("fp8_e4m3",),
                                       layout_names=("drafter-only",), on_row=lambda so_far: seen.append(
                                           [(r["format"], r["context"]) for r in so_far]), **TINY_RUN)
    assert len(seen) == len(rows) == 2 * len(CONTEXTS)
    assert seen[-1] == [(r["format"], r["context"]) for r in rows] and seen[0] == seen[-1][:1]


def pair_flags(target, drafter) -> list:
    return ["acceptance", "--target", str(target), "--draft", str(drafter), *TINY_FLAGS]


def test_out_that_is_a_file_is_one_line_and_exit_2(tiny_target, tiny_drafter, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code, stderr = run_cli(bench_cli.main, [*pair_flags(tiny_target[0], tiny_drafter[0]), "--out",
                                            str(tmp_path / "file")], capsys)
    assert_one_line_error(code, stderr, BENCH_ERROR, "--out")


@pytest.mark.skipif(torch.cuda.is_available(), reason="--compile runs with CUDA")
def test_compile_without_cuda_is_one_line_and_exit_2(tiny_target, tiny_drafter, capsys):
    code, stderr = run_cli(bench_cli.main, [*pair_flags(tiny_target[0], tiny_drafter[0]), "--compile"], capsys)
    assert_one_line_error(code, stderr, BENCH_ERROR, "--compile")


def test_draft_that_is_a_target_checkpoint_is_one_line_and_exit_2(tiny_target, capsys):
    code, stderr = run_cli(bench_cli.main, pair_flags(tiny_target[0], tiny_target[0]), capsys)
    assert_one_line_error(code, stderr, BENCH_ERROR, "--draft")


def test_corrupt_tokenizer_is_one_line_and_exit_2(tiny_target, tiny_drafter, tmp_path, capsys):
    target = shutil.copytree(tiny_target[0], tmp_path / "target")
    (target / "tokenizer.json").write_text("{not json")
    code, stderr = run_cli(bench_cli.main, pair_flags(target, tiny_drafter[0]), capsys)
    assert_one_line_error(code, stderr, BENCH_ERROR, "--target")
    assert "tokenizer.json" in stderr
