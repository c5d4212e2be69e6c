"""Checkpoints shared by the model tests: written once per session by tests/models/fixtures.py."""
import pytest

from .fixtures import write_drafter, write_target

TARGET_LAYERS = ["full_attention", "sliding_attention", "full_attention"]
DRAFTER_LAYERS = ["full_attention", "sliding_attention"]
WINDOW = 8


@pytest.fixture(scope="session")
def target_path(tmp_path_factory):
    """3 layers (the middle one sliding, window 8), untied lm_head, vocab 100."""
    return write_target(tmp_path_factory.mktemp("target"), layer_types=TARGET_LAYERS, sliding_window=WINDOW)


@pytest.fixture(scope="session")
def drafter_path(tmp_path_factory):
    """2 layers (the second sliding, hence causal), block_size 4, target_layer_ids (0, 2)."""
    return write_drafter(tmp_path_factory.mktemp("drafter"), layer_types=DRAFTER_LAYERS, sliding_window=WINDOW)


@pytest.fixture(scope="session")
def drafter16_path(tmp_path_factory):
    return write_drafter(tmp_path_factory.mktemp("drafter16"), block_size=16, seed=3)
