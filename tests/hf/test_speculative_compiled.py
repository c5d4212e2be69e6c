"""``generate_speculative(compile=True)``: the verify forward and the drafter step compiled with fullgraph (replayed
as CUDA graphs on CUDA) give the eager loop's greedy tokens, with v1 and DFlash2 drafters and with a proposer whose
rows roll back different tails; a hybrid target is refused before anything runs."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tqops.hf import PagedKVCache, generate_speculative  # noqa: E402

from .test_hybrid import _tqops as tqops_hybrid  # noqa: E402
from .test_speculative import BLOCK, PerRowOracle, _tqops_model, random_drafter  # noqa: E402
from .test_speculative_dflash2 import random_dflash2_drafter  # noqa: E402
from .tiny import left_padded  # noqa: E402

NEW_TOKENS = 12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(model, drafter, compile, lengths=(11, 4, 8), **kwargs):
    ids, mask = left_padded(list(lengths))
    return generate_speculative(model, drafter, ids.to(DEVICE), NEW_TOKENS, attention_mask=mask.to(DEVICE),
                                cache_format="turboquant_4bit_nc", compile=compile, **kwargs)


@pytest.mark.parametrize("drafter_kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_greedy_equals_eager(arch, drafter_kind):
    torch._dynamo.reset()
    model = _tqops_model(arch).to(DEVICE)
    make = random_drafter if drafter_kind == "dflash" else random_dflash2_drafter
    drafter = make(model).to(DEVICE)
    eager = _run(model, drafter, False)
    compiled = _run(model, drafter, True)
    assert compiled.tokens == eager.tokens and compiled.acceptance_lengths == eager.acceptance_lengths
    name = "drafter" if drafter_kind == "dflash" else "drafter_step(temperature=0.0)"
    report = compiled.compile_reports[name]
    assert report.compilations >= 1 and not report.graph_breaks


def test_calls_of_another_batch_and_width_compile_once_more_and_agree():
    """A second shape recompiles with dynamic sizes (the new cache's max_cache_len too, which the capacity check's
    message must not format), then serves every later call."""
    torch._dynamo.reset()
    model = _tqops_model("qwen3").to(DEVICE)
    drafter = random_drafter(model).to(DEVICE)
    for lengths in ((11, 4, 8), (6, 9), (11, 4, 8), (5,)):
        assert _run(model, drafter, True, lengths).tokens == _run(model, drafter, False, lengths).tokens, lengths


@pytest.mark.smoke
def test_compiled_verify_rolls_rows_back_as_eager():
    """A proposer right about a different number of tokens per row: every step rolls back different tails."""
    torch._dynamo.reset()
    model = _tqops_model("qwen3").to(DEVICE)
    reference = _run(model, random_drafter(model).to(DEVICE), False).tokens
    oracle = PerRowOracle(reference, [15, 0, 6], BLOCK, model.config.vocab_size)
    cache = PagedKVCache(model.config, "turboquant_4bit_nc", max_batch_size=3, max_cache_len=64, device=DEVICE)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = _run(model, None, True, proposer=oracle, past_key_values=cache)
    assert compiled.tokens == reference and max(sum(compiled.acceptance_lengths, [])) > 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1  # the verify forward, one graph


def test_compile_refuses_a_hybrid_target_and_a_non_bool():
    model = tqops_hybrid()
    drafter = random_drafter(model)
    ran = []
    hook = model.model.register_forward_pre_hook(lambda *a: ran.append(1))
    try:
        with pytest.raises(NotImplementedError, match="compile=True runs dense targets"):
            _run(model, drafter, True)
        with pytest.raises(TypeError, match="compile must be a bool, got str 'yes'"):
            _run(model, drafter, "yes")
    finally:
        hook.remove()
    assert not ran
