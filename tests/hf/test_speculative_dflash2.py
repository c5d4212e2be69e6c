"""DFlash2 over Hugging Face targets (``tqops.hf.generate_speculative``): the drafter step is tqops' own loop's
(``drafter.propose`` walks the candidate selector, verification takes q over its candidates), so greedy is lossless
in fp32 and bf16 over a dense and a compressed cache, tokens and acceptance lengths equal ``tqops.models.generate``'s
on the same weights (greedy and sampled), and sampling keeps the target's marginals."""
import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")
# newer transformers (5.24) call the argument `cache`; past_key_values still works there, with this warning
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
import tqops.hf.speculative as speculative  # noqa: E402
from tqops.hf.speculative import generate_speculative  # noqa: E402
from tqops.models import DFlash2Drafter, Qwen3Config, Qwen3ForCausalLM, SelectedDrafts, generate  # noqa: E402
from tqops.train.dflash import drafter_config  # noqa: E402

from ..models.fixtures import DFLASH2  # noqa: E402
from .test_speculative import (NEW_TOKENS, PROMPT, TEMPERATURE, VOCAB16, _chi2_pvalue, _hf_greedy,  # noqa: E402
                               _next_probs)
from .tiny import left_padded, tiny_model  # noqa: E402

BLOCK = 16


def random_dflash2_drafter(model, *, num_layers=2, target_layer_ids=(0, 1), block_size=BLOCK, top_k=8,
                           seed=0) -> DFlash2Drafter:
    """A random DFlash2 drafter for a transformers ``model`` (``drafter_config`` plus the DFlash2 architecture and
    ``DFLASH2``'s conv and selector settings, ``top_k`` candidates), in the model's dtype, sharing its embed_tokens
    and lm_head."""
    raw = drafter_config(model.config.to_dict(), num_layers=num_layers, target_layer_ids=target_layer_ids,
                         mask_token_id=model.config.vocab_size - 1, block_size=block_size)
    raw["architectures"] = ["DFlash2DraftModel"]
    raw["dflash_config"].update(DFLASH2, selector_top_k=top_k)
    torch.manual_seed(seed)
    drafter = DFlash2Drafter(Qwen3Config.from_dict(raw), target=model).to(model.dtype).eval()
    assert all(p.isfinite().all() for p in drafter.parameters())  # built without a checkpoint, yet defined
    return drafter


@functools.lru_cache(maxsize=None)
def _tqops_model(arch: str, dtype: torch.dtype = torch.float32):
    """``tiny_model(arch)`` on tqops attention, in ``dtype`` (a copy: the fp32 one is shared with other tests)."""
    model = tiny_model(arch) if dtype == torch.float32 else copy.deepcopy(tiny_model(arch)).to(dtype)
    model.set_attn_implementation("tqops")
    return model


class StepSpy:
    """Records each step's walk (``CandidateSelector.walk``'s ``SelectedDrafts``) and what ``verify`` was given."""

    def __init__(self, monkeypatch, drafter):
        self.walks, self.verified = [], []
        walk, verify = drafter.candidate_selector.walk, speculative.verify

        def spy_walk(*args, **kwargs):
            self.walks.append(walk(*args, **kwargs))
            return self.walks[-1]

        def spy_verify(logits, drafts, q, temperature, gen, candidates=None, *filters):
            self.verified.append((drafts, q, candidates))
            return verify(logits, drafts, q, temperature, gen, candidates, *filters)

        monkeypatch.setattr(drafter.candidate_selector, "walk", spy_walk)
        monkeypatch.setattr(speculative, "verify", spy_verify)

    def check(self, temperature: float) -> None:
        """Every step verified the walk's drafts, with its candidates and (sampled) its q over them."""
        assert self.walks and len(self.walks) == len(self.verified)
        for walk, (drafts, q, candidates) in zip(self.walks, self.verified):
            assert isinstance(walk, SelectedDrafts) and drafts is walk.tokens and candidates is walk.candidates
            assert q is walk.q and (q is None) == (temperature == 0)


# (cache format, prompt lengths)
CASES = {"bf16-batch1": ("bf16", [11]), "turboquant_4bit_nc-batch3-left-padded": ("turboquant_4bit_nc", [11, 4, 8])}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_transformers_greedy(arch, dtype, case, monkeypatch):
    fmt, lengths = CASES[case]
    model = _tqops_model(arch, dtype)
    ids, mask = left_padded(lengths)
    eos = model.generation_config.eos_token_id  # llama's tiny config has one (2), qwen3's none
    want = _hf_greedy(model, ids, mask, fmt, eos)

    drafter = random_dflash2_drafter(model)
    spy = StepSpy(monkeypatch, drafter)
    drafted = generate_speculative(model, drafter, ids, NEW_TOKENS, attention_mask=mask, cache_format=fmt,
                                   eos_token_id=eos)
    assert drafted.tokens == want
    assert [sum(a) for a in drafted.acceptance_lengths] == [len(t) - 1 for t in want]
    spy.check(0.0)


@pytest.mark.parametrize("temperature", [0.0, 2.0])
def test_drafter_step_matches_tqops_qwen3(tmp_path, temperature):
    """The same Qwen3 weights as transformers' model and as tqops.models' own, the same DFlash2 drafter weights: the
    same tokens and acceptance lengths per seed. At temperature > 0 this needs the same walk, sampled from the same
    uniforms (drawn in the same order), and the same verification over its candidates as tqops.models.generate."""
    fmt, prompt = "turboquant_4bit_nc", [5, 17, 42, 8, 33, 9, 1]
    model = _tqops_model("qwen3")
    model.save_pretrained(tmp_path)
    native = Qwen3ForCausalLM.from_pretrained(tmp_path, cache_format=fmt, dtype=torch.float32)
    drafter = random_dflash2_drafter(model, seed=2)  # a seed whose walks are at times right, at both temperatures
    native_drafter = DFlash2Drafter(drafter.config, target=native)
    native_drafter.load_state_dict(drafter.state_dict())
    lengths = []
    for seed in (0, 1):
        want = generate(native, [prompt], 40, drafter=native_drafter, temperature=temperature, seed=seed)
        got = generate_speculative(model, drafter, [prompt], 40, temperature=temperature, cache_format=fmt,
                                   generator=torch.Generator().manual_seed(seed))
        assert (got.tokens, got.acceptance_lengths) == (want.tokens, want.acceptance_lengths)
        lengths += sum(got.acceptance_lengths, [])
    assert max(lengths) > 1  # some drafts were accepted, so the walk and its verification mattered
    if temperature == 0:
        # greedy, several left-padded rows: the same per-row tokens and acceptance lengths as the unpadded batch
        ids, mask = left_padded([9, 4, 7])
        prompts = [row[len(row) - int(n):].tolist() for row, n in zip(ids, mask.sum(1))]
        want = generate(native, prompts, 24, drafter=native_drafter)
        got = generate_speculative(model, drafter, ids, 24, attention_mask=mask, cache_format=fmt)
        assert (got.tokens, got.acceptance_lengths) == (want.tokens, want.acceptance_lengths)


@pytest.fixture(scope="module")
def vocab16():
    """A 1-layer transformers Qwen3 over 16 tokens and a 1-layer DFlash2 drafter of block 4 walking 4 of the 16."""
    torch.manual_seed(12)
    config = transformers.Qwen3Config(vocab_size=VOCAB16, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, initializer_range=0.2)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.set_attn_implementation("tqops")
    return model, random_dflash2_drafter(model, num_layers=1, target_layer_ids=(0,), block_size=4, top_k=4, seed=12)


def test_sampling_keeps_the_target_marginals(vocab16):
    model, drafter = vocab16
    p1 = _next_probs(model, [PROMPT])[0]
    p2_given = _next_probs(model, [PROMPT + [a] for a in range(VOCAB16)])
    p2 = p1 @ p2_given
    p3 = torch.einsum("a,ab,abc->c", p1, p2_given,
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


def test_sampling_returns_valid_tokens_reproducibly_per_generator(vocab16, monkeypatch):
    model, drafter = vocab16
    ids, mask = left_padded([9, 4, 6], seed=3)
    ids = ids % VOCAB16
    spy = StepSpy(monkeypatch, drafter)

    def run(seed):
        return generate_speculative(model, drafter, ids, 24, attention_mask=mask, temperature=TEMPERATURE,
                                    cache_format="turboquant_4bit_nc", generator=torch.Generator().manual_seed(seed))

    first = run(7)
    assert all(len(t) == 24 and all(0 <= x < VOCAB16 for x in t) for t in first.tokens)
    assert 1.0 < first.mean_acceptance_length < 4.0
    spy.check(TEMPERATURE)
    assert spy.walks[0].q.shape == (3, 3, 4)  # q over each position's 4 candidates, not the vocabulary
    assert run(7).tokens == first.tokens
    assert run(8).tokens != first.tokens
