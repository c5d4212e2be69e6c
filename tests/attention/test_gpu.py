"""The Triton kernel on CUDA against the torch reference (run on the same GPU) at realistic sizes."""
import pytest
import torch

import tqops
from tqops.attention.naive import paged_attention_naive
from tqops.bench.quality import attention_quality

from .cases import MODES, compare_to_reference, make_case, replay_with_seq_lens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("fmt", tqops.FORMATS)
@pytest.mark.parametrize("mode", MODES)
def test_mixed_batch(fmt, mode):
    # Decode, DFlash block (16), a ragged prefill chunk, and a short sequence, in one packed batch.
    case = make_case(fmt, q_lens=[1, 16, 37, 16, 1], seq_lens=[2000, 1040, 517, 16, 1], num_kv_heads=8, group=4,
                     head_dim=128, block_size=16, dtype=torch.bfloat16, seed=1, device="cuda", **MODES[mode])
    compare_to_reference(case)


@pytest.mark.parametrize("fmt", tqops.FORMATS)
@pytest.mark.parametrize("q_len", [1, 16])
def test_uniform_batches(fmt, q_len):
    case = make_case(fmt, q_lens=[q_len] * 8, seq_lens=[3000 + 7 * i for i in range(8)], num_kv_heads=8, group=4,
                     head_dim=128, block_size=16, causal=q_len == 16, dtype=torch.bfloat16, seed=2, device="cuda")
    compare_to_reference(case)


@pytest.mark.parametrize("fmt", tqops.FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mode", ["causal", "window_sinks"])
def test_long_decode_splits(fmt, head_dim, mode):
    # Decode with >= 512 keys per split: quantized formats take the one-warp tiles with doubled splits; short and
    # single-token sequences share the batch.
    from tqops.attention.triton_paged import launch_config

    seq_lens = [4999, 5000, 1, 17, 4100, 3333, 5000, 2048]
    case = make_case(fmt, q_lens=[1] * 8, seq_lens=seq_lens, num_kv_heads=8, group=4, head_dim=head_dim,
                     block_size=16, dtype=torch.bfloat16, seed=7, device="cuda", **MODES[mode])
    cfg = launch_config(8, 8, 32, 8, head_dim, 16, case.block_table.shape[1],
                        torch.cuda.get_device_properties(0).multi_processor_count, case.fmt)
    assert cfg["num_warps"] == (2 if case.fmt.key_mode == "dense" else 1)
    compare_to_reference(case)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e5m2", "turboquant_4bit_nc", "turboquant_3bit_nc"])
@pytest.mark.parametrize("causal", [True, False])
def test_long_prefill_4096(fmt, causal):
    case = make_case(fmt, q_lens=[4096], seq_lens=[4600], num_kv_heads=2, group=4, head_dim=128, block_size=64,
                     causal=causal, dtype=torch.bfloat16, seed=3, device="cuda")
    compare_to_reference(case)


@pytest.mark.parametrize("fmt", ["fp16", "turboquant_k8v4", "turboquant_k3v4_nc", "turboquant_4bit_nc"])
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 1, 32), (64, 4, 16), (256, 8, 16), (128, 2, 128)])
def test_head_dims_and_groups(fmt, head_dim, group, block_size):
    case = make_case(fmt, q_lens=[16, 1, 5], seq_lens=[700, 300, 999], num_kv_heads=2, group=group,
                     head_dim=head_dim, block_size=block_size, causal=False, with_sinks=True,
                     dtype=torch.float16, seed=4, device="cuda")
    compare_to_reference(case)


@pytest.mark.parametrize("fmt", tqops.FORMATS)
def test_qwen3_5_verify_shape(fmt):
    # The hybrid target's verify tiles: head_dim 256, a GQA group of 4, 16 causal query tokens per sequence.
    case = make_case(fmt, q_lens=[16, 16, 16], seq_lens=[1000, 333, 16], num_kv_heads=2, group=4, head_dim=256,
                     block_size=16, causal=True, dtype=torch.bfloat16, seed=7, device="cuda")
    compare_to_reference(case)


def test_fp32_queries():
    case = make_case("turboquant_4bit_nc", q_lens=[3, 16], seq_lens=[100, 200], num_kv_heads=2, group=4,
                     dtype=torch.float32, seed=5, device="cuda")
    compare_to_reference(case, tol=5e-3)


def test_cuda_graph_replay_sees_new_metadata():
    case = make_case("turboquant_k3v4_nc", q_lens=[16, 16], seq_lens=[900, 400], num_kv_heads=2, group=4,
                     causal=False, dtype=torch.bfloat16, seed=6, device="cuda")
    seq_lens = case.seq_lens.clone()
    run = lambda: tqops.paged_attention(case.query, case.cache, case.block_table, seq_lens, case.query_start_loc,
                                        case.fmt, causal=False)
    for out in replay_with_seq_lens(run, seq_lens, ([900, 400], [600, 16], [17, 899])):
        want = paged_attention_naive(case.query, case.cache, case.block_table, seq_lens, case.query_start_loc,
                                     case.fmt, False, None, None, 64**-0.5, 1.0, 1.0)
        assert not torch.isnan(out).any()
        assert (out.float() - want.float()).norm() / want.float().norm() < 1.5e-2


def test_quality_matches_cpu():
    cpu = attention_quality(seq_len=512, q_len=8)
    gpu = attention_quality(seq_len=512, q_len=8, device="cuda", query_dtype=torch.bfloat16)
    for c, g in zip(cpu, gpu):
        assert abs(c["mean_cosine"] - g["mean_cosine"]) < 2e-3, (c, g)
