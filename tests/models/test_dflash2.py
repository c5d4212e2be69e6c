"""DFlash2 drafters (z-lab's ``DFlash2DraftModel``) in tqops: loading, the convolution and the candidate selector
against z-lab's reference, and the speculative loop (greedy equal to plain decoding, eager, compiled, captured).

The reference tests need z-lab's pip package, which the test extra does not install (its metadata pins tqdm,
requests and datasets exactly, and datasets brings pyarrow, pandas and aiohttp that ``dflash.model`` never imports);
without it they skip and the rest run on checkpoints from ``fixtures.write_drafter(dflash2=...)``. To run them::

    pip install --no-deps dflash==0.1.0 && python -m pytest tests/models/test_dflash2.py

The reference comparison follows tests/models/test_zlab_reference.py: both sides in fp32 on CPU, tqops on the fp16
cache (the reference attends over unrounded K/V), and ``dflash_generate`` run ``block_size`` tokens longer and cut,
since it shrinks its final blocks where tqops drafts full ones. z-lab's ``DFlash2DraftModel(config)`` leaves its
``base_kernel``s uninitialized (``torch.empty``), so the tests give every parameter seeded random values before
``save_pretrained``, which writes the codebooks with a ``.weight`` suffix (the published checkpoints have none, as
the fixture writes them; both load).
"""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tqops.graphs import set_forward_context
from tqops.models import DFlash2Drafter, DFlashDrafter, Qwen3Config, Qwen3ForCausalLM, SelectedDrafts, generate
from tqops.models.dflash2 import GroupedDynamicCausalConv, grouped_dynamic_causal_conv
from tqops.models.generate import step_context

from .fixtures import capped_lengths, randomize_dflash2, write_drafter, write_target

INSTALL = "z-lab's reference: pip install --no-deps dflash==0.1.0"
VOCAB, BS, WINDOW = 32, 8, 4
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
PROMPTS = [[3, 9, 1, 14, 7, 2, 11, 20, 5], [5, 8], [12, 4, 6, 0, 13, 27]]
NEW_TOKENS = 24


# ---- z-lab's reference ----

@pytest.fixture(scope="module")
def zlab():
    pytest.importorskip("transformers")
    return pytest.importorskip("dflash.model", reason=INSTALL)


@torch.no_grad()
def _lean_to_repeats(z_drafter, hf_target, seed: int) -> None:
    """Random drafts are almost never what a random target decodes, so the acceptance lengths would compare only 1s.
    The tiny target's greedy continuations repeat tokens, so this makes the selector lean to repeating its
    predecessor: attention and MLP outputs scaled down (the mask positions' hidden states stay near their mean),
    both codebooks the same rows of norm 4, and the gate projecting that mean to 1 in every rank, so the pair term
    is largest for the predecessor itself whenever it is among the candidates."""
    gen = torch.Generator().manual_seed(seed)
    for layer in z_drafter.layers:
        layer.self_attn.o_proj.weight.mul_(0.3)
        layer.mlp.down_proj.weight.mul_(0.3)
    selector = z_drafter.candidate_selector
    rows = torch.randn(selector.predecessor_codebook.weight.shape, generator=gen)
    rows = 4 * rows / rows.norm(dim=1, keepdim=True)
    selector.predecessor_codebook.weight.copy_(rows)
    selector.successor_codebook.weight.copy_(rows)
    hidden = []
    for anchor in range(0, VOCAB, 3):
        block = torch.full((1, BS), VOCAB - 1)
        block[0, 0] = anchor
        ctx = torch.randn(1, 6, 2 * 64, generator=gen)
        hidden.append(z_drafter(position_ids=torch.arange(6 + BS)[None], target_hidden=ctx,
                                noise_embedding=hf_target.get_input_embeddings()(block))[0, 1:])
    mean = torch.cat(hidden).mean(0)
    selector.hidden_projection.weight.copy_(mean.expand_as(selector.hidden_projection.weight) / mean.norm() ** 2)


@pytest.fixture(scope="module")
def zlab_pair(zlab, tmp_path_factory):
    """(transformers target, z-lab DFlash2 drafter, tqops target, tqops drafter, drafter folder): a tiny random
    Qwen3 saved by transformers and a DFlash2 drafter saved by z-lab's class (a full and a sliding layer, block 8,
    16 candidates of 32)."""
    import transformers

    root = tmp_path_factory.mktemp("zlab2")
    torch.manual_seed(0)
    hf_target = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, initializer_range=0.5)).eval()
    hf_target.save_pretrained(root / "t")
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, layer_types=["full_attention", "sliding_attention"],
        use_sliding_window=True, sliding_window=WINDOW, architectures=["DFlash2DraftModel"], num_target_layers=3,
        dflash_config={"target_layer_ids": [0, 2], "mask_token_id": VOCAB - 1, "block_size": BS,
                       **dict(DFLASH2, selector_top_k=16)})
    z_drafter = zlab.DFlash2DraftModel(cfg)
    randomize_dflash2(z_drafter, 3)
    _lean_to_repeats(z_drafter, hf_target, 9)
    z_drafter.save_pretrained(root / "d")
    target = Qwen3ForCausalLM.from_pretrained(root / "t", cache_format="fp16", dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(root / "d", target=target, cache_format="fp16")
    return hf_target, z_drafter.eval(), target, drafter, root / "d"


def _tqops_blocks(drafter, contexts, anchors):
    """tqops' drafter over one block per sequence after its context rows: ``contexts[b]`` ``[L_b, C]`` stored with
    ``prefill_context``, then the blocks (anchor + mask tokens) at positions ``L_b ...`` -> (hidden ``[B * bs, H]``,
    block ids ``[B * bs]``)."""
    B, bs = len(contexts), drafter.block_size
    lens = torch.tensor([len(c) for c in contexts], dtype=torch.int32)
    table = torch.arange(B * 4, dtype=torch.int32).view(B, 4)
    drafter.allocate_cache(B * 4, 16)
    pos = torch.cat([torch.arange(len(c)) for c in contexts])
    with set_forward_context(step_context(lens, lens, table, torch.cat(contexts), pos)):
        drafter.prefill_context(pos)
    block = torch.full((B, bs), drafter.mask_token_id)
    block[:, 0] = anchors
    positions = (lens.long()[:, None] + torch.arange(bs)).flatten()
    none = torch.zeros(B * bs, drafter.context_dim), torch.full((B * bs,), -1)
    with set_forward_context(step_context(torch.full((B,), bs, dtype=torch.int32), lens + bs, table, *none)):
        return drafter(block.flatten(), positions), block.flatten()


def _inverse_cdf(uniforms):
    """A stand-in for z-lab's ``_sample_probs`` that draws each call's index from the next column of ``uniforms`` by
    inverse CDF, as tqops' walk does."""
    columns = iter(uniforms.unbind(1))

    def sample(q):
        cdf = q.float().cumsum(-1)
        return (cdf <= next(columns)[:, None] * cdf[:, -1:]).sum(-1)

    return sample


@torch.no_grad()
def test_zlab_checkpoint_loads_and_blocks_and_proposals_match(zlab, zlab_pair, monkeypatch):
    hf_target, z_drafter, target, drafter, path = zlab_pair
    assert type(drafter) is DFlash2Drafter and drafter.block_size == BS
    assert [a.causal for a in drafter.attention_layers] == [False, True]
    assert [a.sliding_window for a in drafter.attention_layers] == [None, WINDOW]
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}
    saved = load_file(os.path.join(path, "model.safetensors"))
    assert set(saved) == {k + ".weight" if k.endswith("codebook") else k for k in state}  # z-lab's spelling
    assert all(torch.equal(saved[k + ".weight" if k.endswith("codebook") else k], v) for k, v in state.items())

    # the convolutions on tqops' packed layout: z-lab's prepare/finish over [blocks, bs, hidden]
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 3, BS, 64, generator=gen)
    for z_conv, conv in ((z_drafter.layers[0].attention_conv, drafter.layers[0].attention_conv),
                         (z_drafter.layers[1].mlp_conv, drafter.layers[1].mlp_conv)):
        z_out, z_kernel = z_conv.prepare(x)
        out, kernel = conv.prepare(x.flatten(0, 1))
        torch.testing.assert_close(out, z_out.flatten(0, 1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv.finish(y.flatten(0, 1), kernel), z_conv.finish(y, z_kernel).flatten(0, 1),
                                   rtol=1e-5, atol=1e-5)

    # block hidden states after different context lengths, two sequences packed
    contexts = [torch.randn(n, drafter.context_dim, generator=gen) for n in (5, 11)]
    anchors = torch.tensor([7, 19])
    hidden, ids = _tqops_blocks(drafter, contexts, anchors)
    z_hidden = []
    for ctx, block in zip(contexts, ids.view(2, BS)):
        noise = hf_target.get_input_embeddings()(block[None])
        z_hidden.append(z_drafter(position_ids=torch.arange(len(ctx) + BS)[None], noise_embedding=noise,
                                  target_hidden=ctx[None])[0])
    z_hidden = torch.cat(z_hidden)
    torch.testing.assert_close(hidden, z_hidden, rtol=1e-2, atol=1e-2)  # the fp16 cache rounds K/V

    # proposals from the same hidden states: greedy, and sampled from the same uniforms
    uniforms = torch.rand(2 * BS, generator=gen)
    for temperature in (0.0, 0.7):
        mine = drafter.propose(z_hidden, ids, temperature, uniforms if temperature else None)
        assert isinstance(mine, SelectedDrafts)
        with monkeypatch.context() as m:  # z-lab's candidates unsorted; tqops' in descending logit order
            topk = torch.topk
            m.setattr(torch, "topk", lambda *a, **k: topk(*a, **dict(k, sorted=True)))
            m.setattr(zlab, "_sample_probs", _inverse_cdf(uniforms.view(2, BS)[:, 1:]))
            tokens, candidates, q = z_drafter.propose(z_hidden.view(2, BS, -1)[:, 1:], ids.view(2, BS)[:, 0],
                                                      hf_target.lm_head, temperature)
        assert torch.equal(mine.tokens, tokens) and torch.equal(mine.candidates, candidates), temperature
        if temperature:
            torch.testing.assert_close(mine.q, q)
        else:
            assert mine.q is None and q is None
    # the fp16 cache's hidden states propose the same greedy drafts
    assert torch.equal(drafter.propose(hidden, ids).tokens, drafter.propose(z_hidden, ids).tokens)


@torch.no_grad()
def test_greedy_generate_matches_dflash_generate(zlab, zlab_pair, monkeypatch):
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # return_stats times with torch.cuda.synchronize
    hf_target, z_drafter, target, drafter, _ = zlab_pair
    result = generate(target, PROMPTS, NEW_TOKENS, drafter=drafter)
    for i, p in enumerate(PROMPTS):
        out = zlab.dflash_generate(z_drafter, hf_target, torch.tensor([p]), NEW_TOKENS + BS, None,
                                   temperature=0.0, return_stats=True)
        assert result.tokens[i] == out.output_ids[0, len(p):len(p) + NEW_TOKENS].tolist(), f"prompt {i}: tokens"
        assert result.acceptance_lengths[i] == capped_lengths(out.acceptance_lengths, NEW_TOKENS), f"prompt {i}: per step"
    assert max(sum(result.acceptance_lengths, [])) > 1  # some drafts were accepted, so the walks were compared


# ---- without z-lab's package: fixture checkpoints ----

@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    return {"target": write_target(root / "t", layer_types=["full_attention", "sliding_attention", "full_attention"],
                                   sliding_window=8),
            "v2": write_drafter(root / "v2", block_size=BS, layer_types=["full_attention", "sliding_attention"],
                                sliding_window=WINDOW, dflash2=True, seed=4),
            "v1": write_drafter(root / "v1", seed=4)}


FORMATS = ["bf16", "fp8_e4m3", "turboquant_4bit_nc"]
FIXTURE_PROMPTS = [[5, 17, 42, 8, 33], [3, 61, 23, 77, 12, 4, 88, 31, 50, 2, 9, 44, 70], [11, 64]]


def _load(paths, fmt):
    target = Qwen3ForCausalLM.from_pretrained(paths["target"], cache_format=fmt, dtype=torch.float32)
    return target, DFlashDrafter.from_pretrained(paths["v2"], target=target, cache_format=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@torch.no_grad()
def test_greedy_equals_plain_decoding_eager_and_captured(paths, fmt):
    target, drafter = _load(paths, fmt)
    assert type(drafter) is DFlash2Drafter
    plain = generate(target, FIXTURE_PROMPTS, 16).tokens
    eager = generate(target, FIXTURE_PROMPTS, 16, drafter=drafter)
    graphed = generate(target, FIXTURE_PROMPTS, 16, drafter=drafter, cudagraph=True)
    assert eager.tokens == graphed.tokens == plain, fmt
    assert eager.acceptance_lengths == graphed.acceptance_lengths, fmt
    if fmt == "bf16":  # the sampled walk reads the loop's uniforms the same way captured and eager
        runs = [generate(target, FIXTURE_PROMPTS, 10, drafter=drafter, temperature=0.8, seed=5, cudagraph=graph)
                for graph in (False, True)]
        assert runs[0].tokens == runs[1].tokens


@torch.no_grad()
def test_compiled_step_compiles_once_without_breaks(paths):
    torch._dynamo.reset()
    target, drafter = _load(paths, "turboquant_4bit_nc")
    plain = generate(target, FIXTURE_PROMPTS, 16).tokens
    compiled = generate(target, FIXTURE_PROMPTS, 16, drafter=drafter, compile=True)
    assert compiled.tokens == plain
    assert set(compiled.compile_reports) == {"target", "drafter_step(temperature=0.0)", "drafter_context"}
    # the captured path replays the same compiled drafter step (the CPU runner runs it padded)
    captured = generate(target, FIXTURE_PROMPTS, 16, drafter=drafter, compile=True, cudagraph=True)
    assert captured.tokens == plain and captured.acceptance_lengths == compiled.acceptance_lengths
    for name, report in captured.compile_reports.items():
        assert report.graph_breaks == {} and report.compilations == 1, (name, str(report))


def test_conv_stays_inside_each_block():
    gen = torch.Generator().manual_seed(0)
    conv = GroupedDynamicCausalConv(32, 3, 8, 4)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(3 * 4, 32, generator=gen)
    out, kernel = conv.prepare(x)
    changed = x.clone()
    changed[4:8] += 1.0  # the second block only
    other, _ = conv.prepare(changed)
    assert torch.equal(other[:4], out[:4]) and torch.equal(other[8:], out[8:]) and not torch.equal(other, out)
    # a naive per-row reference: out[t] = sum_o (base[o] + dyn[t, o, g]) * x[t - o], t - o in t's block
    dyn = conv.kernel_projection(x).view(12, 2, 3, 4)[:, 0]
    want = torch.zeros_like(x)
    for t in range(12):
        for o in range(3):
            if t - o >= t // 4 * 4:
                want[t] += (conv.base_kernel[0, o] + dyn[t, o].repeat_interleave(8)) * x[t - o]
    torch.testing.assert_close(out, want.detach())
    y = grouped_dynamic_causal_conv(x, kernel, conv.base_kernel[1], 8, 4)
    torch.testing.assert_close(conv.finish(x, kernel), y)


def _rewrite(path, edit):
    tensors = load_file(os.path.join(path, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"))


@torch.no_grad()
def test_loading_is_strict_and_v1_still_loads(paths, tmp_path):
    target = Qwen3ForCausalLM.from_pretrained(paths["target"], dtype=torch.float32)
    v1 = DFlashDrafter.from_pretrained(paths["v1"], target=target)
    assert type(v1) is DFlashDrafter and not v1.selects_in_step
    d2 = DFlash2Drafter.from_pretrained(paths["v2"], target=target)
    assert (d2.conv_kernel_size, d2.conv_group_size) == (3, 16)
    assert (d2.candidate_selector.rank, d2.candidate_selector.top_k) == (8, 4)

    def copy(name, source="v2"):
        return shutil.copytree(paths[source], tmp_path / name)

    missing = copy("missing")
    _rewrite(missing, lambda t: t.pop("candidate_selector.successor_codebook"))
    with pytest.raises(ValueError, match=r"missing \['candidate_selector.successor_codebook'\]"):
        DFlashDrafter.from_pretrained(missing, target=target)
    extra = copy("extra")
    _rewrite(extra, lambda t: t.update({"candidate_selector.bias": torch.zeros(4)}))
    with pytest.raises(ValueError, match=r"unexpected \['candidate_selector.bias'\]"):
        DFlashDrafter.from_pretrained(extra, target=target)
    conv = copy("conv")
    _rewrite(conv, lambda t: t.pop("layers.1.mlp_conv.base_kernel"))
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp_conv.base_kernel'\]"):
        DFlashDrafter.from_pretrained(conv, target=target)
    # z-lab's save_pretrained spelling loads the same weights; both spellings at once is an error
    suffixed = copy("suffixed")
    _rewrite(suffixed, lambda t: t.update({"candidate_selector.predecessor_codebook.weight":
                                           t.pop("candidate_selector.predecessor_codebook")}))
    same = DFlashDrafter.from_pretrained(suffixed, target=target)
    assert torch.equal(same.candidate_selector.predecessor_codebook, d2.candidate_selector.predecessor_codebook)
    both = copy("both")
    _rewrite(both, lambda t: t.update({"candidate_selector.successor_codebook.weight":
                                       t["candidate_selector.successor_codebook"].clone()}))
    with pytest.raises(ValueError, match="candidate_selector.successor_codebook twice"):
        DFlashDrafter.from_pretrained(both, target=target)
    # a v1 checkpoint with a selector tensor is refused as before
    v1_extra = copy("v1_extra", "v1")
    _rewrite(v1_extra, lambda t: t.update({"candidate_selector.hidden_projection.weight": torch.zeros(8, 64)}))
    with pytest.raises(ValueError, match=r"unexpected \['candidate_selector.hidden_projection.weight'\]"):
        DFlashDrafter.from_pretrained(v1_extra, target=target)

    with open(os.path.join(paths["v2"], "config.json")) as f:
        raw = json.load(f)
    with pytest.raises(ValueError, match="DFlash2Drafter"):
        DFlashDrafter(Qwen3Config.from_dict(raw))
    del raw["dflash_config"]["selector_top_k"]
    with pytest.raises(ValueError, match="selector_top_k"):
        DFlash2Drafter(Qwen3Config.from_dict(raw))
