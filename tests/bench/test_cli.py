"""The benchmark command lines' bad input: one ``prog: error: ...`` line naming the flag, exit status 2, before any
work (``python -m tqops.bench``, ``python -m tqops.bench.tp``)."""
import os
import subprocess
import sys

import pytest
import torch

from tqops.bench import __main__ as bench_cli
from tqops.bench import tp

from ..cli_errors import assert_one_line_error, run_cli
from ..train import conftest as train_conftest
from ..train.helpers import WEIGHT_BREAKS, break_weights

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA benchmarks would run")
TP_ERROR = "torchrun --nproc-per-node N -m tqops.bench.tp: error: "
TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@no_cuda
@pytest.mark.parametrize("which", ["store", "attention", "e2e", "hf", "kernels", "linear", "programs"])
def test_cuda_subcommand_without_cuda_names_it(which, capsys):
    code, stderr = run_cli(bench_cli.main, [which], capsys)
    assert_one_line_error(code, stderr, f"python -m tqops.bench {which}: error: ", "needs a CUDA device")


@pytest.mark.parametrize("argv, words", [
    pytest.param("quality --device cuda", "--device", id="quality-device"),
    pytest.param("quality --shape qwen3-8b", "--shape", id="quality-shape"),
    pytest.param("attention --shape qwen3-8b", "--shape", id="attention-shape"),
    pytest.param("store --prompts 2", "--prompts", id="store-prompts"),
    pytest.param("e2e --pdl", "--pdl", id="e2e-pdl"),
    pytest.param("e2e --step verify", "--step", id="e2e-step"),
    pytest.param("kernels --step prefill", "--step", id="kernels-step-choice"),
])
def test_flag_of_another_subcommand_is_one_line(argv, words, capsys):
    which = argv.split()[0]
    code, stderr = run_cli(bench_cli.main, argv.split(), capsys)
    assert_one_line_error(code, stderr, f"python -m tqops.bench {which}: error: ", words)


def test_kernels_profiles_without_pdl_unless_asked():
    parser, _ = bench_cli.make_parser()
    assert parser.parse_args(["kernels"]).pdl is False
    assert parser.parse_args(["kernels", "--pdl", "--shape", "qwen3-8b"]).pdl is True


def test_kernels_profiles_the_decode_step_unless_asked():
    parser, _ = bench_cli.make_parser()
    assert parser.parse_args(["kernels"]).step == "decode"
    assert parser.parse_args(["kernels", "--step", "verify", "--shape", "qwen3-8b"]).step == "verify"
    assert parser.parse_args(["kernels", "--step", "draft"]).step == "draft"


@pytest.mark.parametrize("flag", ["--tokens", "--kv-heads", "--head-dim"])
def test_store_sizes_must_be_positive(flag, capsys):
    code, stderr = run_cli(bench_cli.main, ["store", flag, "0"], capsys)
    assert_one_line_error(code, stderr, "python -m tqops.bench store: error: ", flag)


def test_quality_out_that_is_a_file_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(bench_cli.BENCHES, "quality", lambda args: pytest.fail("the benchmark ran"))
    (tmp_path / "file").write_text("")
    code, stderr = run_cli(bench_cli.main, ["quality", "--out", str(tmp_path / "file")], capsys)
    assert_one_line_error(code, stderr, "python -m tqops.bench quality: error: ", "--out")


def run_module(module: str, *argv: str, env=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV} | dict(env or {})
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env,
                          timeout=120)


def test_store_command_has_help_and_rejects_bad_flags():
    assert "--sweep" in run_module("tqops.bench", "store", "--help").stdout
    done = run_module("tqops.bench", "store", "--bogus")
    assert_one_line_error(done.returncode, done.stderr, "python -m tqops.bench store: error: ", "--bogus")


@no_cuda
def test_store_command_without_cuda_is_one_line():
    done = run_module("tqops.bench", "store")
    assert_one_line_error(done.returncode, done.stderr, "python -m tqops.bench store: error: ", "CUDA")


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tp.dist, "init_process_group", lambda *a, **k: pytest.fail("init_process_group ran"))


@pytest.mark.parametrize("argv, words", [
    pytest.param(["--batches", "x"], "--batches", id="batches-not-int"),
    pytest.param(["--batches", ""], "--batches", id="batches-empty"),
    pytest.param(["--batches", "0"], "--batches", id="batches-zero"),
    pytest.param(["--batches", "1,-3"], "--batches", id="batches-negative"),
    pytest.param(["--ks", "1,y"], "--ks", id="ks-not-int"),
    pytest.param(["--ks", "-1"], "--ks", id="ks-negative"),
    pytest.param(["--ks", "0,16"], "--ks", id="ks-block-size"),
    pytest.param(["--shape", "tiny", "--ks", "16"], "block size 16", id="ks-tiny-block-size"),
    pytest.param(["--context", "-5"], "--context", id="context-negative"),
])
def test_tp_bad_flag_is_one_line_before_init(argv, words, no_torchrun_env, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")  # as under torchrun: the flags are checked first
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "localhost"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    code, stderr = run_cli(tp.main, argv, capsys)
    assert_one_line_error(code, stderr, TP_ERROR, words)


def test_tp_world_size_without_torchrun_is_one_line(no_torchrun_env, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, stderr = run_cli(tp.main, ["--shape", "tiny"], capsys)
    assert_one_line_error(code, stderr, TP_ERROR, "run under torchrun")


def test_tp_out_in_a_non_folder_is_one_line_before_init(no_torchrun_env, tmp_path, monkeypatch, capsys):
    for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "localhost"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    (tmp_path / "file").write_text("")
    code, stderr = run_cli(tp.main, ["--shape", "tiny", "--out", str(tmp_path / "file" / "rows.json")], capsys)
    assert_one_line_error(code, stderr, TP_ERROR, "--out")


# the session's tiny trained pair (pytest fixtures of tests/train), bound here so these tests can use them
tiny_target, tiny_drafter = train_conftest.tiny_target, train_conftest.tiny_drafter


@pytest.mark.parametrize("how", list(WEIGHT_BREAKS))
@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_acceptance_weights_that_do_not_match_config_are_one_line_and_exit_2(flag, how, tiny_target, tiny_drafter,
                                                                              tmp_path):
    """A checkpoint whose config.json is fine but whose safetensors lack a tensor, hold one of another shape or an
    extra one, or are cut short: one line naming the flag and what is wrong, before the study or any output."""
    pair = {"--target": tiny_target[0], "--draft": tiny_drafter[0]}
    pair[flag], words = break_weights(pair[flag], tmp_path / "broken", how)
    out = tmp_path / "out"
    done = run_module("tqops.bench", "acceptance", "--target", pair["--target"], "--draft", pair["--draft"],
                      "--device", "cpu", "--prompts", "1", "--contexts", "16", "--new-tokens", "8", "--formats", "bf16",
                      "--layouts", "both", "--out", out)
    assert_one_line_error(done.returncode, done.stderr, "python -m tqops.bench acceptance: error: ",
                          f"{flag} '{tmp_path / 'broken'}'")
    assert words in done.stderr and done.stdout == "" and not out.exists()
