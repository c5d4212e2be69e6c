"""The drafter checkpoint has the z-lab layout and loads in tqops; the dense training forward equals paged inference."""
import json

import pytest
import torch
from safetensors import safe_open

from tqops.models import DFlashDrafter, Qwen3ForCausalLM
from tqops.models.loading import load_weights, read_config, weight_files
from tqops.train import corpus
from tqops.train.dflash import (DenseDFlashDrafter, block_accuracy, block_labels, block_mask, position_weights,
                                sample_anchors, spread_layer_ids)
from tqops.train.drafter import TargetStates
from tqops.train.tokenizer import load_tokenizer, special_ids

from .conftest import BLOCK, LAYER_IDS, TINY
from .helpers import paged_block_logits, paged_prefill

transformers = pytest.importorskip("transformers")

LAYER_PARAMS = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                "post_attention_layernorm.weight"}


def test_block_mask_anchors_labels_and_weights():
    mask = block_mask(torch.tensor([[2, 5]]), 8, 3)[0, 0]
    assert mask.shape == (6, 8 + 6)
    assert mask[:3, :8].sum(-1).tolist() == [2, 2, 2] and mask[3:, :8].sum(-1).tolist() == [5, 5, 5]
    assert mask[:3, 8:].tolist() == [[True] * 3 + [False] * 3] * 3
    assert mask[3:, 8:].tolist() == [[False] * 3 + [True] * 3] * 3
    anchors = sample_anchors(64, 40, 24, 16, generator=torch.Generator().manual_seed(0))
    assert anchors.min() >= 1 and anchors.max() <= 40 - 16
    assert all(len(set(row)) == 24 and row == sorted(row) for row in anchors.tolist())
    ids = torch.arange(100, 140)[None]
    assert block_labels(ids, torch.tensor([[1, 20]]), 4).tolist() == [[[102, 103, 104], [121, 122, 123]]]
    w = position_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1 and torch.allclose(w[7], torch.tensor(1 / torch.e))
    assert position_weights(4, 0).tolist() == [1.0, 1.0, 1.0]
    logits = torch.nn.functional.one_hot(torch.tensor([[[1, 2, 0], [1, 0, 0]]]), 4).float()  # [1, 2, 3, V]
    acc, accept = block_accuracy(logits, torch.tensor([[[1, 2, 3], [1, 2, 0]]]))
    assert acc.tolist() == [1.0, 0.5, 0.5] and accept.item() == 1 + (2 + 1) / 2
    assert spread_layer_ids(6) == [1, 3, 5] and spread_layer_ids(36, 5) == [1, 10, 18, 26, 35]


def test_checkpoint_is_the_z_lab_layout(tiny_target, tiny_drafter):
    path, summary = tiny_drafter
    config = read_config(path)
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == BLOCK
    assert config["dflash_config"] == {"target_layer_ids": list(LAYER_IDS),
                                       "mask_token_id": special_ids(load_tokenizer())["mask"]}
    assert config["num_target_layers"] == TINY.num_hidden_layers and config["num_hidden_layers"] == 2
    names = set()
    for file in weight_files(path):
        with safe_open(file, "pt") as f:
            names |= set(f.keys())
            assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    assert names == {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{p}" for i in range(2) for p in LAYER_PARAMS}
    log = json.loads((path / "training_log.json").read_text())
    assert log["result"]["steps"] == 3 and (path / "loss.png").is_file()
    assert summary["acceptance"]["prompts"] == 1 and summary["acceptance"]["mean_acceptance_length"] >= 1


@torch.no_grad()
def test_target_states_are_the_hidden_states_zlab_reads(tiny_target):
    """The drafter's inputs are transformers' ``hidden_states[i + 1]`` (z-lab's ``extract_context_feature``): each
    layer's output, the last layer's after the final norm, in ``target_layer_ids`` order."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_target[0], dtype=torch.float32).eval()
    ids = torch.tensor([[3, 141, 59, 26, 5, 35, 89, 79, 32, 38]])
    hidden_states = hf(ids, output_hidden_states=True).hidden_states
    want = torch.cat([hidden_states[i + 1] for i in LAYER_IDS], -1)
    assert LAYER_IDS[0] == len(hf.model.layers) - 1
    raw = {}
    handle = hf.model.layers[-1].register_forward_hook(lambda module, args, out: raw.update(last=out))
    hf(ids)
    handle.remove()
    assert not torch.allclose(raw["last"], hidden_states[-1])  # the norm changes it, so the test can tell
    assert torch.equal(TargetStates(hf, LAYER_IDS)(ids), want)


@torch.no_grad()
def test_dense_training_forward_equals_paged_inference(tiny_target, tiny_drafter):
    """Logits of several blocks from one dense pass (as in training) equal tqops' paged draft step for each block."""
    target_path, drafter_path = tiny_target[0], tiny_drafter[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    dense = DenseDFlashDrafter(read_config(drafter_path))
    load_weights(dense, drafter_path)  # strict both ways: the dense module's names are the checkpoint's
    dense.eval()
    ours = Qwen3ForCausalLM.from_pretrained(target_path, cache_format="fp16", dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_path, target=ours, cache_format="fp16")

    ids = torch.tensor(load_tokenizer(target_path).encode(corpus.read_heldout()[2].text).ids[:40])
    assert len(ids) == 40
    anchors = torch.tensor([[1, 7, 18, 32]])  # one context row, a block crossing a cache block, the last fit
    states = TargetStates(hf, LAYER_IDS)(ids[None])
    dense_logits = hf.lm_head(dense(states, ids[None], anchors, hf.get_input_embeddings())[:, :, 1:])[0]

    _, paged_states = paged_prefill(ours, ids, layer_ids=LAYER_IDS)
    # the hooked transformers decoder gives what tqops' target hands the drafter (the last layer after the final norm)
    torch.testing.assert_close(states[0], paged_states, rtol=3e-3, atol=3e-3 * paged_states.abs().max().item())
    for k, a in enumerate(anchors[0].tolist()):
        block = torch.full((BLOCK,), drafter.mask_token_id)
        block[0] = ids[a]
        got = paged_block_logits(drafter, paged_states[:a], block)
        want = dense_logits[k]
        torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3 * want.abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
