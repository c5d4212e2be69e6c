"""RoPE frequencies stay fp32 and exact through dtype casts and meta-device builds, and stay out of checkpoints."""
import torch

from tqops.models.loading import build_empty
from tqops.models.qwen3 import RotaryFrequencies, rope_inv_freq


def test_inv_freq_is_fp32_after_a_cast_and_after_to_empty():
    want = rope_inv_freq(128, 1e6)
    rotary = RotaryFrequencies(128, 1e6).to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, want)
    built = build_empty(lambda: RotaryFrequencies(128, 1e6), torch.float16, "cpu")  # meta, then uninitialized
    assert built.inv_freq.dtype == torch.float32 and torch.equal(built.inv_freq, want)


def test_inv_freq_is_not_in_the_state_dict():
    assert RotaryFrequencies(64, 1e4).state_dict() == {}
