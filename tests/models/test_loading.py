"""Checkpoint loading: HF names, single file vs sharded, tied lm_head, per-layer formats, DFlash config."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tqops.models import DFlashDrafter, Qwen3Config, Qwen3ForCausalLM
from tqops.models.loading import weight_files

from .conftest import WINDOW
from .fixtures import qwen3_config, write_drafter, write_target


def _tensors(path):
    out = {}
    for f in weight_files(path):
        out.update(load_file(f))
    return out


def test_single_and_sharded_checkpoints_load_the_same_weights(tmp_path):
    single = write_target(tmp_path / "single", seed=5)
    sharded = write_target(tmp_path / "sharded", seed=5, shards=3)
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json")) and len(weight_files(sharded)) == 3
    a = Qwen3ForCausalLM.from_pretrained(single, dtype=torch.float32)
    b = Qwen3ForCausalLM.from_pretrained(sharded, dtype=torch.float32)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    ref = _tensors(single)
    assert set(ref) == set(sa)  # HF names, nothing extra or missing
    assert all(torch.equal(ref[k], sa[k]) for k in ref)


def test_tied_lm_head_and_dtype(tmp_path):
    path = write_target(tmp_path / "tied", tie=True)
    assert "lm_head.weight" not in _tensors(path)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_config_layer_types_formats_and_groups(tmp_path):
    path = write_target(tmp_path / "t", num_layers=5, layer_types=["full_attention", "sliding_attention"] * 2
                        + ["full_attention"], sliding_window=WINDOW)
    model = Qwen3ForCausalLM.from_pretrained(path, cache_format="turboquant_3bit_nc", dtype=torch.float32,
                                             layer_cache_formats={0: "bf16", 1: "bf16", -1: "bf16", -2: "bf16"})
    attn = model.attention_layers
    assert [a.fmt.name for a in attn] == ["bf16", "bf16", "turboquant_3bit_nc", "bf16", "bf16"]
    assert [a.group for a in attn] == [0, 1, 0, 1, 0]
    assert [a.sliding_window for a in attn] == [None, WINDOW, None, WINDOW, None]
    assert all(a.causal for a in attn)
    with pytest.raises(IndexError):
        Qwen3ForCausalLM(Qwen3Config.from_dict(qwen3_config(num_layers=2)), layer_cache_formats={2: "bf16"})


def test_config_spellings():
    old = qwen3_config(num_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    del old["rope_parameters"], old["layer_types"]
    old["rope_theta"] = 1e6
    cfg = Qwen3Config.from_dict(old)
    assert cfg.rope_theta == 1e6
    assert cfg.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2  # HF's max_window_layers rule
    off = dict(old, use_sliding_window=False)
    assert Qwen3Config.from_dict(off).sliding_window is None
    with pytest.raises(NotImplementedError):
        Qwen3Config.from_dict(dict(old, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_checkpoint_mismatches_are_errors(tmp_path):
    path = write_target(tmp_path / "t")
    tensors = _tensors(path)
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    os.remove(os.path.join(path, "model.safetensors"))
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\].*extra"):
        Qwen3ForCausalLM.from_pretrained(path)
    tensors = _tensors(path)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    tensors.pop("model.layers.0.extra.weight")
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        Qwen3ForCausalLM.from_pretrained(path)


@torch.no_grad()
def test_drafter_layout_and_sharing(target_path, drafter_path, tmp_path):
    target = Qwen3ForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_path, target=target, cache_format="fp8_e5m2")
    assert drafter.embed_tokens is target.model.embed_tokens and drafter.lm_head is target.lm_head
    assert drafter.target_layer_ids == (0, 2) and drafter.block_size == 4 and drafter.mask_token_id == 99
    assert drafter.fc.weight.shape == (64, 128)
    own = {k for k in drafter.state_dict() if not k.startswith(("embed_tokens.", "lm_head."))}
    assert own == set(_tensors(drafter_path))  # fc, hidden_norm, layers.N.*, norm: no prefix
    attn = drafter.attention_layers
    assert [a.causal for a in attn] == [False, True]  # sliding layers causal, the rest bidirectional
    assert [a.sliding_window for a in attn] == [None, WINDOW] and [a.group for a in attn] == [0, 1]
    assert all(a.fmt.name == "fp8_e5m2" for a in attn)

    # dflash_config values win over top-level ones; is_causal overrides the per-layer default; sharded works too
    path = write_drafter(tmp_path / "d", shards=2, block_size=8, layer_types=["sliding_attention"] * 2,
                         sliding_window=4, dflash_extra={"block_size": 16, "output_multiplier": 0.5,
                                                         "final_logit_softcapping": 3.0},
                         is_causal=False, input_embedding_scale=2.0)
    d = DFlashDrafter.from_pretrained(path, target=target)
    assert d.block_size == 16 and [a.causal for a in d.attention_layers] == [False, False]
    assert (d.output_multiplier, d.final_logit_softcapping, d.input_embedding_scale) == (0.5, 3.0, 2.0)
    hidden = torch.randn(3, 64)
    expected = torch.tanh(target.compute_logits(hidden) * 0.5 / 3.0) * 3.0
    torch.testing.assert_close(d.compute_logits(hidden), expected)

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["dflash_config"]["target_layer_ids"] = [0, 7]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="out of range"):
        DFlashDrafter.from_pretrained(path, target=target)


@pytest.mark.parametrize("target", [None, "Qwen3-8B/"], ids=["none", "a-path"])
def test_drafter_needs_its_target_model(tmp_path, target):
    path = write_drafter(tmp_path / "d")
    with pytest.raises(TypeError, match="target must be the target model"):
        DFlashDrafter.from_pretrained(path, target=target)
