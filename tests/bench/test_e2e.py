"""The e2e benchmark's step machinery on a tiny model on CPU (the benchmark itself needs CUDA)."""
import torch

import tqops
from tqops.bench import e2e

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, rope_parameters={"rope_theta": 1e4, "rope_type": "default"})
TINY_DRAFT = dict(TINY, num_hidden_layers=1, block_size=4, dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 299})


@torch.no_grad()
def test_spec_loop_runs_at_fixed_acceptance_on_cpu():
    target, drafter = e2e.build_models("turboquant_k3v4_nc", TINY, TINY_DRAFT, device="cpu", dtype=torch.float32)
    table = e2e.fill_caches((target, drafter), 2, 40, per_seq=8)
    sb = e2e.SpecBench(target, drafter, table, context=40, batches=(1, 2), compile=False)
    sb.fill(2)
    assert sb.decode._run(2)[0].shape == (2, 300)
    assert sb.draft._run(2).shape == (2, 3, 300)
    assert sb.spec_loop(2, k=3, steps=2) > 0


def test_targets_and_capacity_columns():
    rows = [dict(format=f, batch=b, decode_eager_ms=3.0, decode_captured_ms=1.0, spec_step_ms=s)
            for f, s in (("bf16", 2.0), ("turboquant_4bit_nc", 2.1)) for b in (1, 8)]
    rows = e2e._targets(rows)
    assert rows[0]["captured >= 3x eager"] is True and rows[0]["spec <= 2x decode"] is True
    assert rows[2]["tq target met"] is True and rows[3]["tq target met"] is False
    assert rows[2]["kv_bytes/token"] == 134 * 8 * 28 and "tokens in 16 GiB" in rows[0]


def test_byte_floor_counts_weights_once_and_kv_per_slot():
    for tie in (True, False):
        target, _ = e2e.build_models("bf16", dict(TINY, tie_word_embeddings=tie), TINY_DRAFT, device="cpu",
                                     dtype=torch.bfloat16)
        params = sum(p.numel() for p in set(target.parameters()))
        embedding = TINY["vocab_size"] * TINY["hidden_size"]
        # a tied embedding is read as the LM head; an untied one only at the step's tokens
        assert e2e.decode_weight_bytes(target) == 2 * (params - (0 if tie else embedding))
    slot = tqops.get_format("turboquant_4bit_nc").slot_bytes(64)
    assert e2e.decode_kv_bytes(TINY, "turboquant_4bit_nc", batch=3, context=40) == 3 * 40 * slot * 1 * 3
