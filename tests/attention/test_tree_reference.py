"""The reference's tree mode (``paged_attention_naive(tree_mask=...)``): a chain is causal attention bit for bit,
and random trees over every format match a float64 oracle that lets each node see the context and its ancestors."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tqops
from tqops.attention.naive import paged_attention_naive
from tqops.kv.naive import kv_load_naive
from tqops.models.tree import ancestor_mask, tree_mask_bits

from .cases import make_case


def _random_parents(q_len: int, gen: torch.Generator) -> torch.Tensor:
    """A random tree of ``q_len`` nodes, each node's parent before it."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q_len)]
    return torch.tensor(parents)


def _run(case, tree_mask=None, causal=False):
    return paged_attention_naive(case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc,
                                 case.fmt, causal, None, None, 0.125, case.k_scale, case.v_scale, tree_mask=tree_mask)


def _oracle(case, parents_per_seq) -> torch.Tensor:
    """float64: node i of a sequence sees every key before the tree and the tree rows of its ancestors and itself."""
    num_tokens, num_q_heads, head_dim = case.query.shape
    block_size, num_kv_heads = case.cache.shape[1], case.cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64)
    starts = case.query_start_loc.tolist()
    for b, seq_len in enumerate(case.seq_lens.tolist()):
        j = torch.arange(seq_len)
        slots = case.block_table[b].long()[j // block_size] * block_size + j % block_size
        k, v = (t.double() for t in kv_load_naive(case.cache, slots, case.fmt, head_dim, case.k_scale, case.v_scale))
        q_len = starts[b + 1] - starts[b]
        seen = ancestor_mask(parents_per_seq[b][None])[0]  # [q_len, q_len]
        for i in range(q_len):
            vis = torch.cat([torch.ones(seq_len - q_len, dtype=torch.bool), seen[i]])
            for h in range(num_q_heads):
                q = case.query[starts[b] + i, h].double()
                s = (k[vis, h // group] @ q) * 0.125
                out[starts[b] + i, h] = torch.softmax(s, 0) @ v[vis, h // group]
    return out


@pytest.mark.parametrize("fmt", tqops.FORMATS)
def test_a_chain_is_causal_attention_bit_for_bit(fmt):
    case = make_case(fmt, q_lens=[5, 16, 1], seq_lens=[9, 40, 17], num_kv_heads=2, group=2, causal=False, seed=4)
    bits = torch.cat([tree_mask_bits(torch.arange(q)[None] - 1)[0] for q in (5, 16, 1)])
    assert torch.equal(_run(case, tree_mask=bits), _run(case, causal=True))


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(tqops.FORMATS), seed=st.integers(0, 2**31 - 1),
       q_lens=st.lists(st.integers(1, 64), min_size=1, max_size=3), context=st.integers(0, 30))
def test_random_trees_match_the_oracle(fmt, seed, q_lens, context):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + context for q in q_lens]
    case = make_case(fmt, q_lens=q_lens, seq_lens=seq_lens, num_kv_heads=1, group=2, causal=False, seed=seed % 1000)
    parents = [_random_parents(q, gen) for q in q_lens]
    bits = torch.cat([tree_mask_bits(p[None])[0] for p in parents])
    got = _run(case, tree_mask=bits)
    torch.testing.assert_close(got.double(), _oracle(case, parents), rtol=1e-4, atol=1e-4)
