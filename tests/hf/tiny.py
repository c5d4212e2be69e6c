"""Tiny random transformers models of every supported architecture, and a reference attention for them."""
from __future__ import annotations

import functools
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tqops  # noqa: E402
import tqops.hf  # noqa: E402,F401  (registers attn_implementation="tqops")
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, eager_mask  # noqa: E402

VOCAB = 128
WINDOW = 6
# hidden 128, 4 query heads over 2 kv heads (GQA), head_dim 64.
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, pad_token_id=0)
ALTERNATING = ["sliding_attention", "full_attention"]
# A large init spreads the logits, so greedy choices are not decided by rounding; quantization tests use the usual
# small one, where a random model's activations are tame.
GREEDY_INIT = 0.5


def _configs():
    t = transformers
    return {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM, {}),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {}),  # q/k/v biases
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, {}),  # q/k norms
        "mistral": (t.MistralConfig, t.MistralForCausalLM, {"sliding_window": WINDOW}),
        # query_pre_attn_scalar 128 makes its softmax scale 128 ** -0.5, not head_dim ** -0.5; with tied embeddings
        # (scaled by sqrt(hidden)) the random model repeats one token
        "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM,
                   {"sliding_window": WINDOW, "layer_types": ALTERNATING, "query_pre_attn_scalar": 128,
                    "tie_word_embeddings": False}),
        # per-head sinks (s_aux), alternating windows, transformers' own MoE; positions sized for its YaRN RoPE
        "gpt_oss": (t.GptOssConfig, t.GptOssForCausalLM,
                    {"sliding_window": WINDOW, "layer_types": ALTERNATING, "num_local_experts": 4,
                     "num_experts_per_tok": 2, "max_position_embeddings": 131072}),
    }


ARCHITECTURES = tuple(_configs())


@functools.lru_cache(maxsize=None)
def tiny_model(arch: str, initializer_range: float = GREEDY_INIT):
    """A 2-layer random fp32 model of ``arch`` in eval mode, built once per session; tests switch its attention with
    ``model.set_attn_implementation``."""
    config_cls, model_cls, extra = _configs()[arch]
    torch.manual_seed(0)
    return model_cls(config_cls(**COMMON, **extra, initializer_range=initializer_range)).eval()


def _round_trip(x: torch.Tensor, other: torch.Tensor, fmt: str):
    """Keys and values ``[batch, kv_heads, n, head_dim]`` as a ``fmt`` cache stores them (kv_store then kv_load)."""
    batch, heads, n, head_dim = x.shape
    flat = [t.transpose(1, 2).reshape(batch * n, heads, head_dim) for t in (x, other)]
    cache = tqops.allocate_kv_cache(fmt, -(-batch * n // 16), 16, heads, head_dim, device=x.device)
    slots = torch.arange(batch * n, device=x.device)
    tqops.kv_store(*flat, cache, slots, fmt)
    return [t.view(batch, n, heads, head_dim).transpose(1, 2).to(x.dtype)
            for t in tqops.kv_load(cache, slots, fmt, head_dim)]


@functools.lru_cache(maxsize=None)
def reference_attention(fmt: str) -> str:
    """Registers, and returns the name of, the model's own eager attention over K/V stored and read back in ``fmt``:
    comparing to it isolates paging, padding, windows, sinks and scaling from the format's rounding."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, *_round_trip(key, value, fmt), attention_mask, **kwargs)

    name = f"eager_kv_{fmt}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)
    return name


def left_padded(lengths, seed: int = 1):
    """Random ids ``[len(lengths), max(lengths)]`` left-padded with 0, and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def prefill(model, cache, ids, mask):
    """A forward of ``ids`` with the positions ``generate`` derives from ``mask`` (real tokens count from 0)."""
    positions = None if mask is None or mask.dim() != 2 else (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
    with torch.no_grad():
        return model(ids, attention_mask=mask, past_key_values=cache, position_ids=positions).logits


def decode(model, cache, tokens, positions):
    """One step of ``tokens`` ``[batch, q_len]`` at ``positions``; returns its logits."""
    with torch.no_grad():
        return model(tokens, past_key_values=cache, position_ids=positions).logits


def first_step(model, cache, ids, mask, call: str):
    """The prompt's forward on ``cache`` (``call`` "forward"), or ``generate`` from it (``call`` "generate")."""
    if call == "forward":
        return prefill(model, cache, ids, mask)
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False,
                          pad_token_id=0)
