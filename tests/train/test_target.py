"""A tiny target learns a fixed batch; the saved checkpoint loads in transformers and in tqops with equal logits."""
import itertools
import json

import pytest
import torch

from tqops.models import Qwen3ForCausalLM
from tqops.train import corpus
from tqops.train.loop import LoopConfig, train_loop
from tqops.train.target import build_target, causal_lm_loss, target_config
from tqops.train.tokenizer import FILES, load_tokenizer, special_ids

from .conftest import TINY
from .helpers import paged_prefill

transformers = pytest.importorskip("transformers")


def test_loss_decreases_on_a_fixed_batch():
    torch.manual_seed(0)
    tok = load_tokenizer()
    model = build_target(target_config(TINY, tok.get_vocab_size(), special_ids(tok)))
    batch = torch.tensor([tok.encode(f.text).ids[:48] for f in corpus.read_heldout()[::2][:2]])
    result = train_loop(model, lambda b, compiled: causal_lm_loss(model, b), itertools.repeat(batch),
                        lambda: {"loss": causal_lm_loss(model, batch).item()}, "loss",
                        LoopConfig(lr=1e-2, steps=8, evals=4, warmup_steps=1), "cpu")
    train = [loss for _, loss, _ in result.train]
    evals = [e["loss"] for e in result.evals]
    assert len(train) == 8 and train[-1] < train[0] - 1.0
    assert evals == sorted(evals, reverse=True) and evals[-1] < evals[0] - 1.0
    assert result.best_step == 8 and result.best["loss"] == evals[-1]


def test_checkpoint_files_and_log(tiny_target):
    path, summary = tiny_target
    names = {p.name for p in path.iterdir()}
    assert names >= {"config.json", "training_log.json", "loss.png", *FILES}
    weights = list(path.glob("*.safetensors"))
    assert weights and all(w.stat().st_size <= 15_000_000 for w in weights)
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] and config["max_position_embeddings"] >= 2048
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] in (64, 128, 256)
    log = json.loads((path / "training_log.json").read_text())
    assert log["result"]["steps"] == summary["steps"] == 3 and len(log["train"]) == 3
    assert [e["step"] for e in log["evals"]] == [0, 3]
    assert transformers.AutoTokenizer.from_pretrained(path).eos_token_id == config["eos_token_id"] == 0


@torch.no_grad()
def test_transformers_and_tqops_give_the_same_logits(tiny_target):
    path, _ = tiny_target
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = Qwen3ForCausalLM.from_pretrained(path, cache_format="fp16", dtype=torch.float32)
    ids = torch.tensor(load_tokenizer(path).encode(corpus.read_heldout()[0].text).ids[:40])
    want = hf(input_ids=ids[None]).logits[0]
    got = ours.compute_logits(paged_prefill(ours, ids))
    # the fp16 cache rounds K/V; everything else is fp32 on both sides
    torch.testing.assert_close(got, want, rtol=3e-3, atol=3e-3 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
