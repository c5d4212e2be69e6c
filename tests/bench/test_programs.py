"""The program-choice benchmark's rule column on CPU (the timings need CUDA): what the default call runs per GPU."""
import pytest
import torch

from tqops.bench import __main__ as bench_cli
from tqops.bench import programs

from ..cli_errors import assert_one_line_error, run_cli

@pytest.mark.parametrize("fmt,batch,context,want", [
    ("turboquant_4bit_nc", 8, 32768, "all-heads"), ("turboquant_4bit_nc", 32, 8192, "all-heads"),
    ("turboquant_3bit_nc", 32, 8192, "all-heads"), ("turboquant_k8v4", 128, 2048, "all-heads"),
    ("turboquant_k3v4_nc", 4, 32768, "per-head"),  # fewer than 8 query tiles
    ("turboquant_4bit_nc", 8, 8192, "per-head"),  # fewer than 128K keys over the table
], ids=lambda v: str(v))
def test_rule_column_is_what_the_kernel_runs(fmt, batch, context, want):
    assert programs.rule_choice(batch, context, fmt) == want


def test_cli_lists_it_and_refuses_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("runs the benchmark on a GPU")
    code, stderr = run_cli(bench_cli.main, ["programs"], capsys)
    assert_one_line_error(code, stderr, "python -m tqops.bench programs: error: ", "needs a CUDA device")


@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_rule_column_at_four_kv_heads(fmt):
    # 4 kv heads (a rank of Qwen3 under 2-way tensor parallelism): all-heads programs from 8 tiles
    assert programs.rule_choice(8, 32768, fmt, 4) == "all-heads"


def test_cli_refuses_a_kv_head_count_without_all_heads_programs(capsys):
    code, stderr = run_cli(bench_cli.main, ["programs", "--kv-heads", "2"], capsys)
    assert_one_line_error(code, stderr, "python -m tqops.bench programs: error: ", "--kv-heads must be one of")
