"""Draft trees from one DFlash block pass (DDTree's best-first construction), their ancestor masks, and the greedy walk
that verifies a tree against the target's predictions at its nodes."""
from __future__ import annotations

import dataclasses
import heapq

import torch


@dataclasses.dataclass
class DraftTree:
    """``n`` trees of ``budget`` nodes each, node 0 the root (the pending token, depth 0), every other node's parent
    before it (so a walk from the root meets each node after its parent).

    ``tokens`` ``[n, budget]`` long; ``parents`` ``[n, budget]`` long (-1 at the root); ``depths`` ``[n, budget]``
    long (a node's RoPE position is the root's plus its depth)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor


def build_tree(pending: torch.Tensor, log_probs: torch.Tensor, budget: int) -> DraftTree:
    """The ``budget``-node tree of most probable draft prefixes per row: ``pending`` ``[n]`` at the root, and the
    block's per-position drafter distributions ``log_probs`` ``[n, D, V]`` (position d drafts depth d + 1). A path's
    score is the sum of its tokens' log-probabilities at their depths (the drafter's block positions are independent
    given the context), and the tree holds the ``budget - 1`` best-scoring paths: best-first from the root, each
    popped node adding its best child and its next sibling to the frontier, as DDTree builds it. The set is
    prefix-closed, since a prefix scores at least its extensions and a better-ranked sibling at least a worse one."""
    n, depth, vocab = log_probs.shape
    if budget < 1:
        raise ValueError(f"budget must be >= 1 (the root), got {budget}")
    k = min(vocab, budget - 1) or 1
    top_lp, top_tok = (t.tolist() for t in log_probs.float().topk(k, -1))  # [n, D, k], best first
    tokens = torch.zeros(n, budget, dtype=torch.long)
    parents = torch.full((n, budget), -1, dtype=torch.long)
    depths = torch.zeros(n, budget, dtype=torch.long)
    tokens[:, 0] = pending.cpu()
    for row in range(n):
        lp, tok = top_lp[row], top_tok[row]
        # frontier entries: (-score, tie order, parent node, depth of the candidate, rank among its siblings)
        frontier, order = [], 0
        if depth:
            frontier.append((-lp[0][0], order, 0, 1, 0))
        for node in range(1, budget):
            if not frontier:
                break
            neg, _, parent, d, rank = heapq.heappop(frontier)
            tokens[row, node], parents[row, node], depths[row, node] = tok[d - 1][rank], parent, d
            base = -neg - lp[d - 1][rank]  # the parent's score
            if rank + 1 < k:  # the next sibling
                order += 1
                heapq.heappush(frontier, (-(base + lp[d - 1][rank + 1]), order, parent, d, rank + 1))
            if d < depth:  # the best child
                order += 1
                heapq.heappush(frontier, (-(-neg + lp[d][0]), order, node, d + 1, 0))
        else:
            continue
        # fewer paths than the budget (a tiny vocabulary or block): the rest are padding, the root's token with
        # no parent, so no walk reaches them
        tokens[row, node:] = tokens[row, 0]
    device = log_probs.device
    return DraftTree(tokens.to(device), parents.to(device), depths.to(device))


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """``parents`` ``[n, N]`` (-1: none) -> ``[n, N, N]`` bool, ``[b, i, j]`` true where node j is node i or one of
    its ancestors: what node i's query may attend to among the tree's own rows (it sees the whole context too)."""
    n, size = parents.shape
    mask = torch.eye(size, dtype=torch.bool, device=parents.device).expand(n, size, size).clone()
    rows = torch.arange(n, device=parents.device)[:, None]
    up = parents.clone()
    for _ in range(size - 1):  # at most N - 1 steps up to the root
        live = up >= 0
        if not bool(live.any()):
            break
        b, i = live.nonzero(as_tuple=True)
        mask[b, i, up[b, i]] = True
        up = torch.where(live, parents[rows, up.clamp(min=0)], -1)
    return mask


def tree_mask_bits(parents: torch.Tensor) -> torch.Tensor:
    """``parents`` ``[n, N]`` (N <= 64) -> ``[n, N]`` int64: bit j of node i set where node j is node i or one of its
    ancestors (``ancestor_mask`` packed), the per-query mask ``paged_attention_naive``'s ``tree_mask`` reads."""
    n, size = parents.shape
    if size > 64:
        raise ValueError(f"a tree of {size} nodes does not fit a 64-bit mask; expected at most 64")
    weights = torch.ones(size, dtype=torch.long, device=parents.device) << torch.arange(size, device=parents.device)
    return (ancestor_mask(parents).long() * weights).sum(-1)


def greedy_walk(tree: DraftTree, predicted: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """The target's greedy verification of ``tree``: ``predicted`` ``[n, N]`` is the target's argmax at each node
    (the token after that node's path). From the root, step to the child whose token is the prediction at the
    current node while there is one. -> (each row's accepted path, node indices from the root, and the bonus token
    ``[n]``: the prediction at the path's last node)."""
    parents, tokens, pred = (t.tolist() for t in (tree.parents, tree.tokens, predicted))
    paths, bonus = [], []
    for row in range(len(parents)):
        children: dict[int, dict[int, int]] = {}
        for node in range(1, len(parents[row])):
            if parents[row][node] >= 0:
                children.setdefault(parents[row][node], {}).setdefault(tokens[row][node], node)
        path = [0]
        while (nxt := children.get(path[-1], {}).get(pred[row][path[-1]])) is not None:
            path.append(nxt)
        paths.append(path)
        bonus.append(pred[row][path[-1]])
    return paths, torch.tensor(bonus, dtype=torch.long, device=predicted.device)
