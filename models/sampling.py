"""Token choice and draft verification: greedy, plain sampling, and speculative rejection sampling; top-k and top-p
filter the target's and the drafter's distributions alike."""
from __future__ import annotations

from typing import Optional

import torch


def sample(probs: torch.Tensor, gen: Optional[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` ``[n, V]``."""
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits [..., V]`` -> the distribution sampling draws from, float32 ``[..., V]``: softmax at ``temperature``
    (> 0) over the ``top_k`` largest logits (0: all; ties with the k-th kept), then over the smallest set of most
    likely tokens whose probability reaches ``top_p`` (1: all), renormalised. transformers' order and rules
    (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``) and vLLM's."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p < 1:
        ranked, order = probs.sort(-1, descending=True)
        # a token stays if the tokens ranked above it hold less than top_p: the most likely one always does
        drop = (ranked.cumsum(-1) - ranked) >= top_p
        probs = probs.masked_fill(drop.scatter(-1, order, drop), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def pick(logits: torch.Tensor, temperature: float, gen: Optional[torch.Generator], top_k: int = 0,
         top_p: float = 1.0) -> torch.Tensor:
    """The next token of each row of ``logits`` ``[n, V]``: argmax at temperature 0, else a sample of
    ``sampling_probs``."""
    if temperature == 0:
        return logits.argmax(-1)
    return sample(sampling_probs(logits, temperature, top_k, top_p), gen)


def rejection_sample(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, gen=None,
                     candidates: Optional[torch.Tensor] = None):
    """Speculative sampling: drafts ``[n, k]`` from q ``[n, k, V]``, target probs p ``[n, k + 1, V]``.

    Accepts draft i with probability min(1, p/q), resamples the first rejected position from
    normalize(max(0, p - q)) (a bonus from p after all k accepted). Returns (accepted ``[n]``, next token ``[n]``);
    the output follows p exactly.

    ``candidates`` ``[n, k, K]`` (a DFlash2 selector's walk): q ``[n, k, K]`` is then each position's distribution
    over its K candidate tokens, as the walk sampled it (each position's given the drafts before it), and is
    scattered to the vocabulary first: q(x) is the walk's probability of x at that position, 0 for a token outside
    the candidates, so min(1, p/q) and max(0, p - q) run over the full vocabulary and the output is exact as well.
    """
    if candidates is not None:
        q = torch.zeros(p.shape[0], drafts.shape[1], p.shape[-1], dtype=q.dtype, device=q.device).scatter_add_(
            -1, candidates, q)
    n, k = drafts.shape
    p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_d = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(n, k, generator=gen, device=p.device)
    accepted = (u * q_d < p_d).int().cumprod(1).sum(1)
    rows = torch.arange(n, device=p.device)
    p_a = p[rows, accepted]
    q_a = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, accepted]
    resid = (p_a - q_a).clamp_min(0)
    total = resid.sum(-1, keepdim=True)
    resid = torch.where(total > 0, resid / total.clamp_min(1e-30), p_a)
    return accepted, sample(resid, gen)


def verify(logits: torch.Tensor, drafts: Optional[torch.Tensor], q: Optional[torch.Tensor], temperature: float,
           gen, candidates: Optional[torch.Tensor] = None, top_k: int = 0,
           top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits ``[n, bs, V]`` of blocks ``[last, drafts...]`` -> (accepted drafts ``[n]``, next token ``[n]``);
    q and ``candidates`` as ``rejection_sample`` takes them. At temperature > 0 the output follows the target's
    ``sampling_probs`` (top-k and top-p applied) exactly, whatever distribution q the drafts came from."""
    n = logits.shape[0]
    if temperature == 0:
        post = logits.argmax(-1)
        accepted = (drafts == post[:, :-1]).int().cumprod(1).sum(1) if drafts is not None else post[:, 0] * 0
        return accepted, post[torch.arange(n, device=logits.device), accepted]
    p = sampling_probs(logits, temperature, top_k, top_p)
    if drafts is None:
        return torch.zeros(n, dtype=torch.long, device=logits.device), sample(p[:, 0], gen)
    return rejection_sample(drafts, p, q, gen, candidates)


def draft_tokens(logits: torch.Tensor, temperature: float, gen, top_k: int = 0,
                 top_p: float = 1.0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Drafter logits ``[n, k, V]`` -> (drafts ``[n, k]``, their probabilities ``[n, k, V]``, None when greedy):
    the target's filters applied to the drafter's distribution, so it proposes only tokens the target can emit."""
    if temperature == 0:
        return logits.argmax(-1), None
    q = sampling_probs(logits, temperature, top_k, top_p)
    return sample(q.flatten(0, 1), gen).view(q.shape[:2]), q


def choose_drafts(proposal, temperature: float, gen, top_k: int = 0, top_p: float = 1.0):
    """A drafter step's ``propose`` output -> (drafts ``[n, k]``, q, candidates) for ``verify``: from draft logits
    ``[n, k, V]`` (DFlash v1) the drafts are picked here (``draft_tokens``; candidates None); a DFlash2
    ``SelectedDrafts`` already holds them, with q over its candidates (its walk inside the captured step samples
    its own candidate scores, unfiltered: q is exact for it, so verification stays exact)."""
    if isinstance(proposal, torch.Tensor):
        return (*draft_tokens(proposal, temperature, gen, top_k, top_p), None)
    return proposal.tokens, proposal.q, proposal.candidates


def accept_block(tokens: list, block: list, accepted: int, bonus: int, max_new_tokens: int, eos) -> tuple[int, bool]:
    """Append one verified block's output to a row's ``tokens``: its accepted drafts (``block[1:1 + accepted]``,
    ``block[0]`` being the pending token) and the bonus token, at most up to ``max_new_tokens`` and through the first
    token in ``eos``. Returns (tokens added, whether the row is finished)."""
    new = (block[1:1 + accepted] + [bonus])[:max_new_tokens - len(tokens)]
    stop = next((j for j, t in enumerate(new) if t in eos), None)
    if stop is not None:
        new = new[:stop + 1]
    tokens += new
    return len(new), stop is not None or len(tokens) >= max_new_tokens
