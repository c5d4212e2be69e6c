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
    assert abs(spec / float(plain.replace(",", "")) - float(ratio)) < 0.01 * float(ratio) + 0.01
    assert re.search(r"turboquant_3bit_nc\s+816 .*<- this run", out)  # 102 B x 2 kv heads x 4 layers
