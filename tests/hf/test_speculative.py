"""DFlash over Hugging Face targets: lossless greedy, per-row rollback, the target's sampling marginals, errors."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
# newer transformers (5.24) call the argument `cache`; past_key_values still works there, with this warning
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
from tqops.hf import PagedKVCache  # noqa: E402
from tqops.hf.speculative import generate_speculative  # noqa: E402
from tqops.models import DFlashDrafter, OracleProposer, Qwen3Config, Qwen3ForCausalLM, generate  # noqa: E402
from tqops.models.sampling import sampling_probs  # noqa: E402
from tqops.train.dflash import drafter_config  # noqa: E402

from ..models.fixtures import oracle_acceptance_lengths  # noqa: E402
from .tiny import left_padded, tiny_model  # noqa: E402

NEW_TOKENS = 20
BLOCK = 16


def _tqops_model(arch: str):
    model = tiny_model(arch)
    model.set_attn_implementation("tqops")
    return model


def random_drafter(model, *, num_layers=2, target_layer_ids=(0, 1), block_size=BLOCK, seed=0) -> DFlashDrafter:
    """A random DFlash drafter for a transformers ``model``: its config copies the target's hidden size, heads,
    head_dim and RoPE (``tqops.train``'s ``drafter_config``); it shares the model's embed_tokens and lm_head."""
    raw = drafter_config(model.config.to_dict(), num_layers=num_layers, target_layer_ids=target_layer_ids,
                         mask_token_id=model.config.vocab_size - 1, block_size=block_size)
    torch.manual_seed(seed)
    return DFlashDrafter(Qwen3Config.from_dict(raw), target=model).eval()


class PerRowOracle:
    """``OracleProposer`` with its own number of right tokens per row, so rows accept different counts."""

    def __init__(self, reference, ks, block_size, vocab_size):
        self.rows = [OracleProposer(reference, k, block_size, vocab_size) for k in ks]
        self.block_size = block_size

    def __call__(self, seq_ids, generated):
        return torch.cat([self.rows[b]([b], [done]) for b, done in zip(seq_ids, generated)])


def _hf_greedy(model, ids, mask, fmt, eos):
    """transformers' own greedy generate with a PagedKVCache in ``fmt``: each row's new tokens up to its EOS."""
    out = model.generate(ids, attention_mask=mask, past_key_values=PagedKVCache(model.config, fmt, len(ids), 64),
                         max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=eos)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        stop = next((i for i, t in enumerate(row) if t == eos), None)
        rows.append(row if stop is None else row[:stop + 1])
    return rows


# (cache format, prompt lengths, right tokens per block of each row's oracle)
CASES = {"bf16-batch1": ("bf16", [11], [5]),
         "turboquant_4bit_nc-batch3-left-padded": ("turboquant_4bit_nc", [11, 4, 8], [15, 0, 6])}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_transformers_greedy(arch, case):
    fmt, lengths, ks = CASES[case]
    model = _tqops_model(arch)
    ids, mask = left_padded(lengths)
    eos = model.generation_config.eos_token_id  # llama's tiny config has one (2), qwen3's none
    want = _hf_greedy(model, ids, mask, fmt, eos)

    drafted = generate_speculative(model, random_drafter(model), ids, NEW_TOKENS, attention_mask=mask,
                                   cache_format=fmt, eos_token_id=eos)
    assert drafted.tokens == want
    assert [sum(a) for a in drafted.acceptance_lengths] == [len(t) - 1 for t in want]

    # An oracle right about ks[b] tokens of each block: rows accept different counts and roll back different tails.
    cache = PagedKVCache(model.config, fmt, max_batch_size=4, max_cache_len=64)
    oracle = generate_speculative(model, None, ids, NEW_TOKENS, attention_mask=mask, past_key_values=cache,
                                  eos_token_id=eos, proposer=PerRowOracle(want, ks, BLOCK, model.config.vocab_size))
    assert oracle.tokens == want
    assert oracle.acceptance_lengths == [oracle_acceptance_lengths(k, BLOCK, len(t)) for k, t in zip(ks, want)]
    assert max(sum(oracle.acceptance_lengths, [])) > 1
    # each row holds its prompt plus what every step but its last kept (the block minus its rolled-back tail); the
    # step that finishes a row keeps nothing
    kept = [n + sum(BLOCK - r for r in rolled[:-1]) for n, rolled in zip(lengths, oracle.rollbacks)]
    assert cache.sequence_lengths()[:len(lengths)].tolist() == kept
    assert all(r == BLOCK - 1 - min(k, BLOCK - 1) for k, rolled in zip(ks, oracle.rollbacks) for r in rolled[:-1])


@pytest.mark.parametrize("temperature", [0.0, 2.0])
def test_drafter_context_matches_tqops_qwen3(tmp_path, temperature):
    """The same Qwen3 weights as transformers' model and as tqops.models' own, the same drafter weights: the same
    tokens and acceptance lengths per seed. At temperature > 0 the drafts are sampled from the drafter's
    probabilities, so this holds only if the drafter reads the same target states (the last layer's after the final
    norm), at the same positions, as in tqops.models.generate."""
    fmt, prompt = "turboquant_4bit_nc", [5, 17, 42, 8, 33, 9, 1]
    model = _tqops_model("qwen3")
    model.save_pretrained(tmp_path)
    native = Qwen3ForCausalLM.from_pretrained(tmp_path, cache_format=fmt, dtype=torch.float32)
    drafter = random_drafter(model, seed=1)  # a seed whose random drafts are at times right, at both temperatures
    native_drafter = DFlashDrafter(drafter.config, target=native)
    native_drafter.load_state_dict(drafter.state_dict())
    lengths = []
    for seed in (0, 1):
        want = generate(native, [prompt], 40, drafter=native_drafter, temperature=temperature, seed=seed)
        got = generate_speculative(model, drafter, [prompt], 40, temperature=temperature, cache_format=fmt,
                                   generator=torch.Generator().manual_seed(seed))
        assert (got.tokens, got.acceptance_lengths) == (want.tokens, want.acceptance_lengths)
        lengths += sum(got.acceptance_lengths, [])
    assert max(lengths) > 1  # some drafts were accepted, so the drafter's context mattered


VOCAB16, TEMPERATURE, PROMPT = 16, 1.0, [3, 9, 1, 14, 7]


@pytest.fixture(scope="module")
def vocab16():
    """A 1-layer transformers Qwen3 over 16 tokens and a 1-layer drafter of block 4."""
    torch.manual_seed(12)
    config = transformers.Qwen3Config(vocab_size=VOCAB16, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, initializer_range=0.2)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.set_attn_implementation("tqops")
    return model, random_drafter(model, num_layers=1, target_layer_ids=(0,), block_size=4, seed=12)


def _next_probs(model, prefixes, top_k=0, top_p=1.0):
    """Next-token distributions ``[len(prefixes), VOCAB16]`` of equal-length ``prefixes``, fp16 cache, filtered by
    ``top_k`` and ``top_p``."""
    cache = PagedKVCache(model.config, "fp16", max_batch_size=len(prefixes), max_cache_len=16)
    with torch.no_grad():
        logits = model(torch.tensor(prefixes), past_key_values=cache).logits[:, -1]
    if top_k or top_p < 1:
        return sampling_probs(logits, TEMPERATURE, top_k, top_p).double()
    return torch.softmax(logits.double() / TEMPERATURE, -1)


def _chi2_pvalue(counts, probs) -> float:
    """Pearson chi-square goodness of fit (cells expecting < 5 pooled)."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64), stat / 2).item()


def test_sampling_keeps_the_target_marginals(vocab16):
    model, drafter = vocab16
    p1 = _next_probs(model, [PROMPT])[0]
    p2 = p1 @ _next_probs(model, [PROMPT + [a] for a in range(VOCAB16)])
    p3 = torch.einsum("a,ab,abc->c", p1, _next_probs(model, [PROMPT + [a] for a in range(VOCAB16)]),
                      _next_probs(model, [PROMPT + [a, b] for a in range(VOCAB16) for b in range(VOCAB16)])
                      .view(VOCAB16, VOCAB16, -1))
    assert (p2 - 1 / VOCAB16).abs().sum() / 2 > 0.2  # far from uniform, so the test has power
    result = generate_speculative(model, drafter, [PROMPT] * 1000, 3, temperature=TEMPERATURE, cache_format="fp16",
                                  generator=torch.Generator().manual_seed(1234))
    tokens = torch.tensor(result.tokens)
    for i, probs in enumerate((p1, p2, p3)):
        assert _chi2_pvalue(torch.bincount(tokens[:, i], minlength=VOCAB16), probs) > 1e-3, i
    # both accepted drafts and residual resampling happened
    lengths = torch.tensor(sum(result.acceptance_lengths, []))
    assert (lengths == 1).any() and (lengths == 2).any()


def test_top_k_and_top_p_sampling_keeps_the_filtered_target_marginals(vocab16):
    model, drafter = vocab16
    f = dict(top_k=6, top_p=0.8)
    p1 = _next_probs(model, [PROMPT], **f)[0]
    p2_given = _next_probs(model, [PROMPT + [a] for a in range(VOCAB16)], **f)
    p3_given = _next_probs(model, [PROMPT + [a, b] for a in range(VOCAB16) for b in range(VOCAB16)], **f)
    p2, p3 = p1 @ p2_given, torch.einsum("a,ab,abc->c", p1, p2_given, p3_given.view(VOCAB16, VOCAB16, -1))
    assert (p1 == 0).sum() >= 4  # the filters remove tokens
    result = generate_speculative(model, drafter, [PROMPT] * 1000, 3, temperature=TEMPERATURE, cache_format="fp16",
                                  generator=torch.Generator().manual_seed(4321), **f)
    tokens = torch.tensor(result.tokens)
    for i, probs in enumerate((p1, p2, p3)):
        counts = torch.bincount(tokens[:, i], minlength=VOCAB16)
        assert counts[probs == 0].sum() == 0 and _chi2_pvalue(counts, probs) > 1e-3, (i, counts, probs)
    assert _chi2_pvalue(torch.bincount(tokens[:, 0], minlength=VOCAB16), _next_probs(model, [PROMPT])[0]) < 1e-6


def test_sampling_is_reproducible_per_generator(vocab16):
    model, drafter = vocab16
    ids, mask = left_padded([9, 4, 6], seed=3)
    ids = ids % VOCAB16

    def run(seed):
        return generate_speculative(model, drafter, ids, 24, attention_mask=mask, temperature=TEMPERATURE,
                                    cache_format="turboquant_4bit_nc", generator=torch.Generator().manual_seed(seed))

    first = run(7)
    assert all(len(t) == 24 and all(0 <= x < VOCAB16 for x in t) for t in first.tokens)
    assert 1.0 < first.mean_acceptance_length < 4.0
    assert run(7).tokens == first.tokens
    assert run(8).tokens != first.tokens


def test_rollback_rows_is_as_if_the_dropped_tokens_never_came():
    model = _tqops_model("qwen3")
    ids, mask = left_padded([9, 4, 7])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    block = torch.randint(1, 100, (3, 5), generator=torch.Generator().manual_seed(2))
    block_positions = mask.sum(-1, keepdim=True) + torch.arange(5)
    drop = torch.tensor([0, 3, 5])
    rolled = PagedKVCache(model.config, "turboquant_4bit_nc", max_batch_size=3, max_cache_len=32)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions, past_key_values=rolled)
        model(block, position_ids=block_positions, past_key_values=rolled)
        rolled.rollback_rows(drop)
        assert rolled.sequence_lengths().tolist() == [9 + 5, 4 + 2, 7 + 0]
        assert rolled.get_seq_length() == 14  # the longest row
        # each row's next token sits right after what it kept
        after = model(block[:, :1], position_ids=rolled.sequence_lengths()[:, None].long(), past_key_values=rolled)
        # the same kept tokens fed one row at a time into fresh caches
        for row, n in enumerate([9, 4, 7]):
            fresh = PagedKVCache(model.config, "turboquant_4bit_nc", max_batch_size=1, max_cache_len=32)
            keep = 5 - int(drop[row])
            tokens = torch.cat([ids[row, 9 - n:], block[row, :keep], block[row, :1]])[None]
            want = model(tokens, past_key_values=fresh).logits[:, -1]
            torch.testing.assert_close(after.logits[row, -1:], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("counts,error,message", [
    (torch.tensor([1.0]), TypeError, "1-D integer"),
    (torch.tensor([[1]]), TypeError, "1-D integer"),
    ([0, 0, 0, 0], ValueError, "max_batch_size=3"),
    ([0, -1], ValueError, r"tokens_to_remove\[1\] = -1"),
    ([10, 0], ValueError, r"row 0 holds 9"),
], ids=["float", "2-d", "too-many-rows", "negative", "more-than-held"])
def test_rollback_rows_rejects_bad_counts(counts, error, message):
    model = _tqops_model("qwen3")
    ids, mask = left_padded([9, 4, 7])
    cache = PagedKVCache(model.config, "bf16", max_batch_size=3, max_cache_len=32)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    before = cache.sequence_lengths()
    with pytest.raises(error, match=message):
        cache.rollback_rows(counts)
    assert torch.equal(cache.sequence_lengths(), before) and cache.get_seq_length() == 9


def _eager_model(model, drafter, ids):
    model.set_attn_implementation("eager")
    try:
        generate_speculative(model, drafter, ids, 4)
    finally:
        model.set_attn_implementation("tqops")


def _foreign_drafter(model, drafter, ids):
    other = _tqops_model("llama")
    generate_speculative(other, drafter, ids, 4)


BAD_CALLS = {
    "drafter-hidden-size": (lambda m, d, ids: generate_speculative(m, DFlashDrafter(Qwen3Config.from_dict(
        dict(drafter_config(m.config.to_dict(), num_layers=1, target_layer_ids=[0], mask_token_id=1),
             hidden_size=64))), ids, 4), ValueError, "drafter has hidden_size=64.*hf_model has hidden_size=128"),
    "drafter-of-another-model": (_foreign_drafter, ValueError, "share hf_model's embed_tokens"),
    "not-tqops-attention": (_eager_model, ValueError, "hf_model uses attn_implementation='eager'"),
    "batch-over-max_batch_size": (lambda m, d, ids: generate_speculative(
        m, d, ids, 4, past_key_values=PagedKVCache(m.config, "bf16", max_batch_size=1, max_cache_len=64)),
        ValueError, "2 prompts exceed past_key_values' max_batch_size=1"),
    "cache-too-short": (lambda m, d, ids: generate_speculative(
        m, d, ids, 40, past_key_values=PagedKVCache(m.config, "bf16", max_batch_size=2, max_cache_len=32)),
        ValueError, "max_cache_len=32; this call needs 60"),
    "not-a-paged-cache": (lambda m, d, ids: generate_speculative(
        m, d, ids, 4, past_key_values=transformers.DynamicCache()), TypeError, "past_key_values must be"),
    "right-padding": (lambda m, d, ids: generate_speculative(
        m, d, ids, 4, attention_mask=torch.tensor([[1] * 5, [1] * 4 + [0]])), ValueError, "left padding only"),
    "mask-shape": (lambda m, d, ids: generate_speculative(m, d, ids, 4, attention_mask=torch.ones(2, 4)),
                   ValueError, "attention_mask is \\(2, 4\\)"),
    "empty-prompt": (lambda m, d, ids: generate_speculative(m, d, [[1, 2], []], 4), ValueError, "prompt 1 has no"),
    "max_new_tokens": (lambda m, d, ids: generate_speculative(m, d, ids, 0), ValueError, "max_new_tokens"),
    "no-drafter": (lambda m, d, ids: generate_speculative(m, None, ids, 4), ValueError, "needs a drafter"),
    # one prompt as tokenizer(text).input_ids gives it: not four one-token prompts
    "flat-list-of-ids": (lambda m, d, ids: generate_speculative(m, d, [5, 17, 42, 8], 4), ValueError,
                         r"input_ids\[0\] is a single token id \(5\)"),
    "float-ids-in-a-list": (lambda m, d, ids: generate_speculative(m, d, [[5, 17], [5.9, 17.2]], 4), ValueError,
                            r"input_ids\[1\] holds torch.float32"),
    "eos-float": (lambda m, d, ids: generate_speculative(m, d, ids, 4, eos_token_id=2.0), TypeError,
                  r"eos_token_id must be .*, got 2.0"),
    "eos-2d-tensor": (lambda m, d, ids: generate_speculative(m, d, ids, 4, eos_token_id=torch.tensor([[2]])),
                      TypeError, r"eos_token_id must be .*, got a 2-D torch.int64 tensor"),
    # out-of-vocab ids would index past the embedding (an IndexError on CPU, a device-side assert on CUDA)
    "id-past-the-vocab": (lambda m, d, ids: generate_speculative(m, d, torch.tensor([[1, 2, 3], [4, 128, 6]]), 4),
                          ValueError, r"input_ids\[1, 1\] is token id 128, expected ids in \[0, 128\)"),
    "negative-id-in-a-list": (lambda m, d, ids: generate_speculative(m, d, [[1, 2, 3], [4, -1]], 4), ValueError,
                              r"input_ids\[1\]\[1\] is token id -1, expected ids in \[0, 128\)"),
    "padding-id-past-the-vocab": (lambda m, d, ids: generate_speculative(
        m, d, torch.tensor([[999, 2, 3], [4, 5, 6]]), 4, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]])),
        ValueError, r"input_ids\[0, 0\] is token id 999"),
    "temperature-inf": (lambda m, d, ids: generate_speculative(m, d, ids, 4, temperature=float("inf")), ValueError,
                        r"temperature must be a finite number >= 0 \(0: greedy\), got inf"),
    "temperature-nan": (lambda m, d, ids: generate_speculative(m, d, ids, 4, temperature=float("nan")), ValueError,
                        "temperature must be a finite number >= 0"),
    "temperature-negative": (lambda m, d, ids: generate_speculative(m, d, ids, 4, temperature=-0.5), ValueError,
                             "temperature must be a finite number >= 0"),
    "temperature-str": (lambda m, d, ids: generate_speculative(m, d, ids, 4, temperature="0"), TypeError,
                        "temperature must be a real number, got str '0'"),
    "temperature-bool": (lambda m, d, ids: generate_speculative(m, d, ids, 4, temperature=True), TypeError,
                         "temperature must be a real number, got bool True"),
    "top_k-negative": (lambda m, d, ids: generate_speculative(m, d, ids, 4, temperature=1.0, top_k=-3), ValueError,
                       r"top_k must be >= 0 \(0: off\), got -3"),
    "top_p-zero": (lambda m, d, ids: generate_speculative(m, d, ids, 4, temperature=1.0, top_p=0), ValueError,
                   r"top_p must be in \(0, 1\] \(1: off\), got 0"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_calls_name_the_argument(case, monkeypatch):
    call, error, message = BAD_CALLS[case]
    model = _tqops_model("qwen3")
    ids = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    drafter = random_drafter(model)
    ran = []
    monkeypatch.setattr(model.model, "forward", lambda *a, **k: ran.append(1))  # nothing may run before the checks
    with pytest.raises(error, match=message):
        call(model, drafter, ids)
    assert not ran


def test_eos_token_id_may_be_a_tensor():
    model = _tqops_model("llama")
    ids, mask = left_padded([11, 4])
    drafter = random_drafter(model)
    free = generate_speculative(model, drafter, ids, 8, attention_mask=mask, cache_format="bf16")
    eos = free.tokens[0][2]  # row 0 stops after its third token
    want = generate_speculative(model, drafter, ids, 8, attention_mask=mask, cache_format="bf16", eos_token_id=eos)
    assert len(want.tokens[0]) <= 3
    for given in (torch.tensor(eos), torch.tensor([eos, model.config.vocab_size])):
        got = generate_speculative(model, drafter, ids, 8, attention_mask=mask, cache_format="bf16",
                                   eos_token_id=given)
        assert got.tokens == want.tokens
