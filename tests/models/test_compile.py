"""compile=True: the target and drafter steps compile with fullgraph, zero graph breaks, and match eager tokens."""
import pytest
import torch

from tqops.models import DFlashDrafter, Qwen3ForCausalLM, generate

from .test_generate import PROMPTS

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_compiled_speculative_decoding_matches_eager(target_path, drafter_path, device):
    torch._dynamo.reset()

    def load():
        target = Qwen3ForCausalLM.from_pretrained(target_path, cache_format="turboquant_4bit_nc", dtype=torch.float32,
                                                  layer_cache_formats={0: "bf16", -1: "bf16"}, device=device)
        return target, DFlashDrafter.from_pretrained(drafter_path, target=target, cache_format="turboquant_3bit_nc")

    target, drafter = load()
    eager = generate(target, PROMPTS, 12, drafter=drafter)
    plain = generate(target, PROMPTS, 12)
    target, drafter = load()
    compiled = generate(target, PROMPTS, 12, drafter=drafter, compile=True)
    assert compiled.tokens == eager.tokens == plain.tokens
    assert compiled.acceptance_lengths == eager.acceptance_lengths
    reports = compiled.compile_reports
    assert set(reports) == {"target", "drafter", "drafter_context"}
    for name, report in reports.items():
        # prefill and every verify/draft step (token counts vary as sequences finish) share one graph
        assert report.graph_breaks == {} and report.compilations == 1, (name, str(report))
