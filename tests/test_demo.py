"""The README's main job runs end to end (small settings) and reports what it promises."""
import re

from tqops import demo


def test_demo_runs_and_reports(capsys):
    demo.main(["--random-weights", "--prompts", "2", "--max-new-tokens", "12", "--rounds", "1", "--oracle-k", "3",
               "--cache-format", "turboquant_3bit_nc"])
    out = capsys.readouterr().out
    acceptance = float(re.search(r"mean acceptance length ([\d.]+)", out).group(1))
    # 11 tokens after the prefill's first, in steps of at most k + 1 = 4: 4, 4, 3.
    assert abs(acceptance - 11 / 3) < 1e-2
    spec = float(re.search(r"([\d,.]+) tokens/s over 1 rounds", out).group(1).replace(",", ""))
    plain, ratio = re.search(r"plain greedy decoding, the same way \(eager\): ([\d,.]+) tokens/s; speculative "
                             r"decoding is ([\d.]+)x that", out).groups()
    plain, ratio = float(plain.replace(",", "")), float(ratio)
    # both rates are printed to 0.1 tokens/s and the ratio to 0.01: on a loaded machine the rates are a few tokens/s,
    # so the printed rates' rounding alone moves their quotient by ratio * (0.05 / spec + 0.05 / plain)
    assert abs(spec / plain - ratio) <= ratio * (0.05 / spec + 0.05 / plain) + 0.005 + 1e-9
    assert re.search(r"turboquant_3bit_nc\s+816 .*<- this run", out)  # 102 B x 2 kv heads x 4 layers


def test_hybrid_demo_runs_dflash_over_a_gated_deltanet_target(capsys):
    demo.main(["--hybrid", "--prompts", "2", "--max-new-tokens", "12", "--rounds", "1", "--oracle-k", "3"])
    out = capsys.readouterr().out
    assert abs(float(re.search(r"mean acceptance length ([\d.]+)", out).group(1)) - 11 / 3) < 1e-2
    # one full-attention layer holds KV (134 B x 2 kv heads), the three Gated DeltaNet layers hold states
    assert re.search(r"1 attention layers .* its 3 Gated DeltaNet layers keep states", out)
    assert re.search(r"turboquant_4bit_nc\s+268 .*<- this run", out)
