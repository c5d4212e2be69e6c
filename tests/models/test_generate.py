"""Speculative decoding is lossless in every cache format; acceptance/rollback bookkeeping is exact; EOS stops."""
import importlib

import pytest
import torch

import tqops
from tqops.models import DFlashDrafter, OracleProposer, Qwen3ForCausalLM, generate

from .fixtures import oracle_acceptance_lengths

generate_module = importlib.import_module("tqops.models.generate")  # the module; tqops.models.generate is the function

PROMPTS = [[5, 17, 42, 8, 33], torch.tensor([3, 61, 23, 77, 12, 4, 88, 31, 50, 2, 9, 44, 70]), [11, 64]]
N = 16


def _models(target_path, drafter_path, fmt, target_overrides=None):
    target = Qwen3ForCausalLM.from_pretrained(target_path, cache_format=fmt, dtype=torch.float32,
                                              layer_cache_formats=target_overrides)
    return target, DFlashDrafter.from_pretrained(drafter_path, target=target, cache_format=fmt)


@pytest.mark.parametrize("fmt", list(tqops.FORMATS) + ["mixed"], ids=list(tqops.FORMATS) + ["mixed"])
@torch.no_grad()
def test_greedy_speculative_decoding_is_lossless(target_path, drafter_path, fmt):
    overrides = {0: "bf16", -1: "bf16"} if fmt == "mixed" else None
    target, drafter = _models(target_path, drafter_path, "turboquant_4bit_nc" if fmt == "mixed" else fmt, overrides)
    plain = generate(target, PROMPTS, N)
    assert [len(t) for t in plain.tokens] == [N] * 3
    assert plain.acceptance_lengths == [[1] * (N - 1)] * 3
    spec = generate(target, PROMPTS, N, drafter=drafter)
    assert spec.tokens == plain.tokens
    assert all(sum(a) == N - 1 for a in spec.acceptance_lengths)
    oracle = generate(target, PROMPTS, N, proposer=OracleProposer(plain.tokens, 2, 4, 100))
    assert oracle.tokens == plain.tokens
    assert oracle.acceptance_lengths == [oracle_acceptance_lengths(2, 4, N)] * 3


@pytest.mark.parametrize("block_size,k", [(8, 0), (8, 5), (8, 8), (16, 5), (16, 16)])
@torch.no_grad()
def test_oracle_proposer_accepts_exactly_k(target_path, block_size, k):
    target = Qwen3ForCausalLM.from_pretrained(target_path, cache_format="fp8_e4m3", dtype=torch.float32)
    n = 24
    plain = generate(target, PROMPTS, n)
    result = generate(target, PROMPTS, n, proposer=OracleProposer(plain.tokens, k, block_size, 100))
    assert result.tokens == plain.tokens
    lengths = oracle_acceptance_lengths(k, block_size, n)
    assert result.acceptance_lengths == [lengths] * 3
    # every step but a capped last one rolls back exactly the block's rejected tail
    for rolled in result.rollbacks:
        assert len(rolled) == len(lengths)
        assert rolled[:-1] == [block_size - 1 - min(k, block_size - 1)] * (len(lengths) - 1)
    assert result.mean_acceptance_length == pytest.approx((n - 1) / len(lengths))


@torch.no_grad()
def test_block_size_16_drafter_is_lossless(target_path, drafter16_path):
    target, drafter = _models(target_path, drafter16_path, "turboquant_k8v4")
    assert drafter.block_size == 16
    plain = generate(target, PROMPTS, 20)
    assert generate(target, PROMPTS, 20, drafter=drafter).tokens == plain.tokens


@torch.no_grad()
def test_batch_of_different_lengths_stops_at_eos(target_path, drafter_path):
    target, drafter = _models(target_path, drafter_path, "bf16")
    plain = generate(target, PROMPTS, N).tokens
    # prompt 0 stops mid-way at a token it has not produced before; prompt 2 stops at its very first token
    cut = next(i for i in range(3, N) if plain[0][i] not in plain[0][:i])
    eos = [plain[0][cut], plain[2][0]]

    def truncated(tokens):
        stop = next((i for i, t in enumerate(tokens) if t in eos), None)
        return tokens if stop is None else tokens[:stop + 1]

    expected = [truncated(t) for t in plain]
    assert expected[0] == plain[0][:cut + 1] and expected[2] == plain[2][:1]
    for kwargs in ({}, {"drafter": drafter}, {"proposer": OracleProposer(plain, 5, 4, 100)}):
        result = generate(target, PROMPTS, N, eos_token_id=eos, **kwargs)
        assert result.tokens == expected, kwargs
        assert [sum(a) for a in result.acceptance_lengths] == [len(t) - 1 for t in expected]
        assert result.acceptance_lengths[2] == []
    single = generate(target, PROMPTS, 1, drafter=drafter)
    assert single.tokens == [t[:1] for t in plain] and single.acceptance_lengths == [[], [], []]
    assert single.mean_acceptance_length == 0.0


def test_bad_arguments(target_path):
    target = Qwen3ForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    with pytest.raises(ValueError, match="at least one token"):
        generate(target, [[1], []], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(target, [[1]], 0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [pytest.param(f, marks=pytest.mark.smoke) if f in ("turboquant_4bit_nc", "fp8_e4m3")
                                 else f for f in tqops.FORMATS], ids=tqops.FORMATS)
@torch.no_grad()
def test_greedy_speculative_decoding_is_lossless_on_gpu(target_path, drafter_path, fmt):
    target = Qwen3ForCausalLM.from_pretrained(target_path, cache_format=fmt, dtype=torch.float32, device="cuda")
    drafter = DFlashDrafter.from_pretrained(drafter_path, target=target, cache_format=fmt)
    plain = generate(target, PROMPTS, N)
    assert generate(target, PROMPTS, N, drafter=drafter).tokens == plain.tokens
    oracle = generate(target, PROMPTS, N, proposer=OracleProposer(plain.tokens, 2, 4, 100))
    assert oracle.tokens == plain.tokens and oracle.acceptance_lengths == [oracle_acceptance_lengths(2, 4, N)] * 3


@pytest.mark.parametrize("warm_up", [True, False], ids=["warm-up", "cold"])
def test_timed_generate_runs_the_same_call_each_round(target_path, drafter_path, monkeypatch, warm_up):
    target = Qwen3ForCausalLM.from_pretrained(target_path, cache_format="fp16", dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_path, target=target, cache_format="fp16")
    calls = []
    real = generate_module.generate
    monkeypatch.setattr(generate_module, "generate", lambda *a, **k: calls.append((a[1:], k)) or real(*a, **k))
    prompts = [[3, 17, 42, 8], [50, 2, 9]]
    result, seconds = generate_module.timed_generate(target, prompts, 10, rounds=3, warm_up=warm_up,
                                                     drafter=drafter)
    assert len(calls) == 3 + warm_up and all(c == ((prompts, 10), {"drafter": drafter}) for c in calls)
    assert result.tokens == generate(target, prompts, 10, drafter=drafter).tokens and seconds > 0
