"""CUDA-graph runner: bucketing, padding and in-place refill (CPU), capture and replay (GPU)."""
import copy

import pytest
import torch

import tqops
from tqops.cudagraph import CudaGraphRunner, StepBuffers, pick_bucket
from tqops.graphs import ForwardContext, build_metadata, set_forward_context

from ..graphs.toy import MIXED_LAYERS, VOCAB, PagedBatch, ToyModel


def test_pick_bucket():
    assert [pick_bucket([1, 2, 4, 8], b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_fill_pads_and_refills_in_place():
    buf = StepBuffers(q_len=2, max_batch=4, max_blocks=3, block_size=16, groups=(0, 1), device="cpu", context_dim=5)
    ptrs = [buf.input_ids.data_ptr(), buf.slot_mappings[1].data_ptr(), buf.context_states.data_ptr()]
    tables = {0: torch.tensor([[4, 1], [2, 0]]), 1: torch.tensor([[7, 8], [9, 3]])}
    buf.fill(3, torch.tensor([11, 12, 13, 14]), torch.tensor([16, 17, 3, 4]), torch.tensor([18, 5]), tables,
             context_states=torch.ones(4, 5), context_positions=torch.tensor([14, 15, 1, 2]),
             context_slot_mappings={0: torch.tensor([78, 79, -1, 33]), 1: torch.tensor([1, 2, 3, -1])})
    assert buf.input_ids[:6].tolist() == [11, 12, 13, 14, 0, 0]
    assert buf.seq_lens[:3].tolist() == [18, 5, 0]
    assert buf.query_start_loc[:4].tolist() == [0, 2, 4, 6]
    assert buf.slot_mappings[0][:6].tolist() == [1 * 16 + 0, 1 * 16 + 1, 2 * 16 + 3, 2 * 16 + 4, -1, -1]
    assert buf.slot_mappings[1][:6].tolist() == [8 * 16 + 0, 8 * 16 + 1, 9 * 16 + 3, 9 * 16 + 4, -1, -1]
    assert buf.block_tables[0][:3].tolist() == [[4, 1, -1], [2, 0, -1], [0, 0, 0]]  # past the table: no block
    assert buf.context_slot_mappings[0][:6].tolist() == [78, 79, -1, 33, -1, -1]
    assert buf.context_states[4:6].abs().sum() == 0
    assert [buf.input_ids.data_ptr(), buf.slot_mappings[1].data_ptr(), buf.context_states.data_ptr()] == ptrs
    ctx = buf.forward_context(3)
    assert ctx.attn_metadata[0].block_table.shape == (3, 3) and ctx.context_states.shape == (6, 5)
    with pytest.raises(ValueError, match="does not fit bucket"):
        buf.fill(1, torch.zeros(4), torch.zeros(4), torch.tensor([1, 1]), tables)


def test_a_narrower_table_cannot_reach_an_earlier_steps_blocks():
    """Columns past the caller's table are -1, not the previous step's blocks: a seq_len past the table stores
    nothing and the eager check names the entry, instead of writing into another sequence's block."""
    from tqops.graphs import Attention

    attn = Attention(2, 1, 64, name="l0")
    attn.allocate_cache(8, 16)
    x = torch.randn(1, 64)
    runner = CudaGraphRunner(lambda ids, pos: attn(x[:, None].expand(-1, 2, -1).contiguous(), x[:, None], x[:, None]),
                             StepBuffers(q_len=1, max_batch=1, max_blocks=4, block_size=16, groups=(0, 1),
                                         device="cpu"), [1])
    step = lambda table, seq_len: runner(torch.tensor([3]), torch.tensor([seq_len - 1]),  # noqa: E731
                                         torch.tensor([seq_len]), {0: torch.tensor([table]), 1: torch.tensor([table])})
    step([4, 5, 6, 7], 64)  # the first sequence's last token goes to block 7
    before = attn.kv_cache.clone()
    assert runner.buffers.block_tables[0].tolist() == [[4, 5, 6, 7]]
    with pytest.raises(IndexError, match=r"block_table\[0, 2\] = -1 is out of range"):
        step([0, 1], 64)  # a sequence owning blocks 0 and 1 only, with a seq_len past them
    assert torch.equal(attn.kv_cache, before)
    assert runner.buffers.block_tables[0].tolist() == [[0, 1, -1, -1]]
    step([0, 1], 20)  # within its table: runs
    with pytest.raises(ValueError, match=r"block_tables\[0\] has shape \(1, 5\); expected \[batch = 1, at most "
                                         r"max_blocks = 4\]"):
        step([0, 1, 2, 3, 4], 20)


def _decode_steps(runner_model, reference_model, device, batch_size, bucket_list, steps=3):
    """Prefill eagerly, then decode ``steps`` tokens through the runner and directly; compare per step."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(batch_size)
    prompt_lens = torch.randint(3, 20, (batch_size,), generator=gen)
    batch = PagedBatch(batch_size, 4, 16, device=device)
    tables = {g: t.to(device) for g, t in batch.tables.items()}
    ids = torch.randint(0, VOCAB, (int(prompt_lens.sum()),), generator=gen).to(device)
    for model in (runner_model, reference_model):
        seq_lens = prompt_lens.to(torch.int32).to(device)
        meta = {g: build_metadata(seq_lens, seq_lens, t, 16, ids.shape[0]) for g, t in tables.items()}
        with torch.no_grad(), set_forward_context(ForwardContext(meta)):
            model(ids)
    buffers = StepBuffers(q_len=1, max_batch=8, max_blocks=4, block_size=16, groups=(0, 1), device=device)
    runner = CudaGraphRunner(lambda ids, pos: runner_model(ids), buffers, bucket_list)
    runner.capture(progress=False)
    seq_lens = prompt_lens.to(torch.int32).to(device)
    for _ in range(steps):
        seq_lens = seq_lens + 1
        ids = torch.randint(0, VOCAB, (batch_size,), generator=gen).to(device)
        positions = (seq_lens - 1).long()
        got = runner(ids, positions, seq_lens, tables).clone()
        ones = torch.ones_like(seq_lens)
        meta = {g: build_metadata(ones, seq_lens, t, 16, batch_size) for g, t in tables.items()}
        with torch.no_grad(), set_forward_context(ForwardContext(meta)):
            expected = reference_model(ids)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # Padding changes the matmul row count, so K/V may round differently in the last bit: compare decoded caches.
    slots = torch.arange(40 * 16, device=device)
    for a, b in zip(runner_model.layers, reference_model.layers):
        fmt = a.attn.fmt
        for got_kv, want_kv in zip(tqops.kv_load(a.attn.kv_cache, slots, fmt, a.attn.head_dim),
                                   tqops.kv_load(b.attn.kv_cache, slots, fmt, b.attn.head_dim)):
            ok = ~torch.isnan(want_kv)  # never-written slots of the zeroed cache decode alike; NaN-safe anyway
            torch.testing.assert_close(got_kv[ok], want_kv[ok], rtol=2e-2, atol=2e-2)
    return runner


def test_runner_eager_path_with_padding_matches_unpadded_model():
    model = ToyModel(MIXED_LAYERS)
    reference = copy.deepcopy(model)
    model.allocate(40, 16)
    reference.allocate(40, 16)
    runner = _decode_steps(model, reference, "cpu", batch_size=3, bucket_list=[1, 4])
    assert runner.captured_buckets() == []


@pytest.mark.gpu
def test_captured_replay_matches_eager_on_cuda():
    model = ToyModel(MIXED_LAYERS).cuda()
    reference = copy.deepcopy(model)
    model.allocate(40, 16, "cuda")
    reference.allocate(40, 16, "cuda")
    runner = _decode_steps(model, reference, "cuda", batch_size=3, bucket_list=[1, 2, 4, 8], steps=4)
    assert runner.captured_buckets() == [1, 2, 4, 8]


def test_tuple_outputs_are_cut_to_the_batch_by_tokens_or_sequences():
    """Outputs may be nested and None; dim 0 counts tokens (bucket * q_len) or sequences (bucket)."""
    buf = StepBuffers(q_len=4, max_batch=4, max_blocks=2, block_size=16, groups=(0,), device="cpu")

    def step(ids, pos):
        return ids.float()[:, None] * 2, (None, {"per_seq": ids.view(-1, 4).sum(1)})

    runner = CudaGraphRunner(step, buf, [4])
    ids = torch.arange(8)
    tokens, (none, per_seq) = runner(ids, torch.arange(8), torch.tensor([4, 4]), {0: torch.zeros(2, 2, dtype=torch.int32)})
    assert tokens.shape == (8, 1) and torch.equal(tokens[:, 0], ids.float() * 2)
    assert none is None and per_seq["per_seq"].tolist() == [6, 22]


def test_default_buckets():
    from tqops.cudagraph.steps import default_buckets

    assert default_buckets(1) == [1] and default_buckets(3) == [1, 2, 3] and default_buckets(8) == [1, 2, 4, 8]
