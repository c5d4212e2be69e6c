"""The shipped DFlash2 drafter (tqops/pretrained/stdlib-py/dflash2-drafter): it loads strictly as a DFlash2Drafter,
fits the v1 drafter's bytes, decodes the shipped target losslessly and accepts more than v1 on the same prompts."""
import os

import pytest
import torch

from tqops.models import DFlashDrafter, Qwen3ForCausalLM
from tqops.models.dflash2 import DFlash2Drafter
from tqops.shipped import TRAINED_DIR, has_weights
from tqops.train.accept import measure_acceptance

DFLASH2_DIR, V1_DIR, TARGET_DIR = (TRAINED_DIR / d for d in ("dflash2-drafter", "drafter", "target"))

pytestmark = pytest.mark.skipif(not all(map(has_weights, (DFLASH2_DIR, V1_DIR, TARGET_DIR))),
                                reason="the shipped pair and DFlash2 drafter are not in tqops/pretrained/stdlib-py")


def test_loads_strictly_as_dflash2_within_v1s_bytes():
    target = Qwen3ForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(DFLASH2_DIR, target=target)
    assert isinstance(drafter, DFlash2Drafter) and drafter.block_size == 16
    assert drafter.target_layer_ids == (1, 3, 5)
    size = lambda d: os.path.getsize(d / "model.safetensors")  # noqa: E731
    assert size(DFLASH2_DIR) <= size(V1_DIR)


def test_decodes_losslessly_and_accepts_more_than_v1():
    """CPU float32 steps on the cache format the demo uses; the same held-out prompts for both drafters."""
    runs = {d.name: measure_acceptance(TARGET_DIR, d, prompts=4, prompt_tokens=128, new_tokens=48,
                                       cache_format="turboquant_4bit_nc") for d in (V1_DIR, DFLASH2_DIR)}
    assert all(r["same_as_greedy"] == 4 for r in runs.values()), runs
    assert runs["dflash2-drafter"]["mean_acceptance_length"] > runs["drafter"]["mean_acceptance_length"], runs
