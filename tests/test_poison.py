"""The NaN-poisoning fixture really poisons library allocations."""
import torch

import tqops


def test_library_allocation_is_poisoned():
    cache = tqops.allocate_kv_cache("bf16", 1, 16, 1, 64)
    assert bool((cache == 0xFF).all())
    assert torch.isnan(cache.view(torch.bfloat16)).all()
