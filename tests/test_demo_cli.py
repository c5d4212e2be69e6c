"""The demo CLI rejects every bad flag with one stderr line naming it and exit status 2, before building a model."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from tqops import demo
from tqops import shipped
from tqops.models import Qwen3ForCausalLM

from .cli_errors import assert_one_line_error, run_cli
from .train import conftest as train_conftest
from .train.helpers import WEIGHT_BREAKS, break_weights, run_module

SMALL_QWEN3 = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=128)
SMALL_DFLASH = dict(SMALL_QWEN3, num_hidden_layers=1, block_size=4,
                    dflash_config={"target_layer_ids": [1, 3], "mask_token_id": 511})
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown when CUDA is missing")

# (argv, with {ckpt} for the folder of the ckpt fixture; the flag the error must name)
BAD_FLAGS = [
    pytest.param("--rounds 0", "--rounds", id="rounds-zero"),
    pytest.param("--prompts 0", "--prompts", id="prompts-zero"),
    pytest.param("--max-new-tokens -1", "--max-new-tokens", id="max-new-tokens-negative"),
    pytest.param("--budget-gib 0", "--budget-gib", id="budget-zero"),
    pytest.param("--budget-gib nan", "--budget-gib", id="budget-nan"),
    pytest.param("--budget-gib inf", "--budget-gib", id="budget-inf"),
    pytest.param("--device cuda", "--device", id="device-cuda-without-cuda", marks=NO_CUDA),
    pytest.param("--device cuda:x", "--device", id="device-unparsable"),
    pytest.param("--device mps", "--device", id="device-unsupported"),
    pytest.param("--random-weights --device cpu:1", "--device", id="device-cpu-index"),
    pytest.param("--random-weights --oracle-k 9", "--oracle-k", id="oracle-k-above-block-size"),
    pytest.param("--oracle-k -1", "--oracle-k", id="oracle-k-negative"),
    pytest.param("--draft {ckpt}/dflash", "--draft", id="draft-without-target"),
    pytest.param("--target {ckpt}/nowhere", "--target", id="target-missing"),
    pytest.param("--target {ckpt}/empty", "--target", id="target-without-config"),
    pytest.param("--target {ckpt}/not_json", "--target", id="target-config-not-json"),
    pytest.param("--target {ckpt}/incomplete", "--target", id="target-config-incomplete"),
    pytest.param("--target {ckpt}/qwen3", "--target", id="target-without-weights"),
    pytest.param("--target {ckpt}/qwen3 --draft {ckpt}/nowhere", "--draft", id="draft-missing"),
    pytest.param("--target {ckpt}/qwen3 --oracle-k 2", "--oracle-k", id="oracle-k-without-drafter"),
    pytest.param("--target {ckpt}/qwen3 --draft {ckpt}/dflash --oracle-k 5", "--oracle-k",
                 id="oracle-k-above-draft-block-size"),
    pytest.param("--bogus", "--bogus", id="unknown-flag"),
    pytest.param("--rounds x", "--rounds", id="rounds-not-int"),
    pytest.param("--cache-format nope", "--cache-format", id="cache-format-unknown"),
    pytest.param("--rounds", "--rounds", id="rounds-missing-value"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    for name, config in (("qwen3", json.dumps(SMALL_QWEN3)), ("dflash", json.dumps(SMALL_DFLASH)),
                         ("not_json", "{"), ("incomplete", "{}"), ("empty", None)):
        (root / name).mkdir()
        if config is not None:
            (root / name / "config.json").write_text(config)
    (root / "bad_tokenizer").mkdir()
    (root / "bad_tokenizer" / "config.json").write_text(json.dumps(SMALL_QWEN3))
    (root / "bad_tokenizer" / "tokenizer.json").write_text("{")
    return root


DEMO_ERROR = "python -m tqops.demo: error: "


def run_main(argv, capsys):
    return run_cli(demo.main, argv, capsys)


@pytest.mark.parametrize("argv, flag", BAD_FLAGS)
def test_bad_flag_is_one_line_and_exit_2(argv, flag, ckpt, capsys, monkeypatch):
    monkeypatch.setattr(demo, "random_models", lambda *a, **k: pytest.fail("built a model before rejecting flags"))
    code, stderr = run_main(argv.format(ckpt=ckpt).split(), capsys)
    assert_one_line_error(code, stderr, DEMO_ERROR, flag)


def test_draft_load_error_names_draft(ckpt, capsys, monkeypatch):
    # The load itself names --draft when a checkpoint passes the header pre-check but fails to load: skip the
    # pre-check, stand in the random target (its weights are not on disk); the drafter folder then has no weights.
    monkeypatch.setattr(demo, "checkpoint_config_or_exit", lambda *a, **k: (None, None))
    monkeypatch.setattr(demo, "drafter_config_or_exit", lambda *a, **k: None)
    target, _ = demo.random_models("bf16", "cpu", torch.float32)
    monkeypatch.setattr(Qwen3ForCausalLM, "from_pretrained", classmethod(lambda cls, path, **kw: target))
    code, stderr = run_main(["--target", str(ckpt / "qwen3"), "--draft", str(ckpt / "dflash"), "--device", "cpu"],
                            capsys)
    assert_one_line_error(code, stderr, DEMO_ERROR, "--draft")
    assert "FileNotFoundError" in stderr


@pytest.mark.parametrize("argv, flag", [pytest.param(["--rounds", "0"], "--rounds", id="rounds-zero"),
                                        pytest.param(["--bogus"], "--bogus", id="unknown-flag")])
def test_terminal_sees_one_line_not_a_traceback(argv, flag):
    proc = subprocess.run([sys.executable, "-m", "tqops.demo", *argv], capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, DEMO_ERROR, flag)
    assert proc.stdout == ""


def test_help_still_works(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--help"])
    assert exit_info.value.code == 0
    assert "--oracle-k" in capsys.readouterr().out


def test_tiny_cpu_run_still_works(capsys):
    demo.main(["--prompts", "1", "--max-new-tokens", "4", "--rounds", "1", "--device", "cpu"])
    assert "tokens/s" in capsys.readouterr().out


SHIPPED_TOKENIZER = shipped.TRAINED_DIR / "target" / "tokenizer.json"
TORCHRUN_ENV = dict(RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29599")


def no_models(monkeypatch, no_process_group: bool = False):
    """Building or loading a model (and with ``no_process_group``, entering ``tensor_parallel``) fails the test:
    the flags are rejected first."""
    monkeypatch.setattr(demo, "random_models", lambda *a, **k: pytest.fail("built a model before rejecting flags"))
    monkeypatch.setattr(Qwen3ForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: pytest.fail("loaded a model before rejecting flags")))
    if no_process_group:
        monkeypatch.setattr(demo, "tensor_parallel", lambda *a: pytest.fail("started a process group before rejecting"))


@pytest.mark.parametrize("argv, words", [
    pytest.param("--random-weights", "num_attention_heads of the random target (4)", id="random-heads"),
    pytest.param("--target {ckpt}/qwen3", "num_attention_heads of --target (4)", id="target-heads"),
])
def test_tp_not_dividing_the_heads_is_one_line_before_the_process_group(argv, words, ckpt, capsys, monkeypatch):
    no_models(monkeypatch, no_process_group=True)
    for name, value in dict(TORCHRUN_ENV, WORLD_SIZE="3").items():
        monkeypatch.setenv(name, value)
    code, stderr = run_main(argv.format(ckpt=ckpt).split() + ["--tp", "3", "--device", "cpu"], capsys)
    assert_one_line_error(code, stderr, DEMO_ERROR, "--tp 3")
    assert words in stderr


def test_world_size_without_torchrun_env_is_one_line(capsys, monkeypatch):
    no_models(monkeypatch, no_process_group=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    code, stderr = run_main(["--tp", "2", "--device", "cpu", "--random-weights"], capsys)
    assert_one_line_error(code, stderr, DEMO_ERROR, "RANK")
    assert "torchrun" in stderr


def test_corrupt_tokenizer_names_target_before_loading(ckpt, capsys, monkeypatch):
    no_models(monkeypatch)
    code, stderr = run_main(["--target", str(ckpt / "bad_tokenizer"), "--device", "cpu"], capsys)
    assert_one_line_error(code, stderr, DEMO_ERROR, "--target")
    assert "tokenizer.json" in stderr


@pytest.mark.skipif(not SHIPPED_TOKENIZER.is_file(), reason="needs the shipped tokenizer.json")
def test_max_new_tokens_longer_than_any_text_leads_with_it(tmp_path, capsys, monkeypatch):
    no_models(monkeypatch)
    (tmp_path / "config.json").write_text(json.dumps(SMALL_QWEN3))
    shutil.copy(SHIPPED_TOKENIZER, tmp_path / "tokenizer.json")
    code, stderr = run_main(["--target", str(tmp_path), "--max-new-tokens", "1000000", "--device", "cpu"], capsys)
    assert_one_line_error(code, stderr, DEMO_ERROR, "--max-new-tokens")
    assert stderr.startswith(DEMO_ERROR + "--max-new-tokens 1000000:")


# the session's tiny trained pair (pytest fixtures of tests/train), bound here so these tests can use them
tiny_target, tiny_drafter = train_conftest.tiny_target, train_conftest.tiny_drafter


@pytest.mark.parametrize("how", list(WEIGHT_BREAKS))
@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_weights_that_do_not_match_config_are_one_line_and_exit_2(flag, how, tiny_target, tiny_drafter, tmp_path):
    """A checkpoint whose config.json is fine but whose safetensors lack a tensor, hold one of another shape or an
    extra one, or are cut short: one line naming the flag and what is wrong, no traceback."""
    pair = {"--target": tiny_target[0], "--draft": tiny_drafter[0]}
    pair[flag], words = break_weights(pair[flag], tmp_path / "broken", how)
    done = run_module("tqops.demo", "--target", pair["--target"], "--draft", pair["--draft"], "--device", "cpu",
                      "--rounds", "1", "--max-new-tokens", "8", "--prompt-tokens", "24")
    assert_one_line_error(done.returncode, done.stderr, DEMO_ERROR, f"{flag} '{tmp_path / 'broken'}'")
    assert words in done.stderr and "tokens/s" not in done.stdout
    # the header pre-check's words, not the load's (which would name the tensor too, after reading the weights)
    assert "weights do not match config.json" in done.stderr or "is not a readable safetensors file" in done.stderr


@pytest.mark.parametrize("argv, words", [(["--hybrid", "--target", "x"], "--hybrid"),
                                         (["--hybrid", "--tp", "2"], "--hybrid")])
def test_hybrid_flag_conflicts_are_one_line(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(demo, "random_models", lambda *a, **k: pytest.fail("built a model before rejecting flags"))
    code, stderr = run_main(argv, capsys)
    assert_one_line_error(code, stderr, DEMO_ERROR, words)


def test_a_config_the_model_rejects_is_named_by_its_folder(tmp_path, capsys, monkeypatch):
    """The error quotes the --target folder, not the repr of the config dict built from it."""
    monkeypatch.setattr(demo, "random_models", lambda *a, **k: pytest.fail("built a model before rejecting flags"))
    (tmp_path / "config.json").write_text(json.dumps(dict(SMALL_QWEN3, model_type="qwen3", hidden_act="gelu")))
    code, stderr = run_main(["--target", str(tmp_path)], capsys)
    assert_one_line_error(code, stderr, DEMO_ERROR, f"--target {str(tmp_path)!r}: config.json is not")
    assert "{'" not in stderr
