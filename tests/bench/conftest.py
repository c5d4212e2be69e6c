"""A DFlash2 drafter of the shipped target that drafts as the shipped v1 drafter: v1's weights, identity
convolutions and a zero successor codebook (what DFlash2 training starts from), for the benchmarks' comparisons."""
from pathlib import Path

import pytest
import torch

from tqops import shipped
from tqops.models.loading import load_weights, read_config
from tqops.train.dflash2 import SHIPPED_SETTINGS, DenseDFlash2Drafter, dflash2_config
from tqops.train.drafter import save_drafter


def dflash2_from_v1(v1_dir: Path, target_dir: Path, out: Path) -> Path:
    """Save at ``out`` the DFlash2 drafter (``SHIPPED_SETTINGS``, v1's MLP width) whose shared weights are v1's and
    whose modules are the training's initialization: its greedy drafts are v1's."""
    v1 = read_config(v1_dir)
    config = dflash2_config(read_config(target_dir), SHIPPED_SETTINGS, num_layers=v1["num_hidden_layers"],
                            target_layer_ids=v1["dflash_config"]["target_layer_ids"],
                            mask_token_id=v1["dflash_config"]["mask_token_id"], block_size=v1["block_size"])
    drafter = DenseDFlash2Drafter(config)
    drafter.init_weights(torch.Generator().manual_seed(0))
    modules = [n for n in drafter.state_dict() if "_conv." in n or n.startswith("candidate_selector.")]
    load_weights(drafter, v1_dir, optional=modules)
    save_drafter(drafter, out)
    return out


@pytest.fixture(scope="session")
def shipped_pair() -> tuple[Path, Path]:
    pair = shipped.trained_pair()
    if pair is None:
        pytest.skip("the shipped pair is not in tqops/pretrained/stdlib-py")
    return pair


@pytest.fixture(scope="session")
def v1_as_dflash2(shipped_pair, tmp_path_factory) -> Path:
    target, v1 = shipped_pair
    return dflash2_from_v1(v1, target, tmp_path_factory.mktemp("dflash2-from-v1"))
