"""The demo on a trained pair (a tiny one trained for a few CPU steps): held-out prompts, text, acceptance, table."""
import re
import shutil

import pytest

import tqops
from tqops import demo
from tqops import shipped as shipped_pair
from .cli_errors import assert_one_line_error
from .test_demo_cli import DEMO_ERROR, run_main
from .train.conftest import tiny_drafter, tiny_target  # noqa: F401  (pytest fixtures: the tiny trained pair)

SMALL = ["--prompt-tokens", "24", "--max-new-tokens", "10", "--rounds", "1", "--device", "cpu"]
FIRST_HELDOUT = "_threading_local.py"  # the first held-out text in path order


@pytest.fixture
def shipped(tiny_target, tiny_drafter, tmp_path, monkeypatch):
    """The tiny pair where the demo looks for the shipped one."""
    shutil.copytree(tiny_target[0], tmp_path / "target")
    shutil.copytree(tiny_drafter[0], tmp_path / "drafter")
    monkeypatch.setattr(shipped_pair, "TRAINED_DIR", tmp_path)
    return tmp_path


def acceptance_of(out: str) -> float:
    return float(re.search(r"mean acceptance length ([\d.]+)", out).group(1))


def format_rows(out: str) -> dict:
    """``{format: the cells after its name}`` of the per-format table."""
    return {m.group(1): m.group(2).split() for m in re.finditer(rf"^({'|'.join(tqops.FORMATS)})\s+(.*)$", out, re.M)}


def test_checkpoint_pair_prints_decoded_text_acceptance_and_every_format(tiny_target, tiny_drafter, capsys):
    demo.main(["--target", str(tiny_target[0]), "--draft", str(tiny_drafter[0]), "--prompts", "2", "--all-formats",
               "--cache-format", "turboquant_4bit_nc", *SMALL])
    out = capsys.readouterr().out
    assert acceptance_of(out) >= 1
    assert re.search(r"[\d,.]+ tokens/s over 1 rounds of 2 prompts", out)
    assert "same tokens as plain greedy decoding on this cache: yes" in out
    assert f"--- held-out {FIRST_HELDOUT}: the last lines of the 24-token prompt ---" in out
    assert out.count("--- generated (") == 2 and "first continuation: [" not in out  # text, not token ids
    rows = format_rows(out)
    assert list(rows) == list(tqops.FORMATS)
    # tiny target: 3 layers x 1 kv head, drafter 2 layers, head_dim 64; turboquant_4bit_nc slots are 70 bytes
    assert rows["turboquant_4bit_nc"][:2] == ["210", "350"]
    assert rows["turboquant_4bit_nc"][-4:] == ["yes", "<-", "this", "run"]
    for cells in rows.values():
        assert float(cells[4]) >= 1 and cells[5] == "yes"  # acceptance, lossless


def test_shipped_pair_is_the_default(shipped, capsys):
    demo.main(SMALL)
    out = capsys.readouterr().out
    assert "loading the shipped trained pair" in out and "random weights" not in out
    assert f"--- held-out {FIRST_HELDOUT}" in out and out.count("--- generated (") == 1  # one prompt by default
    assert acceptance_of(out) >= 1
    assert all(cells[5] == "yes" for cells in format_rows(out).values())  # every format measured by default


def test_shipped_dflash2_drafter_is_preferred(shipped, capsys):
    """The demo's drafter is the first of DEMO_DRAFTERS the shipped folder holds: DFlash2 where it is there."""
    assert shipped_pair.demo_pair() == (shipped / "target", shipped / "drafter")
    shutil.copytree(shipped / "drafter", shipped / "dflash2-drafter")
    assert shipped_pair.demo_pair() == (shipped / "target", shipped / "dflash2-drafter")
    demo.main(["--no-all-formats", *SMALL])
    assert "(target/, dflash2-drafter/)" in capsys.readouterr().out


def test_the_real_shipped_folder_demos_the_dflash2_drafter():
    from tqops.models import DFlashDrafter
    from tqops.models.dflash2 import DFlash2Drafter

    root = shipped_pair.PRETRAINED_DIR / "stdlib-py"
    assert shipped_pair.demo_pair(root) == (root / "target", root / "dflash2-drafter")
    names = [demo.drafter_name(cls.__new__(cls)) for cls in (DFlash2Drafter, DFlashDrafter)] + [demo.drafter_name(None)]
    assert names == ["DFlash2", "DFlash", "none"]


def test_random_weights_flag_skips_the_shipped_pair(shipped, capsys):
    demo.main(["--random-weights", "--prompts", "1", *SMALL])
    out = capsys.readouterr().out
    assert "loading" not in out and "random weights" not in out and "first continuation: [" in out
    assert re.search(r"turboquant_4bit_nc\s+1,072 ", out)  # the random 4-layer target, 2 kv heads x 134 B


def test_untrained_shipped_pair_says_so_in_one_line_and_runs_random_weights(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shipped_pair, "TRAINED_DIR", tmp_path)
    demo.main(["--prompts", "1", *SMALL])
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("random weights:")]
    assert len(notes) == 1 and "python -m tqops.train target --out" in notes[0]
    assert "first continuation: [" in out and "tokens/s" in out


@pytest.mark.parametrize("argv, flag", [
    pytest.param("--prompt-tokens 0", "--prompt-tokens", id="prompt-tokens-zero"),
    pytest.param("--random-weights --target {target}", "--random-weights", id="random-weights-with-target"),
    pytest.param("--target {target} --all-formats", "--all-formats", id="all-formats-without-drafter"),
    pytest.param("--all-formats --oracle-k 2", "--all-formats", id="all-formats-with-oracle"),
    pytest.param("--oracle-k 9", "--oracle-k", id="oracle-k-above-the-shipped-block-size"),
    pytest.param("--prompt-tokens 100000", "--prompt-tokens", id="prompt-tokens-longer-than-any-text"),
])
def test_bad_flag_is_one_line_and_exit_2(argv, flag, shipped, capsys):
    code, stderr = run_main(argv.format(target=shipped / "target").split() + ["--device", "cpu"], capsys)
    assert_one_line_error(code, stderr, DEMO_ERROR, flag)
