"""The paged DFlash drafter inside generate() matches a dense re-computation of every draft step from scratch."""
import pytest
import torch

from tqops.graphs import ForwardContext, build_metadata, get_forward_context, set_forward_context
from tqops.models import DFlashDrafter, Qwen3ForCausalLM, generate

from .fixtures import write_drafter, write_target

VOCAB, WINDOW = 16, 4
PROMPTS = [[3, 9, 1, 14, 7, 2, 11], [5, 8], [12, 4, 6, 0, 13]]


def _rope(x, pos, theta):  # x [n, h, d], HF rotate-half
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def dense_drafter(drafter, ctx_states, block_ids, start):
    """DFlash from scratch: context rows [0, start) and the block at [start, start + bs), one attention per layer."""
    cfg, bs, L = drafter.config, block_ids.shape[0], ctx_states.shape[0]
    assert L == start
    ctx = drafter.hidden_norm(drafter.fc(ctx_states))
    x = drafter.embed_tokens(block_ids) * drafter.input_embedding_scale
    q_pos, k_pos = torch.arange(start, start + bs), torch.arange(start + bs)
    for layer in drafter.layers:
        a, attn = layer.self_attn, layer.self_attn.attn
        h = layer.input_layernorm(x)
        kv_in = torch.cat([ctx, h])
        wq, wk, wv = a.qkv_proj.weight.split(a.qkv_proj.sizes)
        q = _rope(a.q_norm((h @ wq.T).view(bs, a.num_heads, -1)), q_pos, cfg.rope_theta)
        k = _rope(a.k_norm((kv_in @ wk.T).view(L + bs, a.num_kv_heads, -1)), k_pos, cfg.rope_theta)
        v = (kv_in @ wv.T).view(L + bs, a.num_kv_heads, -1)
        rep = a.num_heads // a.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        rel = q_pos[:, None] - k_pos[None, :]
        visible = rel >= 0 if attn.causal else torch.ones_like(rel, dtype=torch.bool)
        if attn.sliding_window is not None:
            visible &= (rel < attn.sliding_window) & (-rel < attn.sliding_window)
        s = torch.einsum("qhd,khd->hqk", q, k) * attn.scale
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
        x = x + a.o_proj(torch.einsum("hqk,khd->qhd", p, v).flatten(1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    target = Qwen3ForCausalLM.from_pretrained(write_target(root / "t", vocab=VOCAB, num_layers=2, seed=21),
                                              cache_format="fp16", dtype=torch.float32)
    path = write_drafter(root / "d", vocab=VOCAB, target_layer_ids=(1, 0), block_size=4, seed=22,
                         layer_types=["full_attention", "sliding_attention"], sliding_window=WINDOW,
                         input_embedding_scale=1.5, dflash_extra={"output_multiplier": 0.8})
    return target, DFlashDrafter.from_pretrained(path, target=target, cache_format="fp16")


def _target_states(target, seq, layer_ids):
    """Target states of ``seq``'s tokens (one paged prefill): [len(seq), len(layer_ids) * hidden]."""
    n = torch.tensor([len(seq)], dtype=torch.int32)
    table = torch.arange(-(-len(seq) // 16), dtype=torch.int32)[None]
    target.allocate_cache(table.shape[1], 16)
    meta = build_metadata(n, n, table, 16, len(seq))
    with set_forward_context(ForwardContext({0: meta, 1: meta})):
        return target(torch.tensor(seq), torch.arange(len(seq)), layer_ids=layer_ids)[1]


@torch.no_grad()
def test_drafter_steps_match_dense_reference(models):
    target, drafter = models
    calls = []

    def record(module, args, output):
        meta = get_forward_context().attn_metadata[0]
        calls.append((args[0].clone(), args[1].clone(), meta.block_table.clone(), output.clone()))

    handle = drafter.register_forward_hook(record)
    try:
        result = generate(target, PROMPTS, 14, drafter=drafter, temperature=1.0, seed=3)
    finally:
        handle.remove()
    lengths = sum(result.acceptance_lengths, [])
    assert len(set(lengths)) > 1, "want steps with different acceptance counts (different context row counts)"

    per_seq = None
    checked = 0
    full = [p + t for p, t in zip(PROMPTS, result.tokens)]
    states = [_target_states(target, s, drafter.target_layer_ids) for s in full]
    for ids, pos, table, hidden in calls:
        per_seq = table.shape[1]
        bs = drafter.block_size
        for row, seq_id in enumerate((table[:, 0] // per_seq).tolist()):
            block, start = ids[row * bs:(row + 1) * bs], int(pos[row * bs])
            assert torch.equal(pos[row * bs:(row + 1) * bs], torch.arange(start, start + bs))
            assert block[0] == full[seq_id][start] and (block[1:] == drafter.mask_token_id).all()
            want = dense_drafter(drafter, states[seq_id][:start], block, start)
            got = hidden[row * bs:(row + 1) * bs]
            torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)
            torch.testing.assert_close(drafter.compute_logits(got), 0.8 * target.compute_logits(got))
            checked += 1
    assert checked == len(lengths)
