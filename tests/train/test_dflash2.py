"""``--arch dflash2``: the checkpoint loads strictly as tqops' DFlash2Drafter and decodes losslessly; the dense
training forward and the selector's scores equal inference; the selector's loss and its candidate sets."""
import contextlib
import io
import json

import pytest
import torch
from safetensors import safe_open

from tqops.models import DFlash2Drafter, DFlashDrafter, Qwen3ForCausalLM, SelectedDrafts, generate
from tqops.models.loading import load_weights, read_config, weight_files
from tqops.train import corpus
from tqops.train.__main__ import build_parser, main
from tqops.train.accept import heldout_prompts
from tqops.train.dflash import DenseDFlashDrafter, block_labels, drafter_config, position_weights
from tqops.train.dflash2 import (DenseDFlash2Drafter, DFlash2Settings, block_predecessors, candidate_sets,
                                 dflash2_config, pair_scores, selector_drafts, selector_loss)
from tqops.train.drafter import TargetStates, save_drafter
from tqops.train.loop import LoopConfig, adamw
from tqops.train.tokenizer import load_tokenizer, special_ids

from ..models.fixtures import randomize_dflash2
from .conftest import BLOCK, LAYER_IDS, SEQ_LEN
from .helpers import paged_block_hidden, paged_prefill

transformers = pytest.importorskip("transformers")

SETTINGS = DFlash2Settings(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)


INTERMEDIATE = 40  # the drafter's own MLP width, not the target's


@pytest.fixture(scope="module")
def cli_dflash2(tiny_target, tmp_path_factory):
    """(folder, summary) of ``python -m tqops.train drafter --arch dflash2`` on the tiny target: three CPU steps on
    its greedy continuations, then the acceptance run."""
    out = tmp_path_factory.mktemp("dflash2")
    argv = (f"drafter --arch dflash2 --target {tiny_target[0]} --out {out} --layers 2 --target-layer-ids 2,0 "
            f"--block-size {BLOCK} --blocks-per-sequence 4 --steps 3 --evals 1 --warmup 1 --lr 3e-3 "
            f"--seq-len {SEQ_LEN} --batch-size 2 --train-files 4 --eval-files 1 --greedy-sequences 4 "
            f"--greedy-batch-size 2 --greedy-new-tokens 24 --greedy-eval-sequences 2 --accept-prompts 2 "
            f"--accept-new-tokens 12 --device cpu --conv-kernel-size {SETTINGS.conv_kernel_size} "
            f"--selector-rank {SETTINGS.selector_rank} --selector-top-k {SETTINGS.selector_top_k} "
            f"--intermediate-size {INTERMEDIATE}")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv.split()) == 0
    return out, json.loads(stdout.getvalue())


def test_arch_flag_parses_and_defaults_to_dflash():
    parse = build_parser().parse_args
    assert parse("drafter --target t --out o".split()).arch == "dflash"
    args = parse("drafter --target t --out o --arch dflash2 --selector-top-k 4".split())
    assert (args.arch, args.selector_top_k, args.selector_rank) == ("dflash2", 4, None)  # None: the default


def test_cli_saves_a_dflash2_checkpoint_that_loads_strictly(tiny_target, cli_dflash2):
    path, summary = cli_dflash2
    config = read_config(path)
    assert config["architectures"] == ["DFlash2DraftModel"] and config["block_size"] == BLOCK
    assert config["intermediate_size"] == INTERMEDIATE
    # the flags given, and DFlash2Settings' default for the one left out
    assert config["dflash_config"] == {"target_layer_ids": list(LAYER_IDS),
                                       "mask_token_id": special_ids(load_tokenizer())["mask"],
                                       "conv_kernel_size": SETTINGS.conv_kernel_size,
                                       "conv_group_size": DFlash2Settings.conv_group_size,
                                       "selector_rank": SETTINGS.selector_rank, "selector_top_k": SETTINGS.selector_top_k}
    names = set()
    for file in weight_files(path):
        with safe_open(file, "pt") as f:
            names |= set(f.keys())
    dense = DenseDFlash2Drafter(config)
    assert names == set(dense.state_dict())
    assert {"candidate_selector.predecessor_codebook", "layers.1.mlp_conv.base_kernel"} <= names
    load_weights(dense, path)  # strict: no missing or unexpected tensor
    target = Qwen3ForCausalLM.from_pretrained(tiny_target[0], dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(path, target=target)  # strict as well
    assert type(drafter) is DFlash2Drafter
    assert (drafter.candidate_selector.top_k, drafter.candidate_selector.rank) == (SETTINGS.selector_top_k,
                                                                                   SETTINGS.selector_rank)
    log = json.loads((path / "training_log.json").read_text())
    assert log["title"].startswith("DFlash2 drafter") and log["options"]["arch"] == "dflash2"
    last = log["evals"][-1]
    assert last["valid_loss"] == pytest.approx(last["valid_block_loss"] + last["valid_selector_loss"], abs=1e-4)
    assert summary["acceptance"]["prompts"] == 2 and summary["acceptance"]["same_as_greedy"] == 2
    assert 1.0 <= summary["best_heldout_accept_len"] <= BLOCK


@torch.no_grad()
def test_trained_dflash2_proposes_and_decodes_losslessly(tiny_target, cli_dflash2):
    target = Qwen3ForCausalLM.from_pretrained(tiny_target[0], dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(cli_dflash2[0], target=target)
    prompts = heldout_prompts(load_tokenizer(tiny_target[0]), 2, 20, 16) + [[5, 61]]
    plain = generate(target, prompts, 16)
    spec = generate(target, prompts, 16, drafter=drafter)
    assert spec.tokens == plain.tokens
    hidden = torch.randn(2 * BLOCK, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    drafts = drafter.propose(hidden, torch.full((2 * BLOCK,), 7))
    assert isinstance(drafts, SelectedDrafts) and drafts.tokens.shape == (2, BLOCK - 1)
    assert drafts.candidates.shape == (2, BLOCK - 1, 6) and drafts.q is None


@pytest.fixture(scope="module")
def random_pair(tiny_target, tmp_path_factory):
    """(transformers target, dense DFlash2 drafter, tqops target, tqops DFlash2Drafter) with the same random drafter
    weights: saved by the stage's save_drafter (bf16) and loaded strictly by both sides."""
    target_path = tiny_target[0]
    raw = dflash2_config(read_config(target_path), SETTINGS, num_layers=2, target_layer_ids=LAYER_IDS,
                         mask_token_id=special_ids(load_tokenizer())["mask"], block_size=BLOCK)
    model = DenseDFlash2Drafter(raw)
    randomize_dflash2(model, 3)
    path = tmp_path_factory.mktemp("random_dflash2")
    save_drafter(model, path)
    dense = DenseDFlash2Drafter(read_config(path))
    load_weights(dense, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    ours = Qwen3ForCausalLM.from_pretrained(target_path, cache_format="fp16", dtype=torch.float32)
    return hf, dense.eval(), ours, DFlashDrafter.from_pretrained(path, target=ours, cache_format="fp16")


@torch.no_grad()
def test_dense_forward_and_selector_scores_equal_inference(tiny_target, random_pair):
    """Hidden states, logits and pair scores of several blocks from one dense pass (as in training) equal tqops'
    paged draft step and its selector walk for each block, on random DFlash2 weights."""
    hf, dense, ours, drafter = random_pair
    assert type(drafter) is DFlash2Drafter
    ids = torch.tensor(load_tokenizer(tiny_target[0]).encode(corpus.read_heldout()[2].text).ids[:40])
    anchors = torch.tensor([[1, 7, 18, 32]])
    states = TargetStates(hf, LAYER_IDS)(ids[None])
    dense_hidden = dense(states, ids[None], anchors, hf.get_input_embeddings())[0, :, 1:]  # [K, bs - 1, H]
    dense_logits = hf.lm_head(dense_hidden)
    predecessors = block_predecessors(ids[None], anchors, BLOCK)[0]
    assert predecessors[:, 0].tolist() == ids[anchors[0]].tolist()

    _, paged_states = paged_prefill(ours, ids, layer_ids=LAYER_IDS)
    selector = drafter.candidate_selector
    uniforms = torch.rand(BLOCK, generator=torch.Generator().manual_seed(1))
    for k, a in enumerate(anchors[0].tolist()):
        block = torch.full((BLOCK,), drafter.mask_token_id)
        block[0] = ids[a]
        hidden = paged_block_hidden(drafter, paged_states[:a], block)
        logits = drafter.compute_logits(hidden[1:])
        want_h, want_l = dense_hidden[k], dense_logits[k]
        torch.testing.assert_close(hidden[1:], want_h, rtol=5e-3, atol=5e-3 * want_h.abs().max().item())
        torch.testing.assert_close(logits, want_l, rtol=5e-3, atol=5e-3 * want_l.abs().max().item())
        assert torch.equal(logits.argmax(-1), want_l.argmax(-1))
        # the sampled walk's q over its candidates is softmax(pair_scores) after the walk's own path
        walk = drafter.propose(hidden, block, 1.0, uniforms)
        path = torch.cat([block[:1], walk.tokens[0, :-1]])
        scores = pair_scores(selector, hidden[1:], logits, walk.candidates[0], path)
        torch.testing.assert_close(scores.softmax(-1), walk.q[0])
        dense_scores = pair_scores(dense.candidate_selector, want_h, want_l, walk.candidates[0], path)
        torch.testing.assert_close(dense_scores, scores, rtol=5e-3, atol=5e-3 * scores.abs().max().item())
        # greedy: the teacher-forced picks after the greedy walk's own path are that walk
        greedy = drafter.propose(hidden, block).tokens[0]
        path = torch.cat([block[:1], greedy[:-1]])
        assert torch.equal(selector_drafts(selector, hidden[1:], logits, path), greedy)
        assert torch.equal(selector_drafts(dense.candidate_selector, want_h, want_l, path), greedy)
    # the pair term matters on these weights: the walk is not just each position's argmax
    assert any(not torch.equal(selector_drafts(selector, dense_hidden[k], dense_logits[k], predecessors[k]),
                               dense_logits[k].argmax(-1)) for k in range(len(anchors[0])))


def test_candidate_sets_add_the_gold_token_only_when_it_is_missing():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0, 2.0],    # top 3: 1, 3, 4
                           [9.0, 0.0, 8.0, 1.0, 7.0, 2.0]])   # top 3: 0, 2, 4
    labels = torch.tensor([3, 5])  # the first among its top 3 (second place), the second not
    candidates, gold, valid = candidate_sets(logits, labels, 3)
    assert candidates.tolist() == [[1, 3, 4, 3], [0, 2, 4, 5]]
    assert gold.tolist() == [1, 3]
    assert valid.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert torch.equal(candidates.gather(-1, gold[:, None])[:, 0], labels)


def test_selector_loss_trains_the_gold_candidate_in_even_when_it_was_missing():
    """A gold token outside the top K still gets a finite loss whose gradient raises its logit and moves its successor
    codebook row; a present gold token's duplicate column takes no probability."""
    torch.manual_seed(0)
    model = DenseDFlash2Drafter(_tiny_config(vocab=16))
    model.init_weights(torch.Generator().manual_seed(0))
    selector = model.candidate_selector
    hidden = torch.randn(1, 1, 2, 64)
    logits = torch.randn(1, 1, 2, 16).requires_grad_()
    order = logits.detach().argsort(-1, descending=True)[0, 0]
    labels = torch.stack([order[0, 0], order[1, -1]]).view(1, 1, 2)  # the best token, then the worst: missing
    predecessors = torch.tensor([[[3, 4]]])
    with torch.no_grad():
        selector.successor_codebook.normal_()  # not the zero init, so the codebooks' gradients are not all zero
    loss = selector_loss(selector, hidden, logits, labels, predecessors, torch.ones(2))
    assert torch.isfinite(loss)
    loss.backward()
    missing = int(labels[0, 0, 1])
    assert logits.grad[0, 0, 1, missing] < 0  # gradient descent raises the missing gold token's logit
    assert selector.successor_codebook.grad[missing].abs().sum() > 0
    assert selector.predecessor_codebook.grad[[3, 4]].abs().sum() > 0
    # the present gold token: the loss equals the cross entropy over exactly the top K
    candidates, gold, _ = candidate_sets(logits[..., :1, :], labels[..., :1], selector.top_k)
    scores = pair_scores(selector, hidden[..., :1, :], logits[..., :1, :], candidates[..., :-1], predecessors[..., :1])
    want = torch.nn.functional.cross_entropy(scores.flatten(0, -2), gold.flatten())
    got = selector_loss(selector, hidden[..., :1, :], logits[..., :1, :], labels[..., :1], predecessors[..., :1],
                        torch.ones(1))
    torch.testing.assert_close(got, want)


def _tiny_config(vocab: int = 32, block_size: int = 4) -> dict:
    target = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, hidden_act="silu", rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=256,
                  attention_bias=False, initializer_range=0.02, num_hidden_layers=3)
    return dflash2_config(target, DFlash2Settings(3, 16, 8, 4), num_layers=1, target_layer_ids=[0, 2],
                          mask_token_id=vocab - 1, block_size=block_size)


def _gold_at_ranks(logits: torch.Tensor, labels: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[..., V]`` with each gold token's logit set strictly between the other tokens' ``rank``-th and
    ``rank + 1``-th largest, so that it ranks ``ranks`` ``[...]`` (0: first)."""
    others = logits.scatter(-1, labels[..., None], float("-inf")).sort(-1, descending=True).values
    above = others.gather(-1, (ranks - 1).clamp(min=0)[..., None])[..., 0]
    below = others.gather(-1, ranks[..., None])[..., 0]
    value = torch.where(ranks == 0, below + 0.5, (above + below) / 2)
    return logits.scatter(-1, labels[..., None], value[..., None])


def test_selector_loss_decreases_on_a_tiny_overfit():
    """The selector alone (drafter and logits frozen) learns a fixed batch whose gold tokens rank 1st to 6th among
    the logits (4 candidates): its loss falls well below the start, and its teacher-forced picks, the argmax at the
    zero-pair init, become the gold tokens wherever those are candidates."""
    gen = torch.Generator().manual_seed(0)
    model = DenseDFlash2Drafter(_tiny_config())
    model.init_weights(gen)
    embed, head = torch.nn.Embedding(32, 64), torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(32, 64, generator=gen))
        head.weight.copy_(torch.randn(32, 64, generator=gen) / 8)
    ids, states = torch.randint(0, 31, (2, 24), generator=gen), torch.randn(2, 24, 128, generator=gen)
    anchors = torch.tensor([[1, 6, 11, 17], [3, 8, 13, 20]])
    labels, weights = block_labels(ids, anchors, 4), position_weights(4, 7.0)
    ranks = torch.arange(labels.numel()).view(labels.shape) % 6
    with torch.no_grad():
        hidden = model(states, ids, anchors, embed)[:, :, 1:]
        logits = _gold_at_ranks(head(hidden), labels, ranks)
    predecessors = block_predecessors(ids, anchors, 4)
    selector = model.candidate_selector
    reachable = ranks < selector.top_k
    assert torch.equal(logits.topk(selector.top_k, -1).indices[reachable].eq(labels[reachable, None]).int().argmax(-1),
                       ranks[reachable])
    with torch.no_grad():
        before = selector_drafts(selector, hidden, logits, predecessors)
    assert torch.equal(before, logits.argmax(-1))
    opt = torch.optim.Adam(selector.parameters(), lr=3e-2)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = selector_loss(selector, hidden, logits, labels, predecessors, weights)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses[::10]
    with torch.no_grad():
        picks = selector_drafts(selector, hidden, logits, predecessors)
    assert torch.equal(picks[reachable], labels[reachable])


@torch.no_grad()
def test_untrained_dflash2_is_its_v1_drafter():
    """The training init makes each convolution the identity and the pair term zero: the forward equals a v1 drafter
    with the same shared weights, and the selector drafts each position's argmax."""
    raw = _tiny_config()
    v2 = DenseDFlash2Drafter(raw)
    v2.init_weights(torch.Generator().manual_seed(0))
    v1 = DenseDFlashDrafter(drafter_config({**raw, "num_hidden_layers": 3}, num_layers=1, target_layer_ids=[0, 2],
                                           mask_token_id=31, block_size=4))
    missing, unexpected = v1.load_state_dict(v2.state_dict(), strict=False)
    assert not missing and all(k.startswith("candidate_selector.") or "_conv." in k for k in unexpected)
    embed, head = torch.nn.Embedding(32, 64), torch.nn.Linear(64, 32, bias=False)
    ids, states, anchors = torch.randint(0, 31, (1, 16)), torch.randn(1, 16, 128), torch.tensor([[2, 9]])
    hidden = v2(states, ids, anchors, embed)[:, :, 1:]
    torch.testing.assert_close(hidden, v1(states, ids, anchors, embed)[:, :, 1:])
    logits = head(hidden)
    assert torch.equal(v2.drafts(hidden, logits, ids, anchors), logits.argmax(-1))


def test_conv_base_kernels_are_not_weight_decayed():
    model = DenseDFlash2Drafter(_tiny_config())
    groups = adamw(model, LoopConfig(lr=1e-3, steps=1), torch.device("cpu")).param_groups
    decayed, kept = (set(map(id, g["params"])) for g in groups)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[i] for i in kept if names[i].endswith("base_kernel")} == {
        "layers.0.attention_conv.base_kernel", "layers.0.mlp_conv.base_kernel"}
    assert {"candidate_selector.predecessor_codebook", "layers.0.attention_conv.kernel_projection.weight"} <= {
        names[i] for i in decayed}


def test_trains_under_bf16_autocast_with_fp32_weights():
    """CUDA training runs the forward under bf16 autocast over fp32 weights (``autocast_for``): the dynamic
    convolutions hand bf16 activations to projections that are tqops' linear op, which must autocast as F.linear
    does. CPU autocast stands in for CUDA's here: every parameter gets a finite fp32 gradient."""
    gen = torch.Generator().manual_seed(0)
    model = DenseDFlash2Drafter(_tiny_config())
    model.init_weights(gen)
    embed, head = torch.nn.Embedding(32, 64), torch.nn.Linear(64, 32, bias=False)
    ids, states = torch.randint(0, 31, (2, 24), generator=gen), torch.randn(2, 24, 128, generator=gen)
    anchors = torch.tensor([[1, 6, 11, 17], [3, 8, 13, 20]])
    labels, weights = block_labels(ids, anchors, 4), position_weights(4, 7.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model(states, ids, anchors, embed)[:, :, 1:]
        logits = head(hidden)
        loss = selector_loss(model.candidate_selector, hidden, logits.float(), labels,
                             block_predecessors(ids, anchors, 4), weights)
        loss = loss + torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), labels.flatten())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and g.dtype == torch.float32 and g.isfinite().all() for g in grads.values()), [
        n for n, g in grads.items() if g is None or not g.isfinite().all()]
