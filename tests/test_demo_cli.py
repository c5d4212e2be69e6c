"""The demo CLI rejects every bad flag with one stderr line naming it and exit status 2, before building a model."""
import json
import subprocess
import sys

import pytest
import torch

from tqops import demo
from tqops.models import Qwen3ForCausalLM

from .cli_errors import assert_one_line_error, run_cli

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
    # Target weights are not on disk, so stand in the random target; the drafter folder then has no weights.
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
