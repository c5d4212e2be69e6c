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
