"""The HF-route speculative benchmark on CPU at a tiny shape: rows for every format and batch, both routes accept as
the oracle dictates, and the CLI's bad flags are one-line errors."""
import pytest

transformers = pytest.importorskip("transformers")

from tqops.bench import hf_speculative as bench  # noqa: E402

from ..cli_errors import assert_one_line_error, run_cli  # noqa: E402
from .test_hf import TINY  # noqa: E402


def test_rows_on_cpu():
    rows = bench.bench_hf_speculative(TINY, batches=(1, 2), context=24, formats=("bf16",), k=3, new_tokens=9,
                                      device="cpu")
    assert [(r["format"], r["batch"]) for r in rows] == [("bf16", 1), ("bf16", 2)]
    for row in rows:
        for key in ("hf_spec_step_ms", "tqops_qwen3_spec_step_ms", "hf_dflash_tok_s", "hf_plain_tok_s",
                    "static_cache_tok_s", "tqops_qwen3_dflash_tok_s"):
            assert row[key] > 0, key
        # right about 3 tokens a block: 4 tokens a step until the last, on both routes
        assert row["hf_acceptance"] == row["tqops_qwen3_acceptance"] == pytest.approx(8 / 2)
        assert row["hf_vs_tqops_qwen3"] == pytest.approx(row["hf_spec_step_ms"] / row["tqops_qwen3_spec_step_ms"])


@pytest.mark.parametrize("argv, flag", [(["--k", "16"], "--k"), (["--formats", "bf16,fp7"], "--formats"),
                                        (["--batches", "0"], "--batches"), (["--new-tokens", "1"], "--new-tokens")],
                         ids=["k-past-the-block", "unknown-format", "batch-zero", "one-new-token"])
def test_bad_flags_are_one_line_errors(argv, flag, capsys):
    code, stderr = run_cli(bench.main, argv, capsys)
    assert_one_line_error(code, stderr, "python -m tqops.bench.hf_speculative: error: ", flag)
