"""DFlash context-state injection: opcheck, compile, and padded context rows never reach the cache."""
import dataclasses

import pytest
import torch

from tqops.graphs import ForwardContext, compile_model, set_forward_context

from .toy import HIDDEN, VOCAB, LayerSpec, PagedBatch, ToyDrafter

DRAFTER_LAYERS = [LayerSpec("turboquant_3bit_nc", causal=False), LayerSpec("fp8_e5m2", causal=False)]


def test_opcheck_injection_op():
    states = torch.randn(6, 8)
    with set_forward_context(ForwardContext({}, context_states=states)):
        like = torch.zeros(4, dtype=torch.long)
        torch.library.opcheck(torch.ops.tqops.dflash_context_states.default, (like, 8, torch.float32))
        out = torch.ops.tqops.dflash_context_states(like, 8, torch.float32)
    assert torch.equal(out, states[:4])
    assert out.data_ptr() != states.data_ptr()


def test_opcheck_context_positions():
    positions = torch.tensor([7, 8, 9, 3, 4])
    with set_forward_context(ForwardContext({}, context_positions=positions)):
        like = torch.zeros(4, dtype=torch.long)
        torch.library.opcheck(torch.ops.tqops.dflash_context_positions.default, (like,))
        assert torch.equal(torch.ops.tqops.dflash_context_positions(like), positions[:4])


def test_injection_errors_are_clear():
    like = torch.zeros(4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="no forward context"):
        torch.ops.tqops.dflash_context_states(like, 8, torch.float32)
    with set_forward_context(ForwardContext({})):
        with pytest.raises(RuntimeError, match="has none"):
            torch.ops.tqops.dflash_context_states(like, 8, torch.float32)
    with set_forward_context(ForwardContext({}, context_states=torch.zeros(3, 8))):
        with pytest.raises(ValueError, match=r"expected at least \[4, 8\]"):
            torch.ops.tqops.dflash_context_states(like, 8, torch.float32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.smoke])])
@torch.no_grad()
def test_compiled_drafter_stores_only_accepted_context_rows(device):
    torch._dynamo.reset()
    torch.manual_seed(0)
    drafter = ToyDrafter(DRAFTER_LAYERS).to(device)
    num_blocks, block_size = 8, 16
    drafter.allocate(num_blocks, block_size, device)
    for layer in drafter.layers:  # a recognisable pattern, so any stray write shows
        layer.attn.kv_cache.fill_(0xA5)
    before = [layer.attn.kv_cache.clone() for layer in drafter.layers]
    compiled, report = compile_model(drafter)

    # Two sequences, a query block of 4 each; sequence 0 accepted 3 context rows, sequence 1 accepted 1.
    batch = PagedBatch(2, 4, block_size, groups=(0,), device=device)
    batch.seq_lens += torch.tensor([20, 9], dtype=torch.int32)  # context already in the cache
    ctx = batch.step([4, 4], context=torch.randn(8, ToyDrafter.CONTEXT_DIM, device=device))
    table = batch.tables[0].to(device)
    accepted_pos = torch.tensor([17, 18, 19, -1, 6, -1, -1, -1], device=device)
    seq_of_row = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], device=device)
    from tqops.graphs import slots_for_positions

    context_slots = slots_for_positions(accepted_pos, seq_of_row, table, block_size)
    ctx.attn_metadata[0] = dataclasses.replace(ctx.attn_metadata[0], context_slot_mapping=context_slots)
    ctx.context_positions = accepted_pos  # each stored row's slot is checked against the table's for its position
    ids = torch.randint(0, VOCAB, (8,), device=device)
    with set_forward_context(ctx):
        out = compiled(ids)
    assert out.shape == (8, HIDDEN) and torch.isfinite(out).all()
    assert report.graph_breaks == {} and report.compilations == 1

    allowed = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    allowed[context_slots[context_slots >= 0]] = True
    allowed[ctx.attn_metadata[0].slot_mapping] = True
    for layer, old in zip(drafter.layers, before):
        flat, flat_old = layer.attn.kv_cache.flatten(0, 1), old.flatten(0, 1)
        assert torch.equal(flat[~allowed], flat_old[~allowed]), "a rejected/padded context row reached the cache"
        assert not torch.equal(flat[allowed], flat_old[allowed])
