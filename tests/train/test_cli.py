"""python -m tqops.train: every bad flag is one stderr line naming it and exit status 2; a tiny run goes end to end."""
import json

import pytest
import torch

from tqops.train.__main__ import main

from ..cli_errors import assert_one_line_error, run_cli
from .conftest import TINY
from .helpers import WEIGHT_BREAKS, break_weights, run_module

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown when CUDA is missing")

# (argv with {target} for the tiny target's folder and {tmp} for a scratch folder, the flag the error must name)
BAD_FLAGS = [
    pytest.param("", "command", id="no-command"),
    pytest.param("bogus", "bogus", id="unknown-command"),
    pytest.param("target", "--out", id="target-without-out"),
    pytest.param("target --out {tmp} --steps 0", "--steps", id="steps-zero"),
    pytest.param("target --out {tmp} --steps x", "--steps", id="steps-not-int"),
    pytest.param("target --out {tmp} --minutes nan", "--minutes", id="minutes-nan"),
    pytest.param("target --out {tmp} --minutes -1", "--minutes", id="minutes-negative"),
    pytest.param("target --out {tmp} --minutes 1 --steps 2", "--steps", id="minutes-and-steps"),
    pytest.param("target --out {tmp} --lr 0", "--lr", id="lr-zero"),
    pytest.param("target --out {tmp} --batch-size 0", "--batch-size", id="batch-size-zero"),
    pytest.param("target --out {tmp} --warmup -1", "--warmup", id="warmup-negative"),
    pytest.param("target --out {tmp} --head-dim 96", "--head-dim", id="head-dim-unsupported"),
    pytest.param("target --out {tmp} --heads 6 --kv-heads 4", "--kv-heads", id="heads-not-multiple"),
    pytest.param("target --out {tmp} --layers 0", "--layers", id="layers-zero"),
    pytest.param("target --out {tmp} --dropout 1", "--dropout", id="dropout-one"),
    pytest.param("target --out {tmp} --device mps", "--device", id="device-unsupported"),
    pytest.param("target --out {tmp} --device cuda:x", "--device", id="device-unparsable"),
    pytest.param("target --out {tmp} --device cuda", "--device", id="device-cuda-without-cuda", marks=NO_CUDA),
    pytest.param("target --out {tmp} --device cpu:3", "--device", id="device-cpu-index"),
    pytest.param("target --out {tmp} --tokenizer {tmp}/nowhere", "--tokenizer", id="tokenizer-missing"),
    pytest.param("target --out {tmp} --tokenizer {tmp}", "--tokenizer", id="tokenizer-folder-empty"),
    pytest.param("tokenizer --out {tmp} --vocab-size 10", "--vocab-size", id="vocab-size-small"),
    pytest.param("drafter --target {tmp}/nowhere --out {tmp}", "--target", id="drafter-target-missing"),
    pytest.param("drafter --target {target} --out {tmp} --target-layer-ids 0,9", "--target-layer-ids",
                 id="layer-ids-out-of-range"),
    pytest.param("drafter --target {target} --out {tmp} --target-layer-ids 1,x", "--target-layer-ids",
                 id="layer-ids-not-ints"),
    pytest.param("drafter --target {target} --out {tmp} --block-size 1", "--block-size", id="block-size-one"),
    pytest.param("drafter --target {target} --out {tmp} --seq-len 64 --blocks-per-sequence 60",
                 "--blocks-per-sequence", id="too-many-blocks"),
    pytest.param("drafter --target {target} --out {tmp} --greedy-new-tokens 8", "--greedy-new-tokens",
                 id="greedy-new-tokens-under-block"),
    pytest.param("drafter --target {target} --out {tmp} --greedy-new-tokens 100", "--blocks-per-sequence",
                 id="greedy-blocks-do-not-fit"),
    pytest.param("drafter --target {target} --out {tmp} --greedy-minutes 0", "--greedy-minutes",
                 id="greedy-minutes-zero"),
    pytest.param("drafter --target {target} --out {tmp} --data text", "--data", id="data-unknown"),
    pytest.param("drafter --target {target} --out {tmp} --loss-decay -1", "--loss-decay", id="loss-decay-negative"),
    pytest.param("drafter --target {target} --out {tmp} --arch dflash3", "--arch", id="arch-unknown"),
    pytest.param("drafter --target {target} --out {tmp} --selector-top-k 4", "--selector-top-k",
                 id="dflash2-flag-without-dflash2"),
    pytest.param("drafter --target {target} --out {tmp} --arch dflash --conv-kernel-size 3", "--conv-kernel-size",
                 id="dflash2-flag-with-dflash"),
    pytest.param("drafter --target {target} --out {tmp} --arch dflash2 --conv-group-size 24", "--conv-group-size",
                 id="conv-group-size-not-dividing-hidden"),
    pytest.param("drafter --target {target} --out {tmp} --arch dflash2 --conv-kernel-size 0", "--conv-kernel-size",
                 id="conv-kernel-size-zero"),
    pytest.param("drafter --target {target} --out {tmp} --arch dflash2 --selector-rank -2", "--selector-rank",
                 id="selector-rank-negative"),
    pytest.param("drafter --target {target} --out {tmp} --arch dflash2 --selector-top-k 5000", "--selector-top-k",
                 id="selector-top-k-over-vocab"),
    pytest.param("drafter --target {target} --out {tmp} --arch dflash2 --selector-loss-weight nan",
                 "--selector-loss-weight", id="selector-loss-weight-nan"),
    pytest.param("drafter --target {target} --out {tmp} --intermediate-size 0", "--intermediate-size",
                 id="drafter-intermediate-size-zero"),
    pytest.param("accept --target {target} --drafter {tmp}/nowhere", "--drafter", id="accept-drafter-missing"),
    pytest.param("accept --target {target} --drafter {target} --cache-format nope", "--cache-format",
                 id="accept-cache-format"),
    pytest.param("plot {tmp}/nowhere.json", "nowhere.json", id="plot-log-missing"),
]


@pytest.mark.parametrize("argv,flag", BAD_FLAGS)
def test_bad_flag_is_one_stderr_line_and_exit_2(argv, flag, tiny_target, tmp_path, capsys):
    code, err = run_cli(main, argv.format(target=tiny_target[0], tmp=tmp_path).split(), capsys)
    assert_one_line_error(code, err, "python -m tqops.train", flag)
    assert not any(tmp_path.iterdir()) or argv.startswith(("target --out {tmp} --tokenizer {tmp}", "plot"))


def test_tiny_target_run_and_plot_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "target"
    argv = (f"target --out {out} --steps 2 --seq-len 32 --batch-size 2 --train-files 2 --eval-files 1 --evals 1 "
            f"--hidden-size {TINY.hidden_size} --layers 1 --heads 1 --kv-heads 1 --intermediate-size 64 --device cpu")
    assert main(argv.split()) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2 and summary["compiled"] is False and (out / "model.safetensors").is_file()
    (out / "loss.png").unlink()
    assert main(["plot", str(out / "training_log.json")]) == 0
    assert (out / "loss.png").stat().st_size > 1000


def _copy_target(target, tmp_path, name: str, config=None, drop=()):
    """A copy of the tiny target's folder under ``tmp_path / name``, its config.json replaced by ``config`` (a
    function of the original dict, or a JSON value) and the files in ``drop`` left out."""
    import shutil

    folder = tmp_path / name
    shutil.copytree(target, folder, ignore=shutil.ignore_patterns(*drop) if drop else None)
    if config is not None:
        raw = json.loads((target / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config(raw) if callable(config) else config))
    return folder


# (argv with {target}, {drafter} (the tiny pair), {tmp} (scratch) and {file} (an existing file), the words the one
# error line must hold)
BAD_INPUTS = [
    pytest.param("heldout --out {file}/x.jsonl", "--out", id="heldout-out-under-a-file"),
    pytest.param("heldout --out=", "--out", id="heldout-out-empty"),
    pytest.param("tokenizer --out {file}", "--out", id="tokenizer-out-is-a-file"),
    pytest.param("target --out {file} --steps 1 --device cpu", "--out", id="target-out-is-a-file"),
    pytest.param("drafter --target {target} --out {file} --steps 1 --device cpu", "--out",
                 id="drafter-out-is-a-file"),
    pytest.param("drafter --target {target} --out {tmp}/d --accept-new-tokens 0", "--accept-new-tokens",
                 id="accept-new-tokens-zero"),
    pytest.param("drafter --target {target} --out {tmp}/d --accept-new-tokens -5", "--accept-new-tokens",
                 id="accept-new-tokens-negative"),
    pytest.param("drafter --target {target} --out {tmp}/d --target-layer-ids=", "--target-layer-ids",
                 id="layer-ids-empty"),
    pytest.param("accept --target {target} --drafter {target} --device cpu", "--drafter", id="accept-drafter-is-target"),
    pytest.param("accept --target {drafter} --drafter {drafter} --device cpu", "--target", id="accept-target-is-drafter"),
    pytest.param("accept --target {target} --drafter {drafter} --prompt-tokens 100000 --device cpu", "--prompt-tokens",
                 id="accept-prompt-tokens-too-long"),
    pytest.param("accept --target {target} --drafter {drafter} --new-tokens 100000 --device cpu", "--new-tokens",
                 id="accept-new-tokens-too-long"),
    pytest.param("plot {file}", "not a training log", id="plot-not-json-object"),
    pytest.param("plot {target}/config.json --out {tmp}/x.png", "not a training log", id="plot-config-json"),
    pytest.param("plot {target}/training_log.json --out {file}/x.png", "--out", id="plot-out-under-a-file"),
    pytest.param("plot {target}/training_log.json --out {tmp}", "--out", id="plot-out-is-a-folder"),
]


@pytest.mark.parametrize("argv,words", BAD_INPUTS)
def test_bad_input_is_one_stderr_line_and_exit_2(argv, words, tiny_target, tiny_drafter, tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("[1, 2]")
    argv = argv.format(target=tiny_target[0], drafter=tiny_drafter[0], tmp=tmp_path, file=file)
    code, err = run_cli(main, argv.split(), capsys)
    assert_one_line_error(code, err, "python -m tqops.train", words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and file.read_text() == "[1, 2]"


def test_plot_of_a_json_that_is_no_training_log_writes_nothing(tiny_target, tmp_path, capsys):
    folder = _copy_target(tiny_target[0], tmp_path, "t", drop=("loss.png",))
    code, err = run_cli(main, ["plot", str(folder / "config.json")], capsys)
    assert_one_line_error(code, err, "python -m tqops.train", "not a training log")
    assert not (folder / "loss.png").exists()


@pytest.mark.parametrize("config,words", [
    pytest.param([], "--target", id="config-list"),
    pytest.param(lambda raw: {**raw, "num_hidden_layers": None}, "num_hidden_layers", id="layers-null"),
    pytest.param(lambda raw: {k: v for k, v in raw.items() if k != "model_type"}, "model_type", id="no-model-type"),
])
def test_drafter_target_config_is_checked(config, words, tiny_target, tmp_path, capsys):
    folder = _copy_target(tiny_target[0], tmp_path, "t", config=config)
    code, err = run_cli(main, ["drafter", "--target", str(folder), "--out", str(tmp_path / "d"), "--steps", "1",
                               "--device", "cpu"], capsys)
    assert_one_line_error(code, err, "python -m tqops.train", words)
    assert "--target" in err and not (tmp_path / "d").exists()


def test_accept_target_without_tokenizer(tiny_target, tiny_drafter, tmp_path, capsys):
    folder = _copy_target(tiny_target[0], tmp_path, "t", drop=("tokenizer.json",))
    code, err = run_cli(main, ["accept", "--target", str(folder), "--drafter", str(tiny_drafter[0]), "--device", "cpu"],
                        capsys)
    assert_one_line_error(code, err, "python -m tqops.train", "--target")


def test_corrupt_tokenizer(tiny_target, tmp_path, capsys):
    folder = _copy_target(tiny_target[0], tmp_path, "tok")
    (folder / "tokenizer.json").write_text('{"x":')
    code, err = run_cli(main, ["target", "--out", str(tmp_path / "o"), "--tokenizer", str(folder), "--steps", "1",
                               "--device", "cpu"], capsys)
    assert_one_line_error(code, err, "python -m tqops.train", "--tokenizer")
    assert not (tmp_path / "o").exists()


# (the stage and its flags with {target}/{drafter} for the pair, {out} for a folder it must not make; the flag of the
# checkpoint whose weights are spoilt)
WEIGHT_COMMANDS = [
    pytest.param("accept --target {target} --drafter {drafter} --device cpu", "--target", id="accept-target"),
    pytest.param("accept --target {target} --drafter {drafter} --device cpu", "--drafter", id="accept-drafter"),
    pytest.param("drafter --target {target} --out {out} --steps 1 --device cpu", "--target", id="drafter-target"),
]


@pytest.mark.parametrize("how", list(WEIGHT_BREAKS))
@pytest.mark.parametrize("argv,flag", WEIGHT_COMMANDS)
def test_weights_that_do_not_match_config_are_one_line_and_exit_2(argv, flag, how, tiny_target, tiny_drafter,
                                                                  tmp_path):
    """A checkpoint whose config.json is fine but whose safetensors lack a tensor, hold one of another shape or an
    extra one, or are cut short: one line naming the flag and what is wrong, before any loading or output."""
    pair = {"--target": tiny_target[0], "--drafter": tiny_drafter[0]}
    pair[flag], words = break_weights(pair[flag], tmp_path / "broken", how)
    out = tmp_path / "out"
    done = run_module("tqops.train", *argv.format(target=pair["--target"], drafter=pair["--drafter"],
                                                   out=out).split())
    assert_one_line_error(done.returncode, done.stderr, "python -m tqops.train", f"{flag} '{tmp_path / 'broken'}'")
    assert words in done.stderr and done.stdout == "" and not out.exists()
