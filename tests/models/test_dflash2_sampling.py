"""DFlash2 at temperature > 0: tqops' loop and z-lab's ``dflash_generate`` sample the same distributions.

On one tiny checkpoint pair (a transformers Qwen3 over 12 tokens, a DFlash2 drafter of block 4 walking 6 candidates
written by z-lab's class), ``N_TQOPS`` generations from ``tqops.models.generate`` (one batch, seeded) and ``N_ZLAB``
from ``dflash_generate`` (one call each, the global generator seeded), all at temperature 1 after one prompt, give:

- the first ``MARGINALS`` tokens: each position's counts against the target's own sampling distribution of that
  token, computed exactly (one forward over every continuation; speculative sampling keeps it, whatever the drafts),
  for both samplers, and the two samplers' counts against each other;
- the tokens the first speculative step produces (1 to ``BS``): this one depends on the drafter, through the walk's
  q over its candidates and its verification. Its exact distribution follows from z-lab's own ``propose`` driven
  down every candidate path (its ``_sample_probs`` replaced by the path's indices): ``P(first j drafts accepted) =
  sum over paths of prod_i min(q_i, p_i)``. Both samplers are tested against it and against each other, and it is
  far from what a walk without its pair term would give, so the test tells the selector's scores apart.

Each comparison is a Pearson chi-square test (cells expecting < 5 pooled) that must not reject at p = 1e-3; the 15 of
them together would reject a correct pair with probability at most 1.5 %, and the seeds are fixed, so a run is
deterministic. z-lab's rejection rule (q gathered from its candidates, the residual ``p - q`` scattered back) is also
checked against ``rejection_sample(..., candidates=)`` draw for draw: the same generator state, the same outcome.

The comparisons need z-lab's package (``pip install --no-deps dflash==0.1.0``, see tests/models/test_dflash2.py)
and skip without it.
"""
from __future__ import annotations

import copy
import time

import pytest
import torch

from tqops.models import DFlash2Drafter, DFlashDrafter, Qwen3ForCausalLM, generate, rejection_sample
from tqops.models.dflash2 import CandidateSelector

from .fixtures import randomize_dflash2
from .test_dflash2 import INSTALL
from .test_sampling import _chi2_pvalue

VOCAB, BS, TOP_K, TEMPERATURE = 12, 4, 6, 1.0
PROMPT = [3, 9, 1, 2, 7]
NEW_TOKENS = 1 + BS  # the prefill's token and a whole first block, so the first step's count is never capped
MARGINALS = 4  # new tokens whose distributions are compared
N_TQOPS, N_ZLAB, SEED = 1000, 400, 0
ALPHA = 1e-3


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """One intra-op thread: the tensors are tiny, and two spinning OpenMP threads on a shared 2-core machine made
    these loops several times slower (as tests/hf/conftest.py says for its package)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def zlab():
    pytest.importorskip("transformers")
    return pytest.importorskip("dflash.model", reason=INSTALL)


@pytest.fixture(scope="module")
def models(zlab, tmp_path_factory):
    """(transformers target, z-lab DFlash2 drafter, tqops target, tqops drafter) from the same saved weights."""
    import transformers

    root = tmp_path_factory.mktemp("dflash2_sampling")
    torch.manual_seed(0)
    hf_target = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, initializer_range=0.1)).eval()
    hf_target.save_pretrained(root / "t")
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, architectures=["DFlash2DraftModel"], num_target_layers=2,
        dflash_config={"target_layer_ids": [0, 1], "mask_token_id": VOCAB - 1, "block_size": BS,
                       "conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": TOP_K})
    z_drafter = zlab.DFlash2DraftModel(cfg)
    randomize_dflash2(z_drafter, 3)
    z_drafter.save_pretrained(root / "d")
    # the fp16 cache rounds K/V, which moves the target's probabilities by ~1e-3: far below what these counts resolve
    target = Qwen3ForCausalLM.from_pretrained(root / "t", cache_format="fp16", dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(root / "d", target=target, cache_format="fp16")
    assert isinstance(drafter, DFlash2Drafter)
    return hf_target, z_drafter.eval(), target, drafter


@pytest.fixture(scope="module")
def samples(zlab, models):
    """{"tqops" | "zlab": (new tokens ``[n, NEW_TOKENS]``, tokens the first speculative step produced ``[n]``)}."""
    hf_target, z_drafter, target, drafter = models
    result = generate(target, [PROMPT] * N_TQOPS, NEW_TOKENS, drafter=drafter, temperature=TEMPERATURE, seed=SEED)
    out = {"tqops": (torch.tensor(result.tokens), torch.tensor([a[0] for a in result.acceptance_lengths]))}
    tokens, firsts = [], []
    with torch.random.fork_rng(), pytest.MonkeyPatch.context() as m:
        m.setattr(zlab, "_cuda_time", time.perf_counter)  # return_stats times with torch.cuda.synchronize
        torch.manual_seed(SEED)  # dflash_generate draws from the global generator
        for _ in range(N_ZLAB):
            run = zlab.dflash_generate(z_drafter, hf_target, torch.tensor([PROMPT]), NEW_TOKENS, None,
                                       temperature=TEMPERATURE, return_stats=True)
            tokens.append(run.output_ids[0, len(PROMPT):].tolist())
            firsts.append(run.acceptance_lengths[0])
    out["zlab"] = (torch.tensor(tokens), torch.tensor(firsts))
    assert all(t.shape == (n, NEW_TOKENS) for n, (t, _) in zip((N_TQOPS, N_ZLAB), out.values()))
    return out


def _two_sample_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson chi-square test of homogeneity: counts ``a`` and ``b`` ``[C]`` drawn from one distribution (cells
    where the smaller sample expects < 5 pooled)."""
    a, b = a.double(), b.double()
    small = (a + b) * min(a.sum(), b.sum()) / (a.sum() + b.sum()) < 5
    table = torch.stack([torch.cat([x[~small], x[small].sum().view(1)]) for x in (a, b)])
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def _probs(hf_target, sequences: torch.Tensor, start: int) -> torch.Tensor:
    """The target's sampling distributions ``[rows, len - start, V]`` float64 after each prefix of ``sequences``
    ``[rows, len]`` that is at least ``start`` tokens long."""
    logits = hf_target(sequences).logits[:, start - 1:].double()
    return torch.softmax(logits / TEMPERATURE, -1)


@torch.no_grad()
def _token_marginals(hf_target, n: int) -> torch.Tensor:
    """``[n, V]``: the exact distribution of each of the first ``n`` new tokens when the target samples after PROMPT,
    from one forward over all ``V ** (n - 1)`` continuations (a prefix of ``i`` tokens is shared by ``V ** (n - 1 -
    i)`` of them)."""
    grid = torch.meshgrid(*[torch.arange(VOCAB)] * (n - 1), indexing="ij")
    continuations = torch.stack(grid, -1).view(-1, n - 1)
    rows = len(continuations)
    probs = _probs(hf_target, torch.cat([torch.tensor(PROMPT).expand(rows, -1), continuations], 1), len(PROMPT))
    chosen = probs[:, :-1].gather(-1, continuations[..., None])[..., 0]  # [rows, n - 1]
    reach = torch.cat([torch.ones(rows, 1, dtype=chosen.dtype), chosen.cumprod(1)], 1)  # P(the row's prefix)
    return torch.stack([(reach[:, i, None] * probs[:, i]).sum(0) / VOCAB ** (n - 1 - i) for i in range(n)])


def _forced(indices: torch.Tensor):
    """A stand-in for z-lab's ``_sample_probs``: its ``j``-th call returns column ``j`` of ``indices`` ``[rows, k]``."""
    columns = iter(indices.unbind(1))
    return lambda q: next(columns)


@torch.no_grad()
def _first_step_counts(zlab, z_drafter, hf_target) -> torch.Tensor:
    """``[BS]``: the exact distribution of the tokens the first speculative step produces (1 to BS), z-lab's drafter
    walking after PROMPT and the target's first token.

    For every first token ``a`` the drafter's block states come from one pass after the prompt's context; its
    ``propose`` runs down all ``TOP_K ** (BS - 1)`` candidate paths at once (each draw forced to the path's index),
    returning the drafts and q; one target forward gives p at each draft. A draft is drawn and accepted with
    probability ``min(q, p)``, so ``P(the first j accepted | a)`` sums ``prod_{i <= j} min(q_i, p_i)`` over the
    distinct paths of length j."""
    k, n = BS - 1, len(PROMPT)
    out = hf_target(torch.tensor([PROMPT]), output_hidden_states=True)
    p_first = torch.softmax(out.logits[0, -1].double() / TEMPERATURE, -1)  # [V]
    context = zlab.extract_context_feature(out.hidden_states, z_drafter.target_layer_ids)  # [1, n, C]
    block = torch.full((VOCAB, BS), z_drafter.mask_token_id)
    block[:, 0] = torch.arange(VOCAB)
    hidden = z_drafter(position_ids=torch.arange(n + BS).expand(VOCAB, -1),
                       target_hidden=context.expand(VOCAB, -1, -1),
                       noise_embedding=hf_target.get_input_embeddings()(block))[:, 1:]  # [V, k, H]
    paths = torch.stack(torch.meshgrid(*[torch.arange(TOP_K)] * k, indexing="ij"), -1).view(-1, k)
    anchors = torch.arange(VOCAB).repeat_interleave(len(paths))
    indices = paths.repeat(VOCAB, 1)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(zlab, "_sample_probs", _forced(indices))
        drafts, _, q = z_drafter.propose(hidden[anchors], anchors, hf_target.lm_head, TEMPERATURE)
    q = q.double().gather(-1, indices[..., None])[..., 0]  # [rows, k]
    sequences = torch.cat([torch.tensor(PROMPT).expand(len(anchors), -1), anchors[:, None], drafts], 1)
    p = _probs(hf_target, sequences[:, :-1], n + 1).gather(-1, drafts[..., None])[..., 0]
    accepted = torch.minimum(q, p).cumprod(1).view(VOCAB, len(paths), k).sum(1)  # [V, k], paths of length j + 1
    accepted = accepted / TOP_K ** torch.arange(k - 1, -1, -1, dtype=torch.float64)  # each counted once
    at_least = torch.cat([torch.ones(1, dtype=torch.float64), p_first @ accepted, torch.zeros(1, dtype=torch.float64)])
    return at_least[:-1] - at_least[1:]


def test_tokens_follow_the_target_in_both_loops(models, samples):
    hf_target = models[0]
    marginals = _token_marginals(hf_target, MARGINALS)
    assert torch.allclose(marginals.sum(-1), torch.ones(MARGINALS, dtype=torch.float64))
    assert ((marginals - 1 / VOCAB).abs().sum(-1) / 2 > 0.2).all()  # far from uniform, so the tests have power
    (tq_tokens, _), (z_tokens, _) = samples["tqops"], samples["zlab"]
    for i in range(MARGINALS):
        tq, z = (torch.bincount(t[:, i], minlength=VOCAB) for t in (tq_tokens, z_tokens))
        assert _chi2_pvalue(tq, marginals[i]) > ALPHA, ("tqops", i)
        assert _chi2_pvalue(z, marginals[i]) > ALPHA, ("zlab", i)
        assert _two_sample_pvalue(tq, z) > ALPHA, ("tqops vs zlab", i)


def test_first_step_acceptance_is_zlabs(zlab, models, samples):
    hf_target, z_drafter = models[:2]
    exact = _first_step_counts(zlab, z_drafter, hf_target)
    assert torch.allclose(exact.sum(), torch.tensor(1.0, dtype=torch.float64)) and (exact > 0.01).all()
    counts = {name: torch.bincount(firsts - 1, minlength=BS) for name, (_, firsts) in samples.items()}
    for name, c in counts.items():
        assert _chi2_pvalue(c, exact) > ALPHA, (name, c / c.sum(), exact)
    assert _two_sample_pvalue(counts["tqops"], counts["zlab"]) > ALPHA

    # The selector's pair term shapes this distribution: a walk on the unary logits alone (predecessor codebook 0)
    # would give one whose expected chi-square statistic at N_ZLAB samples is far past the 1e-3 threshold (16.3 at
    # 3 degrees of freedom), so a loop that mis-scored the walk would fail above.
    unary_only = copy.deepcopy(z_drafter)
    unary_only.candidate_selector.predecessor_codebook.weight.data.zero_()
    other = _first_step_counts(zlab, unary_only, hf_target)
    assert N_ZLAB * ((other - exact) ** 2 / exact).sum() > 100, (other, exact)


def test_rejection_sample_is_zlabs_rule_draw_for_draw(zlab):
    """z-lab's ``_rejection_sample`` with ``draft_indices`` (DFlash2: q over each position's candidates) and tqops'
    ``rejection_sample(..., candidates=)`` from the same global generator state: the same accepted count and the same
    next token, in cases that accept everything, nothing, and in between."""
    gen = torch.Generator().manual_seed(3)
    k, v, K = 3, 10, 4
    outcomes = set()
    for case in range(300):
        candidates = torch.stack([torch.randperm(v, generator=gen)[:K] for _ in range(k)])[None]  # [1, k, K]
        q = torch.softmax(2 * torch.randn(1, k, K, generator=gen), -1)
        drafts = candidates.gather(-1, torch.multinomial(q[0], 1, generator=gen)[None])[..., 0]  # [1, k]
        p = torch.softmax(2 * torch.randn(1, k + 1, v, generator=gen), -1)
        if case % 2:  # a target close to the walk, so whole blocks are accepted too
            p[:, :k] = 0.1 * p[:, :k] + 0.9 * torch.zeros(1, k, v).scatter(-1, candidates, q)
        with torch.random.fork_rng():
            torch.manual_seed(case)
            want = zlab._rejection_sample(drafts, p, q, candidates)
            torch.manual_seed(case)
            accepted, token = rejection_sample(drafts, p, q, None, candidates=candidates)
        assert (int(accepted), int(token)) == (want[0], int(want[1])), case
        outcomes.add(want[0])
    assert outcomes == set(range(k + 1))


def test_sampled_walk_needs_its_uniforms():
    selector = CandidateSelector(hidden_size=64, vocab_size=16, rank=8, top_k=4)
    hidden, logits, anchors = torch.randn(2, 3, 64), torch.randn(2, 3, 16), torch.tensor([1, 5])
    assert selector.walk(hidden, logits, anchors, 0.0).q is None  # greedy reads none
    with pytest.raises(ValueError, match=r"uniforms is None at temperature=0.7"):
        selector.walk(hidden, logits, anchors, 0.7)
