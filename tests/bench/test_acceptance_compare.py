"""The acceptance benchmark comparing drafters of one target (the shipped pair on CPU, a few prompts): bootstrap
intervals over the prompts, paired ratios to the first drafter, the same rows as one drafter alone, the CLI."""
import json

import pytest
import torch

from tqops.bench import __main__ as bench_cli
from tqops.bench import acceptance
from tqops.models.generate import GenerateResult

from ..cli_errors import assert_one_line_error, run_cli

TINY = dict(prompts=3, contexts=(16,), new_tokens=12, device="cpu")
BLOCK = 16  # the shipped drafter's block
FORMAT = "turboquant_4bit_nc"
INTERVALS = ("greedy", "t=1")


@pytest.fixture(scope="module")
def rows(shipped_pair, v1_as_dflash2):
    """v1, v1 again and the DFlash2 drafter that starts as v1, on bf16 and one 4-bit cache."""
    target, v1 = shipped_pair
    return acceptance.bench_acceptance(target, [v1, v1, v1_as_dflash2], formats=(FORMAT,), layout_names=("both",),
                                       **TINY)


def by_drafter(rows, i: int) -> list[dict]:
    return rows[i::3]


def test_one_row_per_drafter_in_each_layout_and_context(rows, shipped_pair, v1_as_dflash2):
    v1 = acceptance.drafter_label(shipped_pair[1])
    assert [(r["format"], r["drafter"]) for r in rows] == [
        (fmt, d) for fmt in ("bf16", FORMAT) for d in (v1, v1, acceptance.drafter_label(v1_as_dflash2))]
    assert all(r["ratio to"] == v1 for r in rows if r not in by_drafter(rows, 0))
    # the first drafter's rows hold the ratio columns, empty, so the table keeps them beside acceptance
    for r in by_drafter(rows, 0):
        assert r["ratio to"] is None and all(r[c] is None for c in acceptance.RATIO_COLUMNS)
    columns = list(rows[0])
    assert columns[columns.index("acceptance greedy"):columns.index("lossless")] == [
        "acceptance greedy", "greedy 95% lo", "greedy 95% hi", "acceptance t=1", "t=1 95% lo", "t=1 95% hi",
        "ratio to", *acceptance.RATIO_COLUMNS]


def test_each_interval_holds_its_mean_within_the_block(rows):
    for r in rows:
        for name, mean in zip(INTERVALS, (r["acceptance greedy"], r["acceptance t=1"])):
            assert 1 <= r[f"{name} 95% lo"] <= mean <= r[f"{name} 95% hi"] <= BLOCK, (r["drafter"], name)
        assert r["lossless"] is True
    # three prompts that differ: some interval is not a point
    assert any(r["greedy 95% hi"] > r["greedy 95% lo"] for r in rows)


def test_a_drafter_against_itself_is_ratio_1_with_a_degenerate_interval(rows):
    for first, again in zip(by_drafter(rows, 0), by_drafter(rows, 1)):
        for name in INTERVALS:
            for end in ("lo", "hi"):
                assert again[f"{name} 95% {end}"] == first[f"{name} 95% {end}"]
            assert again[f"{name} ratio"] == again[f"{name} ratio 95% lo"] == again[f"{name} ratio 95% hi"] == 1.0


def test_dflash2_starting_as_v1_drafts_as_v1_greedily(rows):
    # identity convolutions and a zero pair term: the walk picks each position's best logit, v1's draft
    for v1, d2 in zip(by_drafter(rows, 0), by_drafter(rows, 2)):
        assert d2["acceptance greedy"] == v1["acceptance greedy"]
        assert d2["greedy ratio"] == d2["greedy ratio 95% lo"] == d2["greedy ratio 95% hi"] == 1.0
        # sampled over its top-8 candidates instead of the whole vocabulary: its own ratio, inside its interval
        assert d2["t=1 ratio"] == pytest.approx(d2["acceptance t=1"] / v1["acceptance t=1"])
        assert d2["t=1 ratio 95% lo"] <= d2["t=1 ratio"] <= d2["t=1 ratio 95% hi"]


def test_the_first_drafters_rows_are_those_it_gets_alone(rows, shipped_pair):
    alone = acceptance.bench_acceptance(*shipped_pair, formats=(FORMAT,), layout_names=("both",), **TINY)
    ratios = {"ratio to", *acceptance.RATIO_COLUMNS}
    assert [{k: v for k, v in r.items() if k not in ratios} for r in by_drafter(rows, 0)] == alone
    assert not ratios & set(alone[0])  # one drafter: no ratio columns


def result(acceptance_lengths) -> GenerateResult:
    steps = [n for row in acceptance_lengths for n in row]
    return GenerateResult([], acceptance_lengths, [], sum(steps) / len(steps))


def test_paired_bootstrap_of_a_drafter_twice_as_long_is_exactly_2():
    # prompts of very different acceptance: each drafter's interval is wide, their ratio is 2 in every resample
    base = acceptance.DrafterRuns(result([[1, 1, 1], [5, 7], [2, 3, 2, 2]]), 0.0, result([[1, 2], [3], [1, 1]]))
    double = acceptance.DrafterRuns(result([[2, 2, 2], [10, 14], [4, 6, 4, 4]]), 0.0, result([[2, 4], [6], [2, 2]]))
    draws = acceptance.resample_prompts(3, seed=0)
    out = acceptance.acceptance_intervals(double, base, draws)
    for name in INTERVALS:
        assert out[f"{name} ratio"] == out[f"{name} ratio 95% lo"] == out[f"{name} ratio 95% hi"] == 2.0
        assert out[f"{name} 95% hi"] - out[f"{name} 95% lo"] > 1
    # the greedy interval is the percentiles of the pooled means of the resamples, computed here by hand
    tokens, steps = torch.tensor([6.0, 24.0, 18.0]), torch.tensor([3.0, 2.0, 4.0])
    pooled = tokens[draws].sum(-1) / steps[draws].sum(-1)
    assert out["greedy 95% lo"] == pytest.approx(pooled.quantile(0.025).item())
    assert out["greedy 95% hi"] == pytest.approx(pooled.quantile(0.975).item())


def test_command_line_compares_drafters(shipped_pair, v1_as_dflash2, tmp_path, capsys):
    target, v1 = shipped_pair
    code = bench_cli.main(["acceptance", "--target", str(target), "--draft", f"{v1},{v1_as_dflash2}", "--formats",
                           "fp8_e4m3", "--layouts", "drafter-only", "--prompts", "2", "--contexts", "16",
                           "--new-tokens", "8", "--device", "cpu", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert ("| format | layout | context | drafter | target cache | drafter cache | acceptance greedy | "
            "greedy 95% lo | greedy 95% hi | acceptance t=1 | t=1 95% lo | t=1 95% hi | ratio to | "
            "greedy ratio |") in out
    saved = json.loads((tmp_path / "acceptance.json").read_text())
    assert [(r["format"], r["layout"], r["drafter"]) for r in saved] == [
        (fmt, layout, acceptance.drafter_label(d)) for fmt, layout in (("bf16", "both"), ("fp8_e4m3", "drafter-only"))
        for d in (v1, v1_as_dflash2)]
    assert saved[1]["greedy ratio"] == 1.0 and saved[1]["ratio to"] == acceptance.drafter_label(v1)
    pytest.importorskip("matplotlib")
    assert (tmp_path / "acceptance.png").stat().st_size > 0


BENCH_ERROR = "python -m tqops.bench acceptance: error: "


@pytest.mark.parametrize("drafts, words", [
    pytest.param("{v1},", "--draft", id="empty-entry"),
    pytest.param("{v1},{tmp}", "--draft", id="second-without-weights"),
    pytest.param("{v1},{target}", "--draft", id="second-is-a-target"),
])
def test_bad_drafter_in_the_list_is_one_line_and_exit_2(drafts, words, shipped_pair, tmp_path, capsys):
    target, v1 = shipped_pair
    argv = ["acceptance", "--target", str(target), "--draft", drafts.format(v1=v1, tmp=tmp_path, target=target)]
    code, stderr = run_cli(bench_cli.main, argv, capsys)
    assert_one_line_error(code, stderr, BENCH_ERROR, words)
