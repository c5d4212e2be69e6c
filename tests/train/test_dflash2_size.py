"""The DFlash2 drafter sized for the shipped pair: v1's layers and hidden size, its MLP narrower, no more bytes than
the shipped v1 drafter; and DrafterOptions.intermediate_size, which sets that width."""
import json

import pytest
import torch

from tqops import shipped
from tqops.models import DFlash2Drafter, DFlashDrafter, Qwen3ForCausalLM
from tqops.models.loading import read_config
from tqops.train.dflash2 import SHIPPED_INTERMEDIATE_SIZE, SHIPPED_SETTINGS
from tqops.train.drafter import DrafterOptions, build_drafter, save_drafter


@pytest.fixture(scope="module")
def pair():
    pair = shipped.trained_pair()
    if pair is None:
        pytest.skip("the shipped pair is not in tqops/pretrained/stdlib-py")
    return pair


def shipped_size_drafter(target, v1):
    v1_config = read_config(v1)
    opts = DrafterOptions(target=target, out=None, num_layers=v1_config["num_hidden_layers"], arch="dflash2",
                          dflash2=SHIPPED_SETTINGS, intermediate_size=SHIPPED_INTERMEDIATE_SIZE,
                          block_size=v1_config["block_size"])
    return build_drafter(opts, read_config(target), v1_config["dflash_config"]["target_layer_ids"],
                         v1_config["dflash_config"]["mask_token_id"])


def test_shipped_size_dflash2_is_no_larger_than_v1_and_loads(pair, tmp_path):
    target, v1 = pair
    drafter = shipped_size_drafter(target, v1)
    drafter.init_weights(torch.Generator().manual_seed(0))
    files = save_drafter(drafter, tmp_path)
    weights = [f for f in files if f.suffix == ".safetensors"]
    assert [f.name for f in weights] == ["model.safetensors"]
    assert weights[0].stat().st_size <= (v1 / "model.safetensors").stat().st_size
    config, v1_config = (json.loads((d / "config.json").read_text()) for d in (tmp_path, v1))
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "block_size"):
        assert config[key] == v1_config[key], key
    assert config["dflash_config"]["target_layer_ids"] == v1_config["dflash_config"]["target_layer_ids"]
    assert config["intermediate_size"] == SHIPPED_INTERMEDIATE_SIZE < v1_config["intermediate_size"]
    model = Qwen3ForCausalLM.from_pretrained(target, dtype=torch.float32)
    loaded = DFlashDrafter.from_pretrained(tmp_path, target=model)  # strict
    assert type(loaded) is DFlash2Drafter
    assert loaded.layers[0].mlp.down_proj.weight.shape[1] == SHIPPED_INTERMEDIATE_SIZE


def test_intermediate_size_defaults_to_the_targets(pair):
    target, v1 = pair
    raw = read_config(target)
    for arch in ("dflash", "dflash2"):
        opts = DrafterOptions(target=target, out=None, arch=arch)
        assert build_drafter(opts, raw, (1, 3, 5), 2).raw_config["intermediate_size"] == raw["intermediate_size"]
        opts = DrafterOptions(target=target, out=None, arch=arch, intermediate_size=640)
        drafter = build_drafter(opts, raw, (1, 3, 5), 2)
        assert drafter.raw_config["intermediate_size"] == 640
        assert drafter.layers[1].mlp.down_proj.weight.shape == (raw["hidden_size"], 640)
    assert raw["intermediate_size"] == read_config(target)["intermediate_size"]  # the target's config is not changed
