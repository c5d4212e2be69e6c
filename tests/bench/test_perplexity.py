"""``python -m tqops.bench quality``: held-out perplexity per cache format of a transformers checkpoint (the shipped
target by default) through forwards without a cache; its flags; the attention-cosine table behind --attention."""
import json
import math

import pytest
import torch

pytest.importorskip("transformers")
from tqops.bench import __main__ as bench_cli  # noqa: E402
from tqops.bench.perplexity import bench_perplexity, perplexity_windows  # noqa: E402
from tqops.shipped import TRAINED_DIR  # noqa: E402

from ..cli_errors import assert_one_line_error, run_cli  # noqa: E402


def test_windows_are_consecutive_slices_of_the_heldout_files():
    from transformers import AutoTokenizer

    from tqops.train import corpus

    tok = AutoTokenizer.from_pretrained(TRAINED_DIR / "target")
    windows = perplexity_windows(tok, 3, 40)
    first = tok(corpus.read_heldout()[0].text)["input_ids"]
    assert windows.shape == (3, 40) and windows[0].tolist() == first[:40] and windows[1].tolist() == first[40:80]
    assert perplexity_windows(tok, 3, 40).equal(windows)  # the same texts on every run


def test_rows_per_format_against_the_models_own_attention():
    rows = bench_perplexity(formats=("bf16", "turboquant_3bit_nc"), windows=2, tokens=48)
    assert [r["format"] for r in rows] == ["sdpa (no cache format)", "bf16", "turboquant_3bit_nc"]
    exact = rows[0]["loss nats/token"]
    for r in rows:
        assert math.isfinite(r["loss nats/token"]) and r["windows"] == 2 and r["tokens"] == 48
        assert r["perplexity"] == pytest.approx(math.exp(r["loss nats/token"]))
        assert r["loss vs sdpa"] == pytest.approx(r["loss nats/token"] - exact)
    assert abs(rows[1]["loss vs sdpa"]) < 1e-3  # bf16 keys of an fp32 model: a rounding away
    assert abs(rows[2]["loss vs sdpa"]) > abs(rows[1]["loss vs sdpa"])


def test_command_writes_the_table_and_the_plot(tmp_path, capsys):
    assert bench_cli.main(["quality", "--windows", "1", "--tokens", "32", "--formats", "fp8_e4m3",
                           "--out", str(tmp_path)]) == 0
    assert "| fp8_e4m3 |" in capsys.readouterr().out
    assert (tmp_path / "perplexity.png").stat().st_size > 0
    assert [r["format"] for r in json.loads((tmp_path / "quality.json").read_text())][1:] == ["fp8_e4m3"]


def test_attention_flag_keeps_the_cosine_table(monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "attention_quality", lambda device: [dict(format="bf16", mean_cosine=1.0)])
    assert bench_cli.main(["quality", "--attention"]) == 0
    assert "| bf16 | 1.00000 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, flag", [
    ("quality --windows 0", "--windows"),
    ("quality --tokens -5", "--tokens"),
    ("quality --formats bf16,nope", "--formats"),
    ("quality --model {tmp}/nowhere", "--model"),
])
def test_bad_flags_are_one_line_before_any_work(argv, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(bench_cli.BENCHES, "quality", lambda args: pytest.fail("the benchmark ran"))
    code, stderr = run_cli(bench_cli.main, argv.format(tmp=tmp_path).split(), capsys)
    assert_one_line_error(code, stderr, "python -m tqops.bench quality: error: ", flag)


def test_cpu_rows_use_fp32_weights(monkeypatch):
    """On the CPU the checkpoint loads in fp32 (on CUDA in bf16, the dtype a user decodes in)."""
    seen = {}
    import transformers

    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen["dtype"] = kwargs.get("dtype")
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    bench_perplexity(formats=("bf16",), windows=1, tokens=16, device="cpu")
    assert seen["dtype"] == torch.float32
