"""Rejection sampling keeps the target's distribution: exact synthetic checks (a drafter's full-vocabulary q, and a
DFlash2 walk's q over its candidates) and end-to-end marginals (vocab 16), over a dense and a hybrid (Gated DeltaNet)
target with a DFlash drafter and a dense target with a DFlash2 drafter."""
import pytest
import torch

from tqops.graphs import ForwardContext, StateMetadata, build_metadata, set_forward_context
from tqops.models import DFlashDrafter, Qwen3_5ForCausalLM, Qwen3ForCausalLM, generate, rejection_sample
from tqops.models.sampling import accept_block

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


def _next_probs(target, prefixes):
    """Exact next-token distributions ``[len(prefixes), VOCAB]`` at TEMP from one paged prefill."""
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
