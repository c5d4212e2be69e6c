"""A tiny random Qwen3 saved by transformers loads into ours: same logits (fp32, bf16 cache), same greedy tokens."""
import pytest
import torch

from tqops.graphs import ForwardContext, build_metadata, set_forward_context
from tqops.models import Qwen3ForCausalLM, generate

transformers = pytest.importorskip("transformers")

PROMPTS = [[3, 17, 42, 8, 99, 5, 61, 23, 77, 12, 4, 88, 31], [50, 2, 9], [11, 64, 38, 90, 7, 26]]


def _hf_model(path, tie, sliding):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, rope_theta=5000.0, tie_word_embeddings=tie, initializer_range=0.5,
        use_sliding_window=sliding, sliding_window=4 if sliding else None, max_window_layers=1,
    )
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def _prefill_logits(model, prompts, device="cpu"):
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)
    per_seq = 4
    table = torch.arange(len(prompts) * per_seq, dtype=torch.int32, device=device).view(-1, per_seq)
    model.allocate_cache(table.numel(), 16)
    meta = build_metadata(lens, lens, table, 16, int(lens.sum()))
    ids = torch.tensor(sum(prompts, []), device=device)
    pos = torch.cat([torch.arange(len(p), device=device) for p in prompts])
    with set_forward_context(ForwardContext({0: meta, 1: meta})):
        return model.compute_logits(model(ids, pos)).split(lens.tolist())


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device=model.device)
    for _ in range(n):
        ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("tie,sliding,fmt,tol", [(False, False, "bf16", 0.02), (True, True, "bf16", 0.02),
                                                 (True, True, "fp16", 0.003)],
                         ids=["untied-bf16", "tied-sliding-bf16", "tied-sliding-fp16"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@torch.no_grad()
def test_logits_and_greedy_match_transformers(tmp_path, tie, sliding, fmt, tol, device):
    """On CUDA the layers run the Triton kernels (store, attention, the fused norm and RoPE ops) against
    transformers' eager modules; on CPU the torch references."""
    hf = _hf_model(tmp_path, tie, sliding).to(device)
    ours = Qwen3ForCausalLM.from_pretrained(tmp_path, cache_format=fmt, dtype=torch.float32, device=device)
    assert [a.sliding_window for a in ours.attention_layers] == ([None, 4, 4] if sliding else [None] * 3)
    for p, got in zip(PROMPTS, _prefill_logits(ours, PROMPTS, device)):
        want = hf(torch.tensor([p], device=device)).logits[0]
        # the cache rounds K/V to bf16/fp16 (errors scale with its mantissa), everything else is fp32
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    result = generate(ours, PROMPTS, 10)
    assert result.tokens == [_hf_greedy(hf, p, 10) for p in PROMPTS]
