"""graphs.Attention with bad metadata: a clear error naming the layer, raised before any write (the cache stays
bitwise unchanged), or, for valid metadata, output equal to a float64 reference."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tqops.graphs import Attention, ForwardContext, build_metadata, set_forward_context

from ..attention.cases import Case, dense_oracle

NUM_BLOCKS, BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 8, 16, 4, 2, 64
NAME = "model.layers.0.self_attn"


def _layer(fmt="bf16", causal=True):
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, name=NAME, cache_format=fmt, causal=causal)
    layer.allocate_cache(NUM_BLOCKS, BLOCK_SIZE)
    layer.kv_cache.zero_()
    return layer


def _run(layer, meta, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
    k, v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g), torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)
    with set_forward_context(ForwardContext({0: meta})):
        return layer(q, k, v), q


def _rejects(layer, meta, n, exc, match):
    before = layer.kv_cache.clone()
    with pytest.raises(exc, match=match) as info:
        _run(layer, meta, n)
    assert NAME in str(info.value)
    assert torch.equal(layer.kv_cache, before)


def test_seq_len_past_the_block_table_writes_nothing():
    # 34 keys with a table of 2 blocks of 16: positions 32-33 have no block.
    layer = _layer()
    meta = build_metadata(torch.tensor([34]), torch.tensor([34]), torch.tensor([[0, 1]]), BLOCK_SIZE, 34)
    assert (meta.slot_mapping[32:] == -1).all()  # never redirected into blocks 0-1
    _rejects(layer, meta, 34, ValueError, r"seq_lens\[0\] = 34")


def test_negative_block_entry_is_rejected_before_the_store():
    layer = _layer()
    meta = build_metadata(torch.tensor([3]), torch.tensor([20]), torch.tensor([[2, -1]]), BLOCK_SIZE, 3)
    _rejects(layer, meta, 3, IndexError, r"block_table\[0, 1\] = -1")


def test_out_of_range_slot_writes_no_row():
    layer = _layer()
    meta = build_metadata(torch.tensor([2, 1]), torch.tensor([2, 1]), torch.tensor([[0], [1]]), BLOCK_SIZE, 3)
    meta.slot_mapping[2] = NUM_BLOCKS * BLOCK_SIZE
    _rejects(layer, meta, 3, IndexError, r"slot_mapping\[2\] = 128")


def test_duplicate_slots_are_rejected():
    layer = _layer()
    meta = build_metadata(torch.tensor([3]), torch.tensor([3]), torch.tensor([[0]]), BLOCK_SIZE, 3)
    meta.slot_mapping[2] = meta.slot_mapping[0]
    _rejects(layer, meta, 3, ValueError, "stores slot 0 more than once")


def test_slot_outside_the_sequences_blocks_is_rejected():
    layer = _layer()
    meta = build_metadata(torch.tensor([2, 1]), torch.tensor([2, 1]), torch.tensor([[0], [1]]), BLOCK_SIZE, 3)
    meta.slot_mapping[2] = 5  # sequence 1's token into sequence 0's block
    _rejects(layer, meta, 3, ValueError, r"slot_mapping\[2\] = 5, but token 2 \(sequence 1, position 0\)")


@pytest.mark.parametrize("slot,match", [
    (16, r"context_slot_mapping\[0\] = 16, but context row 0 \(sequence 0, position 0\) belongs in slot 0"),
    (1, r"context_slot_mapping\[0\] = 1, but context row 0 \(sequence 0, position 0\) belongs in slot 0"),
], ids=["another-sequences-block", "another-position"])
def test_context_row_outside_its_slot_is_rejected(slot, match):
    """DFlash context rows: each stored row's slot must be the block table's for its sequence and position."""
    layer = _layer(causal=False)
    meta = build_metadata(torch.tensor([2, 2]), torch.tensor([2, 2]), torch.tensor([[0], [1]]), BLOCK_SIZE, 4)
    meta.context_slot_mapping = torch.tensor([slot, -1, -1, 17])
    context = ForwardContext({0: meta}, context_positions=torch.tensor([0, 1, 0, 1]))
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(4, KV_HEADS, HEAD_DIM, generator=g), torch.randn(4, KV_HEADS, HEAD_DIM, generator=g)
    with set_forward_context(context), pytest.raises(ValueError, match=match):
        layer.store_context(k, v)
    assert not layer.kv_cache.any()
    meta.context_slot_mapping = torch.tensor([0, -1, -1, 17])  # the table's slots: stored
    with set_forward_context(context):
        layer.store_context(k, v)
    assert layer.kv_cache[0, 0].any() and layer.kv_cache[1, 1].any() and not layer.kv_cache[0, 1].any()


def test_padding_token_that_stores_is_rejected():
    layer = _layer()
    meta = build_metadata(torch.tensor([2]), torch.tensor([2]), torch.tensor([[0]]), BLOCK_SIZE, 4)
    meta.slot_mapping[3] = 9
    _rejects(layer, meta, 4, ValueError, "token 3 is padding")


def test_index_dtype_is_checked():
    layer = _layer()
    meta = build_metadata(torch.tensor([2]), torch.tensor([2]), torch.tensor([[0]]), BLOCK_SIZE, 2)
    meta.seq_lens = meta.seq_lens.float()
    _rejects(layer, meta, 2, TypeError, "seq_lens has dtype float32")


@pytest.mark.parametrize("field,index", [("block_table", (0, 1)), ("seq_lens", (0,)), ("query_start_loc", (1,)),
                                         ("slot_mapping", (1,))])
def test_index_past_int32_is_rejected(field, index):
    """int64 metadata: a value past int32 (the kernels' index type) is an IndexError, not narrowed to another slot
    or block (2**32 + 1 -> 1)."""
    layer = _layer()
    meta = build_metadata(torch.tensor([2]), torch.tensor([2]), torch.tensor([[0, 1]]), BLOCK_SIZE, 2)
    for name in ("block_table", "seq_lens", "query_start_loc", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).long())
    getattr(meta, field)[index] = 2**32 + 1
    where = ", ".join(map(str, index))
    _rejects(layer, meta, 2, IndexError, rf"{field}\[{where}\] = 4294967297 does not fit int32")


@pytest.mark.parametrize("head_dim", [96, 32])
def test_unsupported_head_dim_fails_at_construction(head_dim):
    with pytest.raises(ValueError, match=f"'l0': head_dim={head_dim}; paged attention supports"):
        Attention(4, 2, head_dim, name="l0")


def test_metadata_is_checked_once_per_step(monkeypatch):
    from tqops.graphs import metadata

    calls = []
    real = metadata._check_metadata
    monkeypatch.setattr(metadata, "_check_metadata", lambda *a: calls.append(1) or real(*a))
    layers = [_layer(), _layer()]
    meta = build_metadata(torch.tensor([2]), torch.tensor([2]), torch.tensor([[0]]), BLOCK_SIZE, 2)
    with set_forward_context(ForwardContext({0: meta})):
        for layer in layers:
            layer(torch.randn(2, HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM))
    assert len(calls) == 1  # two layers x (store + attention), one check
    meta.seq_lens.fill_(1)  # an in-place change invalidates the memo
    with set_forward_context(ForwardContext({0: meta})), pytest.raises(ValueError):
        layers[0](torch.randn(2, HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM))



def test_drafter_layers_check_a_step_once_with_context_rows(monkeypatch):
    """A DFlash layer stores context rows, then its tokens: each check runs once per step, not once per layer."""
    from tqops.graphs import metadata

    calls = {"tokens": 0, "context": 0}
    real_tokens, real_context = metadata._check_metadata, metadata._check_context_slots
    monkeypatch.setattr(metadata, "_check_metadata",
                        lambda *a: calls.__setitem__("tokens", calls["tokens"] + 1) or real_tokens(*a))
    monkeypatch.setattr(metadata, "_check_context_slots",
                        lambda *a: calls.__setitem__("context", calls["context"] + 1) or real_context(*a))
    layers = [_layer(causal=False), _layer(causal=False)]
    meta = build_metadata(torch.tensor([2]), torch.tensor([4]), torch.tensor([[0]]), BLOCK_SIZE, 2)
    meta.context_slot_mapping = torch.tensor([0, 1])
    with set_forward_context(ForwardContext({0: meta}, context_positions=torch.tensor([0, 1]))):
        for layer in layers:
            layer.store_context(torch.randn(2, KV_HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM))
            layer(torch.randn(2, HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM), torch.randn(2, KV_HEADS, HEAD_DIM))
    assert calls == {"tokens": 1, "context": 1}


# ---- random, partly invalid metadata -----------------------------------------------------------------------------

CORRUPTIONS = ["none", "seq_past_table", "block_negative", "block_past_cache", "q_len_past_seq", "seq_negative",
               "slot_past_cache", "slot_duplicate", "slot_other_sequence", "padding_stores", "qsl_past_tokens"]


def _reference(layer, q, meta):
    """float64 attention of q over the K/V that the valid metadata puts in the cache, read back with kv_load."""
    empty = torch.empty(0)
    return dense_oracle(Case(fmt=layer.fmt, query=q, cache=layer.kv_cache, block_table=meta.block_table,
                             seq_lens=meta.seq_lens, query_start_loc=meta.query_start_loc, causal=layer.causal,
                             sliding_window=None, sinks=None, k_scale=1.0, v_scale=1.0, key=empty, value=empty))


@given(data=st.data(), fmt=st.sampled_from(["bf16", "fp8_e4m3", "turboquant_4bit_nc"]), causal=st.booleans(),
       corruption=st.sampled_from(CORRUPTIONS))
def test_random_metadata_raises_cleanly_or_matches_reference(data, fmt, causal, corruption):
    layer = _layer(fmt, causal)
    batch = data.draw(st.integers(1, 3), label="batch")
    max_blocks = 2
    seq_lens = [data.draw(st.integers(1, max_blocks * BLOCK_SIZE), label="seq_len") for _ in range(batch)]
    q_lens = [data.draw(st.integers(1, s), label="q_len") for s in seq_lens]
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(sum(seq_lens)))
    table = blocks[: batch * max_blocks].view(batch, max_blocks)
    # Earlier steps wrote each sequence's context (valid metadata), so attention reads only written keys.
    ctx = [s - q for s, q in zip(seq_lens, q_lens)]
    if sum(ctx):
        prefill = build_metadata(torch.tensor(ctx), torch.tensor(ctx), table, BLOCK_SIZE, sum(ctx))
        _run(layer, prefill, sum(ctx), seed=1)
    pad = data.draw(st.integers(0, 2), label="padding")
    b = data.draw(st.integers(0, batch - 1), label="victim")
    seq_t, q_t = torch.tensor(seq_lens), torch.tensor(q_lens)
    if corruption == "seq_past_table":
        seq_t[b] = max_blocks * BLOCK_SIZE + data.draw(st.integers(1, 20))
    elif corruption == "q_len_past_seq":  # (a sequence of seq_len 0 would be a padding sequence: allowed)
        q_t[b] = seq_t[b] + 1
    elif corruption == "seq_negative":
        seq_t[b] = -1
    elif corruption in ("block_negative", "block_past_cache"):
        table = table.clone()
        table[b, (seq_lens[b] - 1) // BLOCK_SIZE] = -1 if corruption == "block_negative" else NUM_BLOCKS + 3
    real = int(q_t.sum())
    n = real + pad
    meta = build_metadata(q_t, seq_t, table, BLOCK_SIZE, n)
    if corruption == "slot_past_cache":
        meta.slot_mapping[data.draw(st.integers(0, real - 1))] = NUM_BLOCKS * BLOCK_SIZE
    elif corruption == "slot_duplicate" and real > 1:
        meta.slot_mapping[real - 1] = meta.slot_mapping[0]
    elif corruption == "slot_other_sequence":
        meta.slot_mapping[data.draw(st.integers(0, real - 1))] = int(blocks[-1]) * BLOCK_SIZE  # an unused block
    elif corruption == "padding_stores" and pad:
        meta.slot_mapping[-1] = int(blocks[-1]) * BLOCK_SIZE
    elif corruption == "qsl_past_tokens":
        meta.query_start_loc[-1] = n + 1
    before = layer.kv_cache.clone()
    try:
        out, q = _run(layer, meta, n, seed=2)
    except (ValueError, IndexError) as e:
        assert NAME in str(e)
        assert torch.equal(layer.kv_cache, before)
        return
    assert corruption in ("none", "slot_duplicate", "padding_stores"), f"{corruption} was accepted"
    torch.testing.assert_close(out[:real].double(), _reference(layer, q, meta)[:real], rtol=1e-4, atol=1e-4)
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
