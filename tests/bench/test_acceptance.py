"""The acceptance benchmark on a tiny pair trained for a few CPU steps: its rows, their bytes, the CLI, bad flags."""
import json

import pytest

import tqops
from tqops import shipped as shipped_pair
from tqops.bench import __main__ as bench_cli
from tqops.bench import acceptance

from ..cli_errors import assert_one_line_error, run_cli
from ..train.conftest import tiny_drafter, tiny_target  # noqa: F401  (pytest fixtures: the tiny trained pair)

TINY_RUN = dict(prompts=2, prompt_tokens=24, new_tokens=12, device="cpu")
TINY_FLAGS = ["--prompts", "2", "--prompt-tokens", "24", "--new-tokens", "12", "--device", "cpu"]


@pytest.fixture(scope="module")
def rows(tiny_target, tiny_drafter):
    return acceptance.bench_acceptance(tiny_target[0], tiny_drafter[0], formats=("bf16", "turboquant_4bit_nc"),
                                       layout_names=("both", "target-only"), **TINY_RUN)


def kv_bytes(folder, fmt: str) -> int:
    """Bytes per token of every layer of the checkpoint in ``fmt``, from its config and the format's slot size."""
    config = json.loads((folder / "config.json").read_text())
    return tqops.get_format(fmt).slot_bytes(config["head_dim"]) * config["num_key_value_heads"] * \
        config["num_hidden_layers"]


def test_rows_are_the_bf16_baseline_then_each_format_per_layout(rows):
    assert [(r["format"], r["layout"], r["target cache"], r["drafter cache"]) for r in rows] == [
        ("bf16", "both", "bf16", "bf16"),
        ("turboquant_4bit_nc", "both", "turboquant_4bit_nc", "turboquant_4bit_nc"),
        ("turboquant_4bit_nc", "target-only", "turboquant_4bit_nc", "bf16"),
    ]


def test_speculative_decoding_is_lossless_and_accepts_at_least_the_bonus_token(rows):
    for r in rows:
        assert r["acceptance"] >= 1
        assert r["lossless"] is True and r["greedy-equal prompts"] == "2/2"
        assert 0 <= r["bf16-greedy prefix"] <= 12
    assert rows[0]["bf16-greedy prefix"] == 12  # the baseline against itself


def test_bytes_per_token_are_the_formats_slot_sizes(rows, tiny_target, tiny_drafter):
    target, drafter = tiny_target[0], tiny_drafter[0]
    for r, (target_fmt, drafter_fmt) in zip(rows, [("bf16", "bf16"), ("turboquant_4bit_nc", "turboquant_4bit_nc"),
                                                   ("turboquant_4bit_nc", "bf16")]):
        total = kv_bytes(target, target_fmt) + kv_bytes(drafter, drafter_fmt)
        assert (r["target B/token"], r["drafter B/token"], r["kv B/token"]) == \
            (kv_bytes(target, target_fmt), kv_bytes(drafter, drafter_fmt), total)
        assert r["tokens in 16 GiB"] == 16 * 2**30 // total
        assert r["capacity vs bf16"] == pytest.approx(rows[0]["kv B/token"] / total)
    assert rows[1]["target B/token"] == 70 * 1 * 3  # 4-bit keys + norm, 4-bit values + scale/zero: 70 B at d=64


def test_ends_bf16_layout_names_the_bf16_layers(tiny_target, tiny_drafter):
    (row,) = acceptance.bench_acceptance(tiny_target[0], tiny_drafter[0], formats=("fp8_e4m3",),
                                         layout_names=("ends-bf16",), **TINY_RUN)[1:]
    # the tiny target has 3 layers, so the first two and the last two are all of them
    assert row["target cache"] == "fp8_e4m3, layers 0,1,2 bf16" and row["drafter cache"] == "fp8_e4m3"
    assert row["target B/token"] == kv_bytes(tiny_target[0], "bf16") and row["lossless"] is True


def test_command_line_writes_table_json_and_plot(tiny_target, tiny_drafter, tmp_path, capsys):
    code = bench_cli.main(["acceptance", "--target", str(tiny_target[0]), "--draft", str(tiny_drafter[0]),
                           *TINY_FLAGS, "--formats", "turboquant_3bit_nc", "--layouts", "drafter-only",
                           "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| format | layout | target cache | drafter cache | acceptance | lossless |" in out
    saved = json.loads((tmp_path / "acceptance.json").read_text())
    assert [(r["format"], r["layout"]) for r in saved] == [("bf16", "both"), ("turboquant_3bit_nc", "drafter-only")]
    assert (tmp_path / "acceptance.md").read_text().startswith("`python -m tqops.bench acceptance --target")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "acceptance.png").stat().st_size > 0


BENCH_ERROR = "python -m tqops.bench: error: "


def test_untrained_shipped_pair_is_one_line_naming_the_training_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shipped_pair, "TRAINED_DIR", tmp_path)  # nothing trained there
    code, stderr = run_cli(bench_cli.main, ["acceptance"], capsys)
    assert_one_line_error(code, stderr, BENCH_ERROR, "not trained yet: run python -m tqops.train target --out")


@pytest.mark.parametrize("argv, words", [
    pytest.param("--formats nope", "--formats", id="format-unknown"),
    pytest.param("--layouts both,sideways", "--layouts", id="layout-unknown"),
    pytest.param("--prompts 0", "--prompts", id="prompts-zero"),
    pytest.param("--new-tokens -3", "--new-tokens", id="new-tokens-negative"),
    pytest.param("--budget-gib nan", "--budget-gib", id="budget-nan"),
    pytest.param("--device mps", "--device", id="device-unsupported"),
    pytest.param("--target {tmp}", "--target and --draft", id="target-without-draft"),
    pytest.param("--target {tmp} --draft {tmp}", "--target", id="target-without-weights"),
    pytest.param("--prompts x", "--prompts", id="prompts-not-int"),
])
def test_bad_flag_is_one_line_and_exit_2(argv, words, tmp_path, capsys):
    code, stderr = run_cli(bench_cli.main, ["acceptance", *argv.format(tmp=tmp_path).split()], capsys)
    assert_one_line_error(code, stderr, BENCH_ERROR, words)
