"""Rejection sampling keeps the target's distribution: exact synthetic checks (a drafter's full-vocabulary q, and a
DFlash2 walk's q over its candidates) and end-to-end marginals (vocab 16), over a dense and a hybrid (Gated DeltaNet)
target with a DFlash drafter and a dense target with a DFlash2 drafter."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tqops.graphs import ForwardContext, StateMetadata, build_metadata, set_forward_context
from tqops.models import DFlashDrafter, Qwen3_5ForCausalLM, Qwen3ForCausalLM, generate, rejection_sample
from tqops.models.sampling import accept_block, sampling_probs

from .fixtures import write_drafter, write_target

VOCAB, TEMP, PROMPT = 16, 1.0, [3, 9, 1, 14, 7]


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit (cells with expected count < 5 pooled); survival function via gammaincc."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def test_rejection_sample_matches_target_distribution_exactly():
    gen = torch.Generator().manual_seed(0)
    n, k, v = 200_000, 3, 6
    p = torch.softmax(torch.randn(k + 1, v, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(k, v, generator=gen) * 1.5, -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).T  # [n, k]
    accepted, nxt = rejection_sample(drafts, p.expand(n, -1, -1), q.expand(n, -1, -1), gen)
    assert 0 < accepted.float().mean() < k and (accepted == k).any() and (accepted == 0).any()
    # emitted tokens: drafts[:a] then nxt; since p[i] does not depend on the prefix, token i ~ p[i]
    rows = torch.arange(n)
    for i in range(k + 1):
        alive = accepted >= i
        token = torch.where(accepted[alive] > i, drafts[alive, min(i, k - 1)], nxt[alive])
        counts = torch.bincount(token, minlength=v)
        assert _chi2_pvalue(counts, p[i]) > 1e-3, (i, counts / counts.sum(), p[i])
    # the sampler is not trivially right: accepting every draft would follow q, which this test rejects
    assert _chi2_pvalue(torch.bincount(drafts[rows, 0], minlength=v), p[0]) < 1e-6


def test_rejection_sample_over_walk_candidates_matches_target_distribution_exactly():
    """DFlash2's verification: each draft sampled from q over K candidates that depend on the draft before it (as the
    selector's walk), q scattered to the vocabulary (0 outside the candidates) inside ``rejection_sample``."""
    gen = torch.Generator().manual_seed(1)
    n, k, v, K = 200_000, 3, 8, 3
    p = torch.softmax(torch.randn(k + 1, v, generator=gen) * 1.5, -1)
    table = torch.stack([torch.stack([torch.randperm(v, generator=gen)[:K] for _ in range(v)]) for _ in range(k)])
    q_table = torch.softmax(torch.randn(k, v, K, generator=gen) * 1.5, -1)  # [position, predecessor, K]
    prev = torch.zeros(n, dtype=torch.long)  # the anchor
    drafts, cands, qs = [], [], []
    for i in range(k):
        cand, q = table[i, prev], q_table[i, prev]  # [n, K]
        prev = cand.gather(-1, torch.multinomial(q, 1, generator=gen))[:, 0]
        drafts.append(prev), cands.append(cand), qs.append(q)
    drafts, cands, qs = torch.stack(drafts, 1), torch.stack(cands, 1), torch.stack(qs, 1)
    accepted, nxt = rejection_sample(drafts, p.expand(n, -1, -1), qs, gen, candidates=cands)
    assert 0 < accepted.float().mean() < k and (accepted == k).any() and (accepted == 0).any()
    for i in range(k + 1):
        alive = accepted >= i
        token = torch.where(accepted[alive] > i, drafts[alive, min(i, k - 1)], nxt[alive])
        counts = torch.bincount(token, minlength=v)
        assert _chi2_pvalue(counts, p[i]) > 1e-3, (i, counts / counts.sum(), p[i])
    assert _chi2_pvalue(torch.bincount(drafts[:, 1], minlength=v), p[1]) < 1e-6  # the drafts alone do not follow p


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), vocab=st.sampled_from([2, 7, 33, 130]),
       temperature=st.sampled_from([0.3, 1.0, 1.7]), top_k=st.integers(0, 140),
       top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1, 1e-4]))
def test_sampling_probs_are_transformers_warpers(seed, rows, vocab, temperature, top_k, top_p):
    """softmax after transformers' temperature, top-k and top-p warpers, in generate's order (top_k 0 and top_p 1:
    the warper left out, as generate leaves it)."""
    warpers = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    scores = warpers.TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = warpers.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = warpers.TopPLogitsWarper(top_p)(None, scores)
    expected = torch.softmax(scores, -1)
    got = sampling_probs(logits, temperature, top_k, top_p)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected)


def _hybrid_target(path):
    """A 2-layer Qwen3.5 (a Gated DeltaNet layer, then gated full attention) saved by transformers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(12)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"], initializer_range=0.3)
    transformers.Qwen3_5ForCausalLM(cfg).save_pretrained(path)
    return Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module", params=["dense", "hybrid", "dense-dflash2"])
def small_vocab_models(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("v16")
    if request.param == "hybrid":
        target = _hybrid_target(root / "t")
    else:
        target = Qwen3ForCausalLM.from_pretrained(write_target(root / "t", vocab=VOCAB, num_layers=1, seed=12),
                                                  dtype=torch.float32)
    path = write_drafter(root / "d", vocab=VOCAB, num_layers=1, target_layer_ids=(0,), block_size=4, seed=12,
                         dflash2=request.param.endswith("dflash2"))  # DFlash2: q over the walk's 4 candidates
    return target, DFlashDrafter.from_pretrained(path, target=target)


def _next_probs(target, prefixes, top_k=0, top_p=1.0):
    """Exact next-token distributions ``[len(prefixes), VOCAB]`` at TEMP (filtered by ``top_k`` and ``top_p``) from
    one paged prefill."""
    lens = torch.tensor([len(p) for p in prefixes], dtype=torch.int32)
    table = torch.arange(len(prefixes), dtype=torch.int32)[:, None]
    target.allocate_cache(len(prefixes), 16)
    meta = build_metadata(lens, lens, table, 16, int(lens.sum()))
    ids = torch.tensor(sum(prefixes, []))
    pos = torch.cat([torch.arange(len(p)) for p in prefixes])
    states = None
    if isinstance(target, Qwen3_5ForCausalLM):
        target.allocate_state(len(prefixes), 1)
        states = StateMetadata(torch.arange(len(prefixes)), meta.query_start_loc)
    with set_forward_context(ForwardContext({0: meta, 1: meta}, state_metadata=states)):
        logits = target.compute_logits(target(ids, pos)[lens.long().cumsum(0) - 1])
    if top_k or top_p < 1:
        return sampling_probs(logits, TEMP, top_k, top_p).double()
    return torch.softmax(logits.double() / TEMP, -1)


@torch.no_grad()
def test_sampled_speculative_decoding_keeps_target_marginals(small_vocab_models):
    target, drafter = small_vocab_models
    p1 = _next_probs(target, [PROMPT])[0]
    p2_given = _next_probs(target, [PROMPT + [a] for a in range(VOCAB)])  # [t1, t2]
    p3_given = _next_probs(target, [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, -1)
    p2 = p1 @ p2_given
    p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    assert (p2 - 1 / VOCAB).abs().sum() / 2 > 0.2 # far from uniform, so the test has power

    # (the CPU reference attention loops over sequences, so the plain-sampling control gets fewer copies)
    for copies, kwargs in ((1000, {"drafter": drafter}), (400, {})):
        result = generate(target, [PROMPT] * copies, 3, temperature=TEMP, seed=1234, **kwargs)
        tokens = torch.tensor(result.tokens)
        for i, probs in ((0, p1), (1, p2), (2, p3)):
            pval = _chi2_pvalue(torch.bincount(tokens[:, i], minlength=VOCAB), probs)
            assert pval > 1e-3, (kwargs.keys(), i, pval)
    # the drafter both hits and misses, so both acceptance and residual resampling were exercised
    spec = generate(target, [PROMPT] * 64, 12, temperature=TEMP, seed=7, drafter=drafter)
    lengths = torch.tensor(sum(spec.acceptance_lengths, []))
    assert (lengths == 1).any() and (lengths >= 3).any()
    # same seed, same tokens
    again = generate(target, [PROMPT] * 64, 12, temperature=TEMP, seed=7, drafter=drafter)
    assert again.tokens == spec.tokens


def _marginals(target, top_k=0, top_p=1.0):
    """The exact distributions of the first three new tokens after PROMPT, each step filtered alike."""
    p1 = _next_probs(target, [PROMPT], top_k, top_p)[0]
    p2_given = _next_probs(target, [PROMPT + [a] for a in range(VOCAB)], top_k, top_p)
    p3_given = _next_probs(target, [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)], top_k,
                           top_p).view(VOCAB, VOCAB, -1)
    return p1, p1 @ p2_given, torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)


@pytest.mark.parametrize("filters", [dict(top_k=5), dict(top_p=0.7), dict(top_k=6, top_p=0.8)],
                         ids=["top_k5", "top_p0.7", "top_k6-top_p0.8"])
@torch.no_grad()
def test_top_k_and_top_p_sampling_keeps_the_filtered_target_marginals(small_vocab_models, filters):
    """Speculative sampling with the filters follows the target's filtered distribution at every position (the
    drafter's q filtered alike for DFlash v1, the walk's own q for DFlash2), and the filters bite: tokens outside
    them never appear, and the unfiltered distribution fails the same test."""
    target, drafter = small_vocab_models
    filtered = _marginals(target, **filters)
    assert (filtered[0] == 0).sum() >= 4  # the filters remove tokens, so the test can tell them apart
    result = generate(target, [PROMPT] * 1000, 3, temperature=TEMP, seed=99, drafter=drafter, **filters)
    tokens = torch.tensor(result.tokens)
    for i, probs in enumerate(filtered):
        counts = torch.bincount(tokens[:, i], minlength=VOCAB)
        assert counts[probs == 0].sum() == 0, (i, counts, probs)
        assert _chi2_pvalue(counts, probs) > 1e-3, (i, counts / counts.sum(), probs)
    plain = _marginals(target)
    assert _chi2_pvalue(torch.bincount(tokens[:, 0], minlength=VOCAB), plain[0]) < 1e-6


def test_accept_block_appends_accepted_drafts_and_bonus_up_to_eos_and_the_limit():
    tokens = [7]
    # block = pending 7, then drafts 1 2 3; two accepted, bonus 9
    assert accept_block(tokens, [7, 1, 2, 3], 2, 9, max_new_tokens=10, eos={0}) == (3, False)
    assert tokens == [7, 1, 2, 9]
    assert accept_block(tokens, [9, 4, 0, 5], 3, 6, max_new_tokens=10, eos={0}) == (2, True)  # through the EOS
    assert tokens == [7, 1, 2, 9, 4, 0]
    tokens = [7, 1]
    assert accept_block(tokens, [1, 2, 3, 4], 3, 5, max_new_tokens=4, eos=set()) == (2, True)  # the limit
    assert tokens == [7, 1, 2, 3]
