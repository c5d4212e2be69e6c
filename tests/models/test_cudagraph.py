"""generate(cudagraph=True): captured steps give the eager loop's tokens and acceptance, and stay lossless."""
import copy
import gc
import weakref

import pytest
import torch

import tqops
from tqops.cudagraph.steps import captured_graphs
from tqops.graphs.compile import model_local
from tqops.models import DFlashDrafter, OracleProposer, Qwen3ForCausalLM, generate

from .test_generate import PROMPTS

N = 20
CPU_FORMATS = ["bf16", "turboquant_3bit_nc"]  # the CPU reference is slow; the GPU test covers every format


class ChangingOracle(OracleProposer):
    """Right about a different number of tokens each step (k cycles through ``ks``)."""

    def __init__(self, reference, ks, block_size, vocab_size):
        super().__init__(reference, ks[0], block_size, vocab_size)
        self.ks, self.calls = ks, 0

    def __call__(self, seq_ids, generated):
        self.k = self.ks[self.calls % len(self.ks)]
        self.calls += 1
        return super().__call__(seq_ids, generated)


def _check_formats(target_path, drafter_path, formats, device):
    for fmt in formats:
        target = Qwen3ForCausalLM.from_pretrained(target_path, cache_format=fmt, dtype=torch.float32, device=device)
        drafter = DFlashDrafter.from_pretrained(drafter_path, target=target, cache_format=fmt)
        plain = generate(target, PROMPTS, N)
        assert generate(target, PROMPTS, N, cudagraph=True).tokens == plain.tokens, fmt
        eager = generate(target, PROMPTS, N, drafter=drafter)
        graphed = generate(target, PROMPTS, N, drafter=drafter, cudagraph=True)
        assert graphed.tokens == eager.tokens == plain.tokens, fmt
        assert graphed.acceptance_lengths == eager.acceptance_lengths, fmt
        # acceptance changes every step (and sequences finish at different steps: the batch bucket shrinks)
        runs = [generate(target, PROMPTS, N, proposer=ChangingOracle(plain.tokens, [3, 0, 1, 2], 4, 100),
                         cudagraph=graph) for graph in (False, True)]
        assert runs[0].tokens == runs[1].tokens == plain.tokens, fmt
        assert runs[0].acceptance_lengths == runs[1].acceptance_lengths, fmt
        assert runs[1].acceptance_lengths[0][:4] == [4, 1, 2, 3], fmt


@torch.no_grad()
def test_cudagraph_generate_matches_eager_on_cpu(target_path, drafter_path):
    _check_formats(target_path, drafter_path, CPU_FORMATS, "cpu")


@pytest.mark.gpu
@torch.no_grad()
def test_cudagraph_generate_matches_eager_every_format(target_path, drafter_path):
    _check_formats(target_path, drafter_path, tqops.FORMATS, "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@torch.no_grad()
def test_cudagraph_sampling_and_compile(target_path, drafter16_path, device):
    """Seeded sampling draws the same tokens as the eager loop; compiled + captured steps compile once each."""
    torch._dynamo.reset()
    target = Qwen3ForCausalLM.from_pretrained(target_path, cache_format="turboquant_4bit_nc", dtype=torch.float32,
                                              layer_cache_formats={0: "bf16"}, device=device)
    drafter = DFlashDrafter.from_pretrained(drafter16_path, target=target, cache_format="fp8_e5m2")
    eager = generate(target, PROMPTS, 12, drafter=drafter, temperature=0.8, seed=7)
    graphed = generate(target, PROMPTS, 12, drafter=drafter, temperature=0.8, seed=7, cudagraph=True)
    assert graphed.tokens == eager.tokens
    plain = generate(target, PROMPTS, 12)
    compiled = generate(target, PROMPTS, 12, drafter=drafter, cudagraph=True, compile=True)
    assert compiled.tokens == plain.tokens
    steps = {k: v for k, v in compiled.compile_reports.items() if k.endswith("_step") or "step(" in k}
    assert len(steps) == 2 and all(r.compilations == 1 and not r.graph_breaks for r in steps.values()), steps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.smoke])])
@torch.no_grad()
def test_second_call_replays_the_same_graphs(target_path, drafter_path, device):
    target = Qwen3ForCausalLM.from_pretrained(target_path, cache_format="turboquant_4bit_nc", device=device)
    drafter = DFlashDrafter.from_pretrained(drafter_path, target=target, cache_format="turboquant_4bit_nc")
    first = generate(target, PROMPTS, 10, drafter=drafter, cudagraph=True)
    runners = dict(captured_graphs(target))
    caches = [layer.kv_cache.data_ptr() for layer in target.attention_layers]
    second = generate(target, PROMPTS, 10, drafter=drafter, cudagraph=True)
    assert second.tokens == first.tokens
    assert captured_graphs(target) == runners  # no new runners, so nothing captured again
    assert [layer.kv_cache.data_ptr() for layer in target.attention_layers] == caches
    if device == "cuda":
        kept = [r for model in (target, drafter) for key, r in captured_graphs(model).items() if key != "caches"]
        assert len(kept) == 2 and all(r.captured_buckets() for r in kept)
    # Another geometry reallocates the caches: the old graphs are dropped, never replayed over freed memory.
    generate(target, PROMPTS, 40, drafter=drafter, cudagraph=True)
    assert captured_graphs(target)["caches"] != runners["caches"]
    assert len(captured_graphs(target)) == 2  # the cache pointers and one geometry
    assert generate(target, PROMPTS, 10, drafter=drafter, cudagraph=True).tokens == first.tokens



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@torch.no_grad()
def test_captured_models_are_freed_with_their_graphs(target_path, drafter_path, device):
    """The kept runners hold compiled steps that reference the model: the model, its graphs and caches must still
    be freed once the caller drops it (a leak, and under NCCL a hang in destroy_process_group)."""
    def run_once(compile):
        target = Qwen3ForCausalLM.from_pretrained(target_path, cache_format="turboquant_4bit_nc", device=device)
        drafter = DFlashDrafter.from_pretrained(drafter_path, target=target, cache_format="turboquant_4bit_nc")
        generate(target, PROMPTS, 6, drafter=drafter, cudagraph=True, compile=compile)
        runners = [r for model in (target, drafter) for key, r in captured_graphs(model).items() if key != "caches"]
        assert len(runners) == 2  # the verify runner on the target, the drafter's on the drafter
        return weakref.ref(target), weakref.ref(drafter), [weakref.ref(r) for r in runners]

    for compile in (False, True):
        target, drafter, runners = run_once(compile)
        gc.collect()
        assert target() is None and drafter() is None, compile
        assert runners and all(r() is None for r in runners), compile


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@torch.no_grad()
def test_a_dropped_drafter_is_freed_while_its_target_lives(target_path, drafter_path, device):
    """The drafter's runner is kept on the drafter: a target that outlives its drafter does not keep it (or its
    caches) alive, and a new drafter of the same geometry still runs with the target's kept verify graphs."""
    target = Qwen3ForCausalLM.from_pretrained(target_path, cache_format="turboquant_4bit_nc", device=device)
    plain = generate(target, PROMPTS, 6).tokens
    drafters = []
    for _ in range(2):
        drafter = DFlashDrafter.from_pretrained(drafter_path, target=target, cache_format="turboquant_4bit_nc")
        assert generate(target, PROMPTS, 6, drafter=drafter, cudagraph=True).tokens == plain
        drafters.append((weakref.ref(drafter), weakref.ref(drafter.attention_layers[0].kv_cache)))
        del drafter
        gc.collect()
    assert all(d() is None and cache() is None for d, cache in drafters)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@torch.no_grad()
def test_a_copy_of_a_compiled_and_captured_model_runs_itself(target_path, device):
    """A deep copy starts without the original's compiled steps and graphs, which would run the original's weights
    and caches: the copy, given other weights, decodes its own tokens, and the original still decodes its own."""
    target = Qwen3ForCausalLM.from_pretrained(target_path, cache_format="turboquant_4bit_nc", device=device)
    before = generate(target, PROMPTS, 8, cudagraph=True, compile=True).tokens
    copied = copy.deepcopy(target)
    assert not captured_graphs(copied) and not model_local(copied, "_tqops_compiled")
    gen = torch.Generator().manual_seed(0)
    for weight in copied.parameters():
        weight.add_(torch.randn(weight.shape, generator=gen).to(weight) * weight.float().std().item())
    want = generate(copied, PROMPTS, 8).tokens
    assert want != before  # else the check below could not tell the copy from the original
    assert generate(copied, PROMPTS, 8, cudagraph=True, compile=True).tokens == want
    assert generate(target, PROMPTS, 8, cudagraph=True, compile=True).tokens == before
