"""On CUDA: greedy generate with the tqops cache equals the reference, and the decode step captures as a CUDA graph."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]
from tqops.hf import PagedKVCache  # noqa: E402

from .tiny import left_padded, reference_attention, tiny_model  # noqa: E402


def _cuda_model(arch: str):
    return copy.deepcopy(tiny_model(arch)).cuda()


@pytest.mark.parametrize("arch,fmt", [("llama", "bf16"), ("gpt_oss", "fp16"), ("gemma3", "turboquant_4bit_nc")])
def test_greedy_generate_on_cuda(arch, fmt):
    model = _cuda_model(arch)
    ids, mask = (t.cuda() for t in left_padded([9, 5, 7]))
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, disable_compile=True)
    model.set_attn_implementation(reference_attention(fmt))
    want = model.generate(ids, **kwargs)
    model.set_attn_implementation("tqops")
    got = model.generate(ids, past_key_values=PagedKVCache(model.config, fmt, 3, 64, device="cuda"), **kwargs)
    assert got.tolist() == want.tolist()


@pytest.mark.smoke
def test_decode_step_captures_as_a_cuda_graph():
    """``torch.compile(mode="reduce-overhead", fullgraph=True)``: the decode steps replay one CUDA graph (no
    cudagraph skips, one compilation) and give the eager logits."""
    model = _cuda_model("qwen3")
    model.set_attn_implementation("tqops")
    ids, mask = (t.cuda() for t in left_padded([9, 5]))
    tokens = torch.randint(1, 100, (2, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    positions = (mask.sum(-1, keepdim=True) + torch.arange(6, device="cuda")).long()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    logits = {}
    for name, forward in (("eager", model), ("captured", compiled)):
        cache = PagedKVCache(model.config, "turboquant_4bit_nc", max_batch_size=2, max_cache_len=32, device="cuda")
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
            logits[name] = [forward(tokens[:, t:t + 1], past_key_values=cache,
                                    position_ids=positions[:, t:t + 1]).logits.clone() for t in range(6)]
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
    for want, got in zip(logits["eager"], logits["captured"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("fmt", [pytest.param("turboquant_4bit_nc", marks=pytest.mark.smoke), "turboquant_k8v4",
                                 "fp8_e4m3"])
def test_first_launch_of_a_format_inside_a_captured_step(fmt):
    """A process whose first kernel launch over a format runs inside ``mode="reduce-overhead"`` (a decode step of
    one token after a prefill the graph never saw): the kernels' device constants were made with the cache, not in
    the cudagraph-trees warm-up, whose memory pool would reject them as untracked live tensors."""
    from tqops import device_constants

    model = _cuda_model("qwen3")
    model.set_attn_implementation("tqops")
    torch._dynamo.reset()
    device_constants.clear()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(1, 100, (1, 10), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    prompt, tokens = ids[:, :7], ids[:, 7:]
    logits = {}
    for name, forward in (("captured", compiled), ("eager", model)):
        cache = PagedKVCache(model.config, fmt, max_batch_size=1, max_cache_len=32, device="cuda")
        with torch.no_grad():
            steps = [forward(prompt, past_key_values=cache).logits[:, -1:].clone()]
            for t in range(3):
                position = torch.full((1, 1), 7 + t, device="cuda")
                steps.append(forward(tokens[:, t:t + 1], past_key_values=cache, position_ids=position).logits.clone())
        logits[name] = steps
    for want, got in zip(logits["eager"], logits["captured"]):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


_PAST_CAPACITY = """
import copy, torch
from tqops.hf import PagedKVCache
from tests.hf.tiny import left_padded, tiny_model
model = copy.deepcopy(tiny_model("qwen3")).cuda()
model.set_attn_implementation("tqops")
ids, mask = (t.cuda() for t in left_padded([9, 5]))
compiled = torch.compile(model, mode={mode!r}, fullgraph=True)
cache = PagedKVCache(model.config, "turboquant_4bit_nc", max_batch_size=2, max_cache_len=16, device="cuda")
positions = (mask.sum(-1, keepdim=True) + torch.arange(8, device="cuda")).long()
with torch.no_grad():
    model(ids, attention_mask=mask, past_key_values=cache, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    for t in range(7):  # 9 + 7 = 16 columns: full
        compiled(ids[:, :1], past_key_values=cache, position_ids=positions[:, t:t + 1])
    torch.cuda.synchronize()
    assert cache.get_seq_length() == 16, cache.get_seq_length()
    compiled(ids[:, :1], past_key_values=cache, position_ids=positions[:, 7:8])
    torch.cuda.synchronize()
print("no error")
"""


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["compiled", "captured"])
def test_compiled_step_past_max_cache_len_fails_its_device_assert(mode):
    """A compiled or captured step past max_cache_len (outside generate, which checks first) fails a device-side
    assert that names max_cache_len instead of dropping the tokens. The assert leaves the CUDA context unusable, so
    the step runs in a child process."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", _PAST_CAPACITY.format(mode=mode)], cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0 and "no error" not in run.stdout, run.stdout
    assert "max_cache_len=16" in run.stderr and "device-side assert" in run.stderr, run.stderr[-2000:]
