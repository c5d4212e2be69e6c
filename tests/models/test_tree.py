"""Draft trees: best-first construction against brute force over every prefix, the ancestor mask against its
definition, and the greedy walk along a planted path."""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqops.models.tree import DraftTree, ancestor_mask, build_tree, greedy_walk, tree_mask_bits


def _paths(tree: DraftTree, row: int) -> dict[tuple, int]:
    """{token path from below the root: node} of one row's real nodes."""
    parents, tokens = tree.parents[row].tolist(), tree.tokens[row].tolist()
    paths = {(): 0}
    for node in range(1, len(parents)):
        if parents[node] < 0:
            continue
        parent_path = next(p for p, i in paths.items() if i == parents[node])
        paths[parent_path + (tokens[node],)] = node
    return paths


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 3), depth=st.integers(1, 4), vocab=st.integers(2, 5),
       budget=st.integers(1, 40))
def test_tree_is_the_best_scoring_prefixes(seed, rows, depth, vocab, budget):
    gen = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(torch.randn(rows, depth, vocab, generator=gen) * 2, -1)
    pending = torch.randint(0, vocab, (rows,), generator=gen)
    tree = build_tree(pending, log_probs, budget)
    assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == (rows, budget)
    assert torch.equal(tree.tokens[:, 0], pending) and (tree.parents[:, 0] == -1).all()
    for row in range(rows):
        everything = [p for d in range(1, depth + 1) for p in itertools.product(range(vocab), repeat=d)]
        score = {p: sum(log_probs[row, d, t].item() for d, t in enumerate(p)) for p in everything}
        best = sorted(everything, key=lambda p: -score[p])[:budget - 1]
        paths = _paths(tree, row)
        assert set(paths) - {()} == set(best)
        for path, node in paths.items():  # parents come first, depths count from the root
            assert tree.depths[row, node] == len(path)
            if path:
                assert tree.parents[row, node] == paths[path[:-1]] < node
        padding = tree.parents[row, len(paths):]
        assert (padding == -1).all() and (tree.parents[row, 1:len(paths)] >= 0).all()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), budget=st.integers(1, 64))
def test_ancestor_mask_is_each_nodes_path_to_the_root(seed, budget):
    gen = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.zeros(2, dtype=torch.long), torch.log_softmax(torch.randn(2, 6, 9, generator=gen), -1),
                      budget)
    mask = ancestor_mask(tree.parents)
    for row in range(2):
        for node in range(budget):
            seen, up = {node}, tree.parents[row, node].item()
            while up >= 0:
                seen.add(up)
                up = tree.parents[row, up].item()
            assert set(mask[row, node].nonzero().flatten().tolist()) == seen


def test_greedy_walk_follows_the_planted_path_and_stops_where_no_child_matches():
    gen = torch.Generator().manual_seed(3)
    tree = build_tree(torch.tensor([7, 1]), torch.log_softmax(torch.randn(2, 5, 6, generator=gen), -1), 24)
    predicted = torch.full((2, 24), 5, dtype=torch.long)
    wanted = []
    for row, target in ((0, 19), (1, 0)):
        path = [target]
        while path[0] != 0:
            path.insert(0, tree.parents[row, path[0]].item())
        for a, b in zip(path, path[1:]):
            predicted[row, a] = tree.tokens[row, b]
        # at the path's end, a token none of its children carries
        taken = {tree.tokens[row, c].item() for c in range(24) if tree.parents[row, c] == path[-1]}
        predicted[row, path[-1]] = next(t for t in range(7) if t not in taken)
        wanted.append(path)
    paths, bonus = greedy_walk(tree, predicted)
    assert paths == wanted
    assert bonus.tolist() == [predicted[r, p[-1]].item() for r, p in enumerate(wanted)]


def test_budget_must_hold_the_root():
    with pytest.raises(ValueError, match="budget must be >= 1"):
        build_tree(torch.zeros(1, dtype=torch.long), torch.zeros(1, 2, 3), 0)


def test_mask_bits_pack_the_ancestor_mask_and_stop_at_64_nodes():
    parents = torch.tensor([[-1, 0, 1, 0, 3], [-1, 0, 0, 0, 0]])
    assert tree_mask_bits(parents).tolist() == [[1, 3, 7, 9, 25], [1, 3, 5, 9, 17]]
    chain = torch.arange(64)[None] - 1
    assert tree_mask_bits(chain)[0, -1] == -1  # all 64 bits set: the sign bit too
    with pytest.raises(ValueError, match="does not fit a 64-bit mask"):
        tree_mask_bits(torch.arange(65)[None] - 1)
