"""A mixed-format toy model compiles with fullgraph=True and matches eager over steps with rollbacks."""
import copy

import pytest
import torch

from tqops.graphs import compile_model, mark_token_dim_dynamic, set_forward_context

from .toy import MIXED_LAYERS, VOCAB, PagedBatch, ToyModel

# (query tokens per sequence, tokens rejected afterwards): prefill, decode, a verify block, after a rollback.
STEPS = [([5, 3], [0, 0]), ([1, 1], [0, 0]), ([4, 4], [2, 3]), ([2, 2], [0, 0]), ([1, 1], [0, 0])]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@torch.no_grad()
def _run(model, batch, steps, fn, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for query_lens, rejected in steps:
        ids = torch.randint(0, VOCAB, (sum(query_lens),), generator=gen).to(device)
        with set_forward_context(batch.step(query_lens)):
            outs.append(fn(ids))
        batch.rollback(rejected)
    return outs


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_model_compiles_without_breaks_and_matches_eager(device):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = ToyModel(MIXED_LAYERS).to(device)
    compiled_model = copy.deepcopy(eager)
    eager.allocate(16, 16, device)
    compiled_model.allocate(16, 16, device)

    compiled, report = compile_model(compiled_model, fullgraph=True)

    def compiled_step(ids):
        mark_token_dim_dynamic(ids)
        return compiled(ids)

    expected = _run(eager, PagedBatch(2, 4, 16, device=device), STEPS, eager, device)
    got = _run(compiled_model, PagedBatch(2, 4, 16, device=device), STEPS, compiled_step, device)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    for a, b in zip(eager.layers, compiled_model.layers):
        assert torch.equal(a.attn.kv_cache, b.attn.kv_cache)
    assert report.graph_breaks == {}
    assert report.compilations == 1, f"recompiled across steps/batch sizes: {report}"


def test_same_shape_steps_do_not_recompile_with_changing_metadata():
    torch._dynamo.reset()
    torch.manual_seed(1)
    model = ToyModel(MIXED_LAYERS)
    model.allocate(16, 16)
    compiled, report = compile_model(model)
    steps = [([3, 3], [0, 0]), ([3, 3], [2, 1]), ([3, 3], [0, 0]), ([3, 3], [3, 0])]
    outs = _run(model, PagedBatch(2, 4, 16), steps, compiled, "cpu")
    assert all(torch.isfinite(o).all() for o in outs)
    assert report.compilations == 1, str(report)


def test_layers_keep_their_own_properties():
    model = ToyModel(MIXED_LAYERS)
    formats = [layer.attn.fmt.name for layer in model.layers]
    assert formats == ["bf16", "bf16", "turboquant_4bit_nc", "turboquant_4bit_nc", "bf16", "bf16"]
    assert [layer.attn.group for layer in model.layers] == [0, 1, 0, 1, 0, 1]
    assert [layer.attn.causal for layer in model.layers] == [True, True, False, True, True, True]


def test_no_recompilation_across_batch_sizes_with_dynamic_tokens():
    torch._dynamo.reset()
    torch.manual_seed(2)
    model = ToyModel(MIXED_LAYERS)
    model.allocate(32, 16)
    compiled, report = compile_model(model)

    def step(ids):
        mark_token_dim_dynamic(ids)
        return compiled(ids)

    for batch_size in (1, 3, 2, 5):
        batch = PagedBatch(batch_size, 2, 16, device="cpu")
        outs = _run(model, batch, [([4] * batch_size, [0] * batch_size), ([1] * batch_size, [0] * batch_size)], step,
                    "cpu", seed=batch_size)
        assert [o.shape[0] for o in outs] == [4 * batch_size, batch_size]
    assert report.compilations == 1, str(report)
