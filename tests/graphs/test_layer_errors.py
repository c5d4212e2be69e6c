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


# ---- bad q/k/v: rejected before the store, so the cache is unchanged ----------------------------------------------

def _meta(n=2):
    return build_metadata(torch.tensor([n]), torch.tensor([n]), torch.tensor([[0, 1]]), 16, n)


def _rejected_before_the_store(call, error, match):
    layer = _layer()
    layer.kv_cache.zero_()
    before = layer.kv_cache.clone()
    with set_forward_context(ForwardContext({1: _meta()})), pytest.raises(error, match=match):
        call(layer)
    assert torch.equal(layer.kv_cache, before)


def _on(device, t):
    return torch.empty_like(t, device=device)


BAD_QKV = {
    "q-float64": (lambda q, k, v: (q.double(), k, v), TypeError, r"'model.layers.3.attn': q has dtype float64"),
    "k-float64": (lambda q, k, v: (q, k.double(), v), TypeError, r"'model.layers.3.attn': k has dtype float64"),
    "q-int32": (lambda q, k, v: (q.int(), k, v), TypeError, "q has dtype int32"),
    "q-3-tokens": (lambda q, k, v: (torch.randn(3, 4, 64), k, v), ValueError,
                   r"'model.layers.3.attn': q 3, k 2, v 2 must have one token count"),
    "v-3-tokens": (lambda q, k, v: (q, k, torch.randn(3, 2, 64)), ValueError, r"q 2, k 2, v 3 must have one token count"),
    "q-on-meta": (lambda q, k, v: (_on("meta", q), k, v), ValueError,
                  r"'model.layers.3.attn': q is on the meta device \(no data\)"),
    "k-on-meta": (lambda q, k, v: (q, _on("meta", k), v), ValueError, "k is on the meta device"),
    "all-on-meta": (lambda q, k, v: (_on("meta", q), _on("meta", k), _on("meta", v)), ValueError,
                    "q is on the meta device"),
}


@pytest.mark.parametrize("case", list(BAD_QKV))
def test_forward_rejects_bad_qkv_before_storing(case):
    change, error, match = BAD_QKV[case]
    q, k, v = change(*_qkv(2))
    _rejected_before_the_store(lambda layer: layer(q, k, v), error, match)


def test_cache_on_the_meta_device_is_rejected():
    layer = Attention(4, 2, 64, name="l0")
    layer.allocate_cache(2, 16, device="meta")
    with set_forward_context(ForwardContext({0: _meta()})), pytest.raises(
            ValueError, match=r"'l0': kv_cache is on the meta device \(no data\)"):
        layer(*_qkv(2))


BAD_CONTEXT_KV = {
    "k-float64": (lambda k, v: (k.double(), v), TypeError, "k has dtype float64"),
    "v-3-tokens": (lambda k, v: (k, torch.randn(3, 2, 64)), ValueError, "k 2, v 3 must have one token count"),
    "v-on-meta": (lambda k, v: (k, _on("meta", v)), ValueError, "v is on the meta device"),
}


@pytest.mark.parametrize("case", list(BAD_CONTEXT_KV))
def test_store_context_rejects_bad_kv_before_storing(case):
    change, error, match = BAD_CONTEXT_KV[case]
    _, k, v = _qkv(2)
    k, v = change(k, v)
    layer = _layer()
    layer.kv_cache.zero_()
    meta = _meta()
    meta.context_slot_mapping = torch.tensor([0, 1])
    context = ForwardContext({1: meta}, context_positions=torch.tensor([0, 1]))
    with set_forward_context(context), pytest.raises(error, match=match):
        layer.store_context(k, v)
    assert not layer.kv_cache.any()


BAD_FUSED = {
    "qkv-on-meta": (0, lambda t: _on("meta", t), ValueError, "qkv is on the meta device"),
    "positions-on-meta": (3, lambda t: _on("meta", t), ValueError, "positions is on the meta device"),
    "inv_freq-on-meta": (4, lambda t: _on("meta", t), ValueError, "inv_freq is on the meta device"),
    "qkv-float64": (0, lambda t: t.double(), TypeError, "qkv has dtype float64"),
}


@pytest.mark.parametrize("case", list(BAD_FUSED))
def test_forward_qkv_rejects_bad_inputs_before_storing(case):
    index, change, error, match = BAD_FUSED[case]
    args = list(_norm_rope_args(2))
    args[index] = change(args[index])
    _rejected_before_the_store(lambda layer: layer.forward_qkv(*args), error, match)


def test_store_context_needs_context_positions():
    """Without them the context rows' slots cannot be checked against the block table: a clear error, no write."""
    layer = _layer()
    layer.kv_cache.zero_()
    meta = _meta()
    meta.context_slot_mapping = torch.tensor([16, 17])  # sequence 0's rows in block 1: the table gives slots 0, 1
    _, k, v = _qkv(2)
    with set_forward_context(ForwardContext({1: meta})), pytest.raises(
            ValueError, match=r"'model.layers.3.attn' stores DFlash context rows, but the forward context has no "
                              r"context_positions"):
        layer.store_context(k, v)
    assert not layer.kv_cache.any()


# ---- constructor, ForwardContext and build_metadata arguments -------------------------------------------------------

@pytest.mark.parametrize("kw,error,message", [
    (dict(sliding_window=True), ValueError, "sliding_window must be a positive int or None, got True"),
    (dict(head_dim=64.0), TypeError, "head_dim must be an int, got float 64.0"),
    (dict(num_heads=4.0), TypeError, "num_heads must be an int, got float 4.0"),
    (dict(num_kv_heads=True), TypeError, "num_kv_heads must be an int, got bool True"),
    (dict(group="a"), TypeError, r"group must be a KV-cache group id \(an int >= 0\), got str 'a'"),
    (dict(group=-1), ValueError, r"group must be a KV-cache group id \(an int >= 0\), got -1"),
    (dict(group=1.0), TypeError, "group must be a KV-cache group id"),
], ids=["window-true", "float-head-dim", "float-heads", "bool-kv-heads", "str-group", "negative-group",
        "float-group"])
def test_constructor_names_the_argument(kw, error, message):
    args = dict(num_heads=4, num_kv_heads=2, head_dim=64) | kw
    with pytest.raises(error, match=r"layer 'l0': " + message):
        Attention(**args, name="l0")


@pytest.mark.parametrize("kwargs,message", [
    (dict(attn_metadata=[None]), r"attn_metadata must be a dict of KV-cache group id -> AttentionMetadata, got list"),
    (dict(attn_metadata={0: "x"}), r"attn_metadata\[0\] must be an AttentionMetadata, got str"),
    (dict(attn_metadata={"0": None}), r"attn_metadata has key '0'; expected int KV-cache group ids"),
    (dict(attn_metadata={}, context_states=[1.0]), "context_states must be a torch.Tensor or None, got list"),
    (dict(attn_metadata={}, context_positions=3), "context_positions must be a torch.Tensor or None, got int"),
    (dict(attn_metadata={}, state_metadata={}), "state_metadata must be a StateMetadata or None, got dict"),
], ids=["metadata-list", "metadata-str", "str-group", "states-list", "positions-int", "state-metadata-dict"])
def test_forward_context_names_the_field(kwargs, message):
    with pytest.raises(TypeError, match="ForwardContext: " + message):
        ForwardContext(**kwargs)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(block_size=0), ValueError, "build_metadata: block_size must be an int >= 1, got 0"),
    (dict(block_size=16.0), ValueError, "build_metadata: block_size must be an int >= 1, got 16.0"),
    (dict(num_tokens=-1), ValueError, "build_metadata: num_tokens must be an int >= 0, got -1"),
], ids=["block-size-0", "float-block-size", "negative-tokens"])
def test_build_metadata_names_the_argument(kwargs, error, message):
    args = dict(query_lens=torch.tensor([2]), seq_lens=torch.tensor([2]), block_table=torch.tensor([[0]]),
                block_size=16, num_tokens=2) | kwargs
    with pytest.raises(error, match=message):
        build_metadata(**args)


def test_a_device_that_is_not_here_is_named():
    from tqops.graphs import GatedDeltaNetState

    with pytest.raises(ValueError, match=r"layer 'l0': device='cuda:99', but (this torch has no CUDA|only)"):
        Attention(4, 2, 64, name="l0").allocate_cache(2, 16, device="cuda:99")
    with pytest.raises(ValueError, match=r"layer 'g0': device='cuda:99', but (this torch has no CUDA|only)"):
        GatedDeltaNetState(1, 2, 32, 32, 4, name="g0").allocate_state(1, 4, device="cuda:99")
