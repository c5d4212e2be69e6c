"""A tiny random Qwen3 saved by transformers loads into ours: same logits (fp32, bf16 cache), same greedy tokens
wherever the logit error cannot decide them otherwise."""
import pytest
import torch

from tqops.graphs import ForwardContext, build_metadata, set_forward_context
from tqops.models import Qwen3ForCausalLM, generate

transformers = pytest.importorskip("transformers")

# Eight prompts: the greedy check counts only tokens before a near tie, and the Triton kernels' logit error on CUDA
# is larger than the CPU references', which left the first three prompts with 4 decided tokens there.
PROMPTS = [[3, 17, 42, 8, 99, 5, 61, 23, 77, 12, 4, 88, 31], [50, 2, 9], [11, 64, 38, 90, 7, 26],
           [45, 39, 24, 68, 63], [13, 91, 41, 59, 32, 48, 49, 16, 43], [13, 40, 2, 21],
           [42, 16, 50, 93, 46, 4, 23, 76, 74, 52, 29], [54, 18, 96, 87, 3, 37, 73]]


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
    """Greedy tokens, and each step's margin between the top two logits."""
    ids, margins = torch.tensor([prompt], device=model.device), []
    for _ in range(n):
        logits = model(ids).logits[0, -1]
        top = logits.topk(2).values
        margins.append((top[0] - top[1]).item())
        ids = torch.cat([ids, logits.argmax().view(1, 1)], 1)
    return ids[0, len(prompt):].tolist(), margins


def _decided(margins, err):
    """How many leading tokens are decided: a logit error below ``err`` cannot flip a top-2 margin above 2 * err,
    so tokens must agree up to and including the first near tie; after it, greedy may legitimately diverge."""
    return next((i + 1 for i, m in enumerate(margins) if m <= 2 * err), len(margins))


PARITY_CASES = {"untied-bf16": (False, False, "bf16", 0.02), "tied-sliding-bf16": (True, True, "bf16", 0.02),
                "tied-sliding-fp16": (True, True, "fp16", 0.003)}  # tie, sliding, fmt, tol


def _parity_params():
    """(device, tie, sliding, fmt, tol) for every device and case; CUDA tied-sliding-bf16 is in the smoke tier."""
    for device in ("cpu", "cuda"):
        for name, case in PARITY_CASES.items():
            marks = [pytest.mark.gpu] if device == "cuda" else []
            if (device, name) == ("cuda", "tied-sliding-bf16"):
                marks.append(pytest.mark.smoke)
            yield pytest.param(device, *case, id=f"{device}-{name}", marks=marks)


@pytest.mark.parametrize("device,tie,sliding,fmt,tol", list(_parity_params()))
@torch.no_grad()
def test_logits_and_greedy_match_transformers(tmp_path, tie, sliding, fmt, tol, device):
    """On CUDA the layers run the Triton kernels (store, attention, the fused norm and RoPE ops) against
    transformers' eager modules; on CPU the torch references."""
    hf = _hf_model(tmp_path, tie, sliding).to(device)
    ours = Qwen3ForCausalLM.from_pretrained(tmp_path, cache_format=fmt, dtype=torch.float32, device=device)
    assert [a.sliding_window for a in ours.attention_layers] == ([None, 4, 4] if sliding else [None] * 3)
    err = 0.0  # the largest logit error seen: the greedy checks below allow ties closer than that
    for p, got in zip(PROMPTS, _prefill_logits(ours, PROMPTS, device)):
        want = hf(torch.tensor([p], device=device)).logits[0]
        # the cache rounds K/V to bf16/fp16 (errors scale with its mantissa), everything else is fp32
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
        err = max(err, (got - want).abs().max().item())
        top = want.topk(2, -1).values
        decided = top[:, 0] - top[:, 1] > 2 * err
        assert torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided])
    result, checked = generate(ours, PROMPTS, 10), 0
    for p, tokens in zip(PROMPTS, result.tokens):
        want, margins = _hf_greedy(hf, p, 10)
        n = _decided(margins, 2 * err)  # twice the prefill's error: decoding reads the cache more often
        assert tokens[:n] == want[:n]
        checked += n
    assert checked >= 10, f"only {checked} greedy tokens were decided: the check would be vacuous"
