"""Attention layers fail clearly outside a forward context or without their group's metadata."""
import pytest
import torch

from tqops.graphs import Attention, AttentionMetadata, ForwardContext, build_metadata, set_forward_context


def _layer(**kw):
    layer = Attention(4, 2, 64, name="model.layers.3.attn", group=1, **kw)
    layer.allocate_cache(2, 16)
    return layer


def _qkv(n=3):
    return torch.randn(n, 4, 64), torch.randn(n, 2, 64), torch.randn(n, 2, 64)


def test_outside_forward_context_names_layer_and_group():
    with pytest.raises(RuntimeError, match=r"'model.layers.3.attn' \(KV-cache group 1\) ran outside a forward context"):
        _layer()(*_qkv())


def test_missing_group_names_layer_and_group():
    meta = build_metadata(torch.tensor([3]), torch.tensor([3]), torch.tensor([[0, 1]]), 16, 3)
    with set_forward_context(ForwardContext({0: meta})):
        with pytest.raises(KeyError, match=r"'model.layers.3.attn' needs metadata for KV-cache group 1.*\[0\]"):
            _layer()(*_qkv())


def test_layer_without_cache_and_bad_shapes():
    layer = Attention(4, 2, 64, name="l0")
    with pytest.raises(RuntimeError, match="'l0' has no KV cache"):
        layer(*_qkv())
    layer.allocate_cache(2, 16)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"'l0': q has shape \(3, 2, 64\)"):
        layer(k, k, v)


@pytest.mark.parametrize("num_blocks,block_size,message", [
    (4, 8, r"block_size must be a power of two >= 16 \(paged attention's key tiles\), got 8"),
    (4, 24, "block_size must be a power of two >= 16"),
    (4, 16.0, "block_size must be a power of two >= 16"),
    (0, 16, "num_blocks must be an int >= 1, got 0"),
], ids=["block-8", "block-24", "float-block", "no-blocks"])
def test_allocate_cache_rejects_geometry_attention_cannot_run(num_blocks, block_size, message):
    """Rejected when the cache is made: at the first forward the step's K/V would already be stored."""
    layer = Attention(4, 2, 64, name="l0")
    with pytest.raises(ValueError, match=r"layer 'l0': " + message):
        layer.allocate_cache(num_blocks, block_size)


@pytest.mark.parametrize("kw,message", [
    (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(cache_format="turboquant_4bit_nc", head_dim=80), "head_dim=80"),
    (dict(cache_format="int3"), "unknown cache format"),
])
def test_constructor_validation(kw, message):
    args = dict(num_heads=4, num_kv_heads=2, head_dim=64, name="l0") | kw
    name = args.pop("name")
    with pytest.raises(ValueError, match=message):
        Attention(**args, name=name)


def test_build_metadata_matches_hand_computed_slots():
    block_table = torch.tensor([[3, 1, 0], [2, 5, 4]], dtype=torch.int32)
    # seq 0: 2 new tokens at positions 15, 16; seq 1: 3 new tokens at 0, 1, 2; then 2 padding tokens.
    meta = build_metadata(torch.tensor([2, 3]), torch.tensor([17, 3]), block_table, 16, num_tokens=7)
    assert meta.query_start_loc.tolist() == [0, 2, 5]
    assert meta.slot_mapping.tolist() == [3 * 16 + 15, 1 * 16 + 0, 2 * 16 + 0, 2 * 16 + 1, 2 * 16 + 2, -1, -1]
    out = AttentionMetadata(torch.zeros_like(block_table), torch.zeros(2, dtype=torch.int32),
                            torch.zeros(3, dtype=torch.int32), torch.zeros(7, dtype=torch.int64))
    ptr = out.slot_mapping.data_ptr()
    build_metadata(torch.tensor([2, 3]), torch.tensor([17, 3]), block_table, 16, 7, out=out)
    assert out.slot_mapping.data_ptr() == ptr and torch.equal(out.slot_mapping, meta.slot_mapping)


def _norm_rope_args(n=3, width=(4 + 2 * 2) * 64):
    freqs = 1.0 / 1e6 ** (torch.arange(0, 64, 2).float() / 64)
    return torch.randn(n, width), torch.ones(64), torch.ones(64), torch.arange(n), freqs, 1e-6


def test_forward_qkv_matches_forward_on_normed_rotated_inputs():
    # forward_qkv (norm, RoPE and store in one op) = qk_norm_rope, then forward, on one cache state each.
    from tqops.norm import qk_norm_rope

    meta = build_metadata(torch.tensor([3]), torch.tensor([3]), torch.tensor([[0, 1]]), 16, 3)
    qkv, q_weight, k_weight, positions, freqs, eps = _norm_rope_args()
    fused, split = _layer(), _layer()
    with set_forward_context(ForwardContext({1: meta})):
        out = fused.forward_qkv(qkv, q_weight, k_weight, positions, freqs, eps)
        q, k = qk_norm_rope(qkv, q_weight, k_weight, positions, freqs, 4, 2, eps)
        want = split(q, k, qkv[:, 6 * 64:].unflatten(-1, (2, 64)))
    assert torch.equal(out, want) and torch.equal(fused.kv_cache, split.kv_cache)


def test_forward_qkv_rejects_bad_shapes_before_writing():
    layer = _layer()
    before = layer.kv_cache.clone()
    qkv, q_weight, k_weight, positions, freqs, eps = _norm_rope_args(width=7 * 64)
    message = r"'model.layers.3.attn': qkv has shape \(3, 448\); expected \[num_tokens, 512\]"
    with pytest.raises(ValueError, match=message):
        layer.forward_qkv(qkv, q_weight, k_weight, positions, freqs, eps)
    qkv, q_weight, k_weight, positions, freqs, eps = _norm_rope_args()
    with pytest.raises(ValueError, match=r"inv_freq has shape \(16,\); expected \[32\]"):
        layer.forward_qkv(qkv, q_weight, k_weight, positions, freqs[:16], eps)
    meta = build_metadata(torch.tensor([2]), torch.tensor([2]), torch.tensor([[0, 1]]), 16, 2)
    with set_forward_context(ForwardContext({1: meta})):
        with pytest.raises(ValueError, match=r"3 tokens but group 1's slot_mapping has 2 entries"):
            layer.forward_qkv(qkv, q_weight, k_weight, positions, freqs, eps)
    assert torch.equal(layer.kv_cache, before)
