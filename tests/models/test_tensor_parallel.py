"""Tensor parallelism on CPU: two gloo ranks give one process's tokens, acceptance and logits in every cache family."""
from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import pickle
import subprocess
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tqops.models.steps import drafter_step, target_step
from tqops.graphs import compile_model, mark_token_dim_dynamic, set_forward_context
from tqops.models import DFlashDrafter, OracleProposer, Qwen3Config, Qwen3ForCausalLM, generate
from tqops.models.generate import CACHE_BLOCK_SIZE, step_context
from tqops.models.loading import read_config, weight_files
from tqops.models.parallel import Shard, TensorParallel, take_shard

from .conftest import DRAFTER_LAYERS, TARGET_LAYERS, WINDOW
from .fixtures import write_drafter, write_target

WORLD = 2
FORMATS = ["bf16", "fp8_e4m3", "turboquant_4bit_nc"]
# 4 query / 2 KV heads split 2/1 per rank; an odd vocabulary (rank 1's slice ends in one padding row) and an odd
# MLP width (split 65/64) exercise the uneven cases.
SHAPE = dict(num_attention_heads=4, num_key_value_heads=2, vocab=99, intermediate_size=129)
VOCAB = SHAPE["vocab"]
PROMPTS = [[5, 17, 42, 8, 33], [3, 61, 23, 77, 12, 4, 88, 31, 50, 2, 9, 44, 70], [11, 64]]
N = 12
JOIN_TIMEOUT_S = 300


@dataclasses.dataclass
class Failed:
    """A case that raised: its traceback, so one broken case fails one test, not the module."""

    traceback: str


def write_checkpoints(root) -> dict:
    """Every checkpoint the cases load, written once by the parent."""
    return {
        "target": write_target(root / "target", layer_types=TARGET_LAYERS, sliding_window=WINDOW, shards=2, **SHAPE),
        "tied": write_target(root / "tied", seed=4, tie=True, **SHAPE),
        "drafter": write_drafter(root / "drafter", layer_types=DRAFTER_LAYERS, sliding_window=WINDOW, **SHAPE),
        "dflash2": write_drafter(root / "dflash2", seed=3, dflash2=True, **SHAPE),
        "one_kv_head": write_target(root / "one_kv_head", seed=2),  # 2 query heads, 1 KV head: no split over 2
    }


def load(paths: dict, fmt: str, group, target_key: str = "target", drafter_key: str = "drafter"):
    target = Qwen3ForCausalLM.from_pretrained(paths[target_key], cache_format=fmt, dtype=torch.float32,
                                              tp_group=group)
    return target, DFlashDrafter.from_pretrained(paths[drafter_key], target=target, cache_format=fmt)


def compiled(fn):
    """``fn`` compiled with fullgraph on aot_eager (no inductor codegen on 2 cores), one graph for every token
    count; returns (callable, compile report)."""
    run, report = compile_model(fn, backend="aot_eager")

    def call(*tensors):
        mark_token_dim_dynamic(*tensors)
        return run(*tensors)

    return call, report


def prefill_and_draft_logits(target, drafter, run_target=None, run_draft=None):
    """Target logits of the prompts' prefill ``[tokens, V]`` and the drafter's logits of one block per prompt after
    it (last prompt token + mask tokens) ``[prompts, block_size - 1, V]``; the steps eager or the given callables."""
    bs, batch = drafter.block_size, len(PROMPTS)
    lens = torch.tensor([len(p) for p in PROMPTS], dtype=torch.int32)
    per_seq = -(-(int(lens.max()) + bs) // CACHE_BLOCK_SIZE)
    table = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    target.allocate_cache(batch * per_seq, CACHE_BLOCK_SIZE)
    drafter.allocate_cache(batch * per_seq, CACHE_BLOCK_SIZE)
    ids = torch.tensor(sum(PROMPTS, []))
    pos = torch.cat([torch.arange(len(p)) for p in PROMPTS])
    with set_forward_context(step_context(lens, lens, table)):
        logits, aux = (run_target or target_step(target, drafter.target_layer_ids))(ids, pos)
    with set_forward_context(step_context(lens, lens, table, aux, pos)):
        drafter.prefill_context(ids)
    block = torch.full((batch, bs), drafter.mask_token_id)
    block[:, 0] = torch.tensor([p[-1] for p in PROMPTS])
    positions = (lens.long()[:, None] + torch.arange(bs)).flatten()
    no_context = torch.zeros(batch * bs, drafter.context_dim), torch.full((batch * bs,), -1)
    with set_forward_context(step_context(torch.full((batch,), bs, dtype=torch.int32), lens + bs, table,
                                           *no_context)):
        draft = (run_draft or drafter_step(drafter))(block.flatten(), positions)
    return logits, draft


def greedy(target, drafter) -> dict:
    plain = generate(target, PROMPTS, N)
    spec = generate(target, PROMPTS, N, drafter=drafter)
    oracle = generate(target, PROMPTS, N, proposer=OracleProposer(plain.tokens, 2, drafter.block_size, VOCAB))
    return {"plain": plain.tokens, "dflash": spec.tokens, "dflash_acceptance": spec.acceptance_lengths,
            "oracle": oracle.tokens, "oracle_acceptance": oracle.acceptance_lengths}


def sampled(paths, group, with_drafter: bool) -> dict:
    """seed -> (tokens, acceptance lengths) at temperature 1, for seed 7 and for no seed."""
    target, drafter = load(paths, "bf16", group)
    runs = {seed: generate(target, PROMPTS, N, drafter=drafter if with_drafter else None, temperature=1.0, seed=seed)
            for seed in (7, None)}
    return {seed: (r.tokens, r.acceptance_lengths) for seed, r in runs.items()}


def cudagraph_steps(paths, group) -> list:
    """Greedy DFlash tokens through the CUDA-graph runners' padded static-buffer steps (eager on CPU)."""
    target, drafter = load(paths, "bf16", group)
    return generate(target, PROMPTS, N, drafter=drafter, cudagraph=True).tokens


def compiled_vs_eager(paths, group) -> dict:
    target, drafter = load(paths, "turboquant_4bit_nc", group)
    eager = prefill_and_draft_logits(target, drafter)
    run_target, target_report = compiled(target_step(target, drafter.target_layer_ids))
    run_draft, draft_report = compiled(drafter_step(drafter))
    return {"eager": eager, "compiled": prefill_and_draft_logits(target, drafter, run_target, run_draft),
            "reports": [(r.compilations, r.graph_breaks) for r in (target_report, draft_report)]}


def layout(paths, group) -> dict:
    target, drafter = load(paths, "turboquant_4bit_nc", group)
    target.allocate_cache(4, CACHE_BLOCK_SIZE)
    drafter.allocate_cache(4, CACHE_BLOCK_SIZE)
    attn = target.model.layers[0].self_attn
    return {"qkv_proj": attn.qkv_proj.weight.clone(), "qkv_sizes": attn.qkv_proj.sizes,
            "o_proj": tuple(attn.o_proj.weight.shape), "heads": (attn.attn.num_heads, attn.attn.num_kv_heads),
            "cache_heads": [a.kv_cache.shape[2] for a in target.attention_layers + drafter.attention_layers],
            "gate_up_proj": target.model.layers[0].mlp.gate_up_proj.weight.clone(),
            "fc": tuple(drafter.fc.weight.shape), "embed": target.model.embed_tokens.weight.clone(),
            "shared": drafter.embed_tokens is target.model.embed_tokens and drafter.lm_head is target.lm_head}


def errors(paths, group) -> list:
    """The messages of configurations tensor parallelism rejects."""
    messages = []
    try:
        Qwen3ForCausalLM.from_pretrained(paths["one_kv_head"], dtype=torch.float32, tp_group=group)
    except ValueError as e:
        messages.append(str(e))
    single = Qwen3ForCausalLM.from_pretrained(paths["target"], dtype=torch.float32)
    try:
        DFlashDrafter(Qwen3Config.from_dict(read_config(paths["drafter"])), target=single, tp_group=group)
    except ValueError as e:
        messages.append(str(e))
    return messages


def run_cases(paths: dict, group) -> dict:
    """Every case in this process, one process (``group`` None) or this rank: name -> result or ``Failed``."""
    results = {}

    def case(name, fn):
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 -- reported by the test that reads this case
            results[name] = Failed(traceback.format_exc())

    for fmt in FORMATS:
        case(f"greedy/{fmt}", lambda: greedy(*load(paths, fmt, group)))
        case(f"logits/{fmt}", lambda: prefill_and_draft_logits(*load(paths, fmt, group)))
    case("logits/tied", lambda: prefill_and_draft_logits(*load(paths, "bf16", group, "tied")))
    case("greedy/dflash2", lambda: greedy(*load(paths, "turboquant_4bit_nc", group, drafter_key="dflash2")))
    case("sampled", lambda: sampled(paths, group, with_drafter=False))
    case("sampled_dflash", lambda: sampled(paths, group, with_drafter=True))
    case("cudagraph", lambda: cudagraph_steps(paths, group))
    if group is not None:
        case("compiled", lambda: compiled_vs_eager(paths, group))
        case("layout", lambda: layout(paths, group))
        case("errors", lambda: errors(paths, group))
    return results


def gpu_cases(paths: dict, group, device) -> dict:
    """NCCL on CUDA: greedy DFlash and oracle decoding, eager and compiled + captured (the all-reduces and
    all-gathers inside the CUDA graphs), per format: name -> result or ``Failed``."""
    results = {}
    for fmt in ("bf16", "turboquant_4bit_nc"):
        try:
            target = Qwen3ForCausalLM.from_pretrained(paths["target"], cache_format=fmt, dtype=torch.float32,
                                                      device=device, tp_group=group)
            drafter = DFlashDrafter.from_pretrained(paths["drafter"], target=target, cache_format=fmt)
            eager = generate(target, PROMPTS, N, drafter=drafter)
            captured = generate(target, PROMPTS, N, drafter=drafter, compile=True, cudagraph=True)
            oracle = generate(target, PROMPTS, N, proposer=OracleProposer(eager.tokens, 2, 4, VOCAB), cudagraph=True)
            results[fmt] = {name: (r.tokens, r.acceptance_lengths)
                            for name, r in (("eager", eager), ("captured", captured), ("oracle", oracle))}
        except Exception:  # noqa: BLE001 -- reported by the test that reads this case
            results[fmt] = Failed(traceback.format_exc())
    return results


def poison_uninitialized_memory() -> None:
    """What tests/conftest.py's nan_poison fixture does, for the whole life of a spawned rank."""
    from tests.conftest import _EMPTY_FNS, _new_empty, _wrap

    for name in _EMPTY_FNS:
        setattr(torch, name, _wrap(getattr(torch, name)))
    new_empty = torch.Tensor.new_empty
    torch.Tensor.new_empty = lambda self, *a, **k: _new_empty(new_empty, self, *a, **k)


def worker(rank: int, backend: str, paths: dict, store: str, out_dir: str) -> None:
    poison_uninitialized_memory()
    timeout = datetime.timedelta(seconds=120)
    if backend == "gloo":
        torch.set_num_threads(1)  # two ranks on two shared cores
        dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD,
                                timeout=timeout)
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD,
                                timeout=timeout, device_id=device)
    try:
        results = run_cases(paths, dist.group.WORLD) if backend == "gloo" else \
            gpu_cases(paths, dist.group.WORLD, torch.device("cuda", rank))
    finally:
        gc.collect()  # the cases' models and captured graphs, which NCCL needs gone before the group (pytorch#115388)
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


def spawn_ranks(root, backend: str, paths: dict) -> list:
    """Every rank's results: ``WORLD`` processes spawned once, all cases run inside them."""
    ctx = mp.start_processes(worker, args=(backend, paths, str(root / "store"), str(root)), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"tensor-parallel workers did not finish in {JOIN_TIMEOUT_S} s")
    ranks = []
    for rank in range(WORLD):
        with open(root / f"rank{rank}.pkl", "rb") as f:
            ranks.append(pickle.load(f))
    return ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{"single": results, "ranks": [rank 0's, rank 1's], "paths": checkpoints}`` on CPU over gloo."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    paths = write_checkpoints(root)
    ranks = spawn_ranks(root, "gloo", paths)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cores are shared: more threads than free cores spin and slow every op down
    try:
        single = run_cases(paths, None)
    finally:
        torch.set_num_threads(threads)
    return {"single": single, "ranks": ranks, "paths": paths}


def result(results: dict, name: str):
    value = results[name]
    if isinstance(value, Failed):
        pytest.fail(f"case {name!r} raised:\n{value.traceback}")
    return value


def on_every_rank(runs, name: str) -> list:
    return [result(r, name) for r in runs["ranks"]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_tokens_and_acceptance_match_one_process(runs, fmt):
    single = result(runs["single"], f"greedy/{fmt}")
    for ranked in on_every_rank(runs, f"greedy/{fmt}"):
        assert ranked == single
    assert single["dflash"] == single["plain"] == single["oracle"]
    assert max(max(a) for a in single["oracle_acceptance"]) == 3  # k=2 accepted drafts + the bonus token


def test_dflash2_drafter_matches_one_process(runs):
    """A DFlash2 drafter (convolutions and candidate selector over the gathered logits) on a split target: the
    demo's default drafter under --tp."""
    single = result(runs["single"], "greedy/dflash2")
    for ranked in on_every_rank(runs, "greedy/dflash2"):
        assert ranked == single
    assert single["dflash"] == single["plain"]


@pytest.mark.parametrize("fmt", FORMATS + ["tied"])
def test_logits_close_to_one_process(runs, fmt):
    single = result(runs["single"], f"logits/{fmt}")
    rank0, rank1 = on_every_rank(runs, f"logits/{fmt}")
    for got0, got1, want in zip(rank0, rank1, single):
        assert got0.shape == want.shape and got0.shape[-1] == VOCAB  # the padding row is cut off
        assert torch.equal(got0, got1)  # all-gathered: the very same logits on every rank
        # Row-parallel sums round differently from one matmul in the last bits, and a cache that rounds K/V (a bf16
        # rounding step is 2^-8 relative) can move such a value by one step: 1e-3 of logits that reach ~3 here.
        torch.testing.assert_close(got0, want, rtol=5e-3, atol=5e-3)


def test_sampling_agrees_across_ranks(runs):
    for name in ("sampled", "sampled_dflash"):
        rank0, rank1 = on_every_rank(runs, name)
        assert rank0 == rank1  # seed None: rank 0's broadcast seed
        assert rank0[7] == result(runs["single"], name)[7]  # same seed, same logits: the same draws


def test_cudagraph_steps_match_one_process(runs):
    plain = result(runs["single"], "greedy/bf16")["plain"]
    assert result(runs["single"], "cudagraph") == plain
    assert on_every_rank(runs, "cudagraph") == [plain] * WORLD


def test_compiled_forward_matches_eager(runs):
    for ranked in on_every_rank(runs, "compiled"):
        assert ranked["reports"] == [(1, {}), (1, {})]  # fullgraph with the collectives in it, no recompile
        for got, want in zip(ranked["compiled"], ranked["eager"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_each_rank_holds_its_share(runs):
    from safetensors.torch import load_file

    full = {}
    for f in weight_files(runs["paths"]["target"]):
        full.update(load_file(f))
    embed = full["model.embed_tokens.weight"]  # [99, 64]
    for rank, got in enumerate(on_every_rank(runs, "layout")):
        # each rank's merged weights: its slice of q, of k and of v (of gate and of up), concatenated
        layer = "model.layers.0"
        q, kv = slice(rank * 2 * 64, (rank + 1) * 2 * 64), slice(rank * 64, (rank + 1) * 64)
        assert got["qkv_sizes"] == (2 * 64, 64, 64) and got["o_proj"] == (64, 2 * 64)
        assert torch.equal(got["qkv_proj"], torch.cat([full[f"{layer}.self_attn.q_proj.weight"][q],
                                                       full[f"{layer}.self_attn.k_proj.weight"][kv],
                                                       full[f"{layer}.self_attn.v_proj.weight"][kv]]))
        assert got["heads"] == (2, 1) and got["cache_heads"] == [1] * 5  # 3 target + 2 drafter layers
        ffn = slice(0, 65) if rank == 0 else slice(65, 129)
        assert torch.equal(got["gate_up_proj"], torch.cat([full[f"{layer}.mlp.gate_proj.weight"][ffn],
                                                           full[f"{layer}.mlp.up_proj.weight"][ffn]]))
        assert got["fc"] == (64, 64) and got["shared"]
        rows = embed[rank * 50:(rank + 1) * 50]
        assert torch.equal(got["embed"][:len(rows)], rows) and not got["embed"][len(rows):].any()


def test_bad_splits_are_clear_errors(runs):
    for messages in on_every_rank(runs, "errors"):
        assert len(messages) == 2
        assert "num_key_value_heads (1) divisible by 2" in messages[0]
        assert "drafter is split over 2 rank(s), the target over 1" in messages[1]


def test_uneven_splits():
    parts = [TensorParallel(None, "unused", r, 3) for r in range(3)]
    assert [tp.features(10) for tp in parts] == [(0, 4), (4, 7), (7, 10)]
    assert [tp.vocab(10) for tp in parts] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) divisible by 3"):
        parts[0].heads(4, "num_attention_heads")
    full = torch.arange(20.0).view(10, 2)
    assert torch.equal(take_shard("w", full, Shard(0, 8, 12, 10)), torch.tensor([[16.0, 17], [18, 19], [0, 0],
                                                                                 [0, 0]]))
    assert torch.equal(take_shard("w", full, Shard(1, 1, 2, 2)), full[:, 1:])
    with pytest.raises(ValueError, match="w has 10 entries along dim 0; .* expects 12"):
        take_shard("w", full, Shard(0, 0, 4, 12))


def test_demo_tp_needs_torchrun(capsys, monkeypatch):
    from tqops import demo

    from ..cli_errors import assert_one_line_error, run_cli
    from ..test_demo_cli import DEMO_ERROR

    monkeypatch.setattr(demo, "random_models", lambda *a, **k: pytest.fail("built a model before rejecting --tp"))
    for world, argv in ((None, ["--tp", "2"]), ("4", ["--tp", "2"]), ("2", []), (None, ["--tp", "0"])):
        if world is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", world)
        code, stderr = run_cli(demo.main, argv + ["--device", "cpu"], capsys)
        assert_one_line_error(code, stderr, DEMO_ERROR, "--tp")


def test_demo_under_torchrun_prints_once_and_matches_one_process(capsys):
    from tqops import demo

    argv = ["--random-weights", "--prompts", "2", "--max-new-tokens", "8", "--rounds", "1", "--oracle-k", "3",
            "--device", "cpu"]
    demo.main(argv)
    single = capsys.readouterr().out
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "tqops.demo", "--tp", "2", *argv], capture_output=True, text=True, timeout=240,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("tensor parallel over 2 ranks (gloo)") == 1 and proc.stdout.count("tokens/s over") == 1
    continuation = [line for line in single.splitlines() if line.startswith("first continuation")]
    assert continuation and continuation[0] in proc.stdout.splitlines()
    assert "mean acceptance length 3.50" in single and "mean acceptance length 3.50" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA devices")
def test_nccl_compiled_and_captured_match_one_gpu(tmp_path):
    paths = write_checkpoints(tmp_path)
    ranks = spawn_ranks(tmp_path, "nccl", paths)
    single = gpu_cases(paths, None, torch.device("cuda", 0))
    for fmt, want in single.items():
        want = result(single, fmt)
        for ranked in ranks:
            got = result(ranked, fmt)
            assert got == want, fmt
            assert got["captured"] == got["eager"] and got["oracle"][0] == got["eager"][0]
