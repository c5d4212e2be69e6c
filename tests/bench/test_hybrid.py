"""The hybrid benchmark's shape is transformers' Qwen3_5TextConfig() and its state bytes are what design.md states."""
import pytest
import torch

from types import SimpleNamespace

from tqops.bench.hybrid import QWEN3_5_9B, state_bytes
from tqops.graphs import GatedDeltaNetState
from tqops.models import Qwen3_5Config

transformers = pytest.importorskip("transformers")


def test_shape_is_transformers_default_config():
    default = transformers.Qwen3_5TextConfig().to_dict()
    ours = Qwen3_5Config.from_dict(QWEN3_5_9B)
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "vocab_size"):
        assert getattr(ours, name) == default[name], name
    assert list(ours.layer_types) == default["layer_types"]
    assert ours.rotary_dim == default["head_dim"] * default["rope_parameters"]["partial_rotary_factor"]


def test_state_bytes_per_row_match_the_design():
    cfg = Qwen3_5Config.from_dict(QWEN3_5_9B)
    layers = [GatedDeltaNetState(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                 cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, name=f"layer{i}")
              for i, kind in enumerate(cfg.layer_types) if kind == "linear_attention"]
    for layer in layers:  # the meta device: sizes only
        layer.allocate_state(8, 16, device="meta", dtype=torch.bfloat16)
    per_layer = 128 * 128 * 32 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2  # recurrent fp32 + conv bf16
    assert len(layers) == 24
    assert state_bytes(SimpleNamespace(state_layers=layers), 8) == 8 * 24 * per_layer
    stash = layers[0].stash
    assert stash[0].numel() * stash.element_size() == 16 * (8192 + 64) * 2  # 258 KiB a row and layer


def test_captured_steps_run_every_step_of_a_tiny_pair(monkeypatch):
    """The benchmark's setup on CPU (nothing captured, steps eager): each step runs on the buffers fill_steps wrote,
    and the verify step leaves the committed states as they were (it stashes)."""
    from tqops.bench import hybrid

    monkeypatch.setattr(hybrid, "_compiled", lambda step: step)
    target_cfg = dict(hybrid.QWEN3_5_9B, vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    drafter_cfg = dict(hybrid.DRAFTER_9B, vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, block_size=4,
                       dflash_config={"target_layer_ids": [1, 2], "mask_token_id": 63})
    target, drafter, runners, table = hybrid.captured_steps("bf16", target_cfg, drafter_cfg, 20, (1, 2),
                                                            device="cpu")
    assert set(runners) == {"decode", "verify", "draft"} and not any(r.graphs for r in runners.values())
    hybrid.fill_steps(runners, table, 2, 20, drafter)
    state = target.state_layers[0]
    before = state.recurrent_state.clone()
    with torch.no_grad():
        hidden, _ = runners["verify"]._run(2)
        assert hidden.shape == (2 * 4, 64) and torch.isfinite(hidden).all()
        assert torch.equal(state.recurrent_state[:2], before[:2])
        hidden, _ = runners["decode"]._run(2)
        assert hidden.shape == (2, 64) and torch.isfinite(hidden).all()
        logits = runners["draft"]._run(2)
        assert logits.shape == (2, 3, 64) and torch.isfinite(logits).all()
