"""The default target and drafter, saved as the stages save them, fit 30 MB with the tokenizer."""
import pytest

from tqops.train.dflash import DenseDFlashDrafter, drafter_config, spread_layer_ids
from tqops.train.drafter import save_drafter
from tqops.train.target import TargetShape, build_target, save_target, target_config
from tqops.train.tokenizer import SHIPPED_DIR, VOCAB_SIZE, load_tokenizer, special_ids

pytest.importorskip("transformers")

BUDGET = 30_000_000  # bytes, weights of both models plus the tokenizer files


def test_default_models_fit_the_budget(tmp_path):
    tok = load_tokenizer()
    shape = TargetShape()
    assert shape.head_dim in (64, 128, 256) and shape.max_position_embeddings >= 2048
    target = build_target(target_config(shape, VOCAB_SIZE, special_ids(tok)))
    target_params = sum(p.numel() for p in target.parameters())  # tied: the embedding counts once
    files = save_target(target, tmp_path / "target", SHIPPED_DIR)
    config = target.config.to_dict()
    drafter = DenseDFlashDrafter(drafter_config(config, num_layers=2, target_layer_ids=spread_layer_ids(6),
                                                mask_token_id=special_ids(tok)["mask"]))
    drafter_params = sum(p.numel() for p in drafter.parameters())
    files += save_drafter(drafter, tmp_path / "drafter")
    weights = [f for f in files if f.suffix == ".safetensors"]
    assert all(f.stat().st_size <= 15_000_000 for f in weights) and len(weights) >= 3  # the target is sharded
    weight_bytes = sum(f.stat().st_size for f in weights)
    total = sum(f.stat().st_size for f in files)
    assert (target_params, drafter_params) == (11_015_808, 3_590_656)
    assert 2 * (target_params + drafter_params) <= weight_bytes < 2 * (target_params + drafter_params) + 100_000
    assert total <= BUDGET, f"{total:,} bytes"
