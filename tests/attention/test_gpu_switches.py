"""The kernel's tuning switches on CUDA: each variant matches the reference, or the default's output bit for bit."""
import pytest
import torch

import tqops

from .cases import MODES, compare_to_reference, make_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [16, 5, 16]], ids=["decode", "blocks"])
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 4), (128, 2)])
def test_byte_permute_decoders_match_table_gathers(fmt, q_lens, head_dim, group):
    # The inline-PTX decoders (prmt lookups for keys, permutes for values) and the centroid-table gathers / integer
    # conversions must give bit-identical outputs; group 2 at head_dim 128 takes the keys-as-M tiles for blocks
    # (3-bit keys decoded straight into word-major order there, permuted after the decode without the PTX).
    from tqops.attention.triton_paged import paged_attention_triton

    case = make_case(fmt, q_lens=q_lens, seq_lens=[1500, 333, 40], num_kv_heads=4, group=group, head_dim=head_dim,
                     block_size=16, causal=True, dtype=torch.bfloat16, seed=5, device="cuda")
    args = (case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc, case.fmt, True, None, None,
            head_dim ** -0.5, 1.0, 1.0)
    table = paged_attention_triton(*args, pair_asm=False)
    permute = paged_attention_triton(*args, pair_asm=True)
    assert torch.equal(table, permute)
    assert table.abs().sum() > 0


@pytest.mark.parametrize("fmt", [f for f in tqops.FORMATS if tqops.get_format(f).key_mode != "dense"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_keys_as_m_tiles(fmt, mode, dtype):
    # The DFlash verify / draft shape (group 2, q_len 16, head_dim 128): 32-row tiles run with the keys as the MMA's
    # M side (wgmma); ragged sequences give boundary tiles, a short one a program with no whole tile.
    from tqops.attention.triton_paged import launch_config

    case = make_case(fmt, q_lens=[16, 16, 16, 16], seq_lens=[3016, 1000, 16, 2077], num_kv_heads=8, group=2,
                     head_dim=128, block_size=16, dtype=dtype, seed=8, device="cuda", **MODES[mode])
    cfg = launch_config(64, 4, 16, 8, 128, 16, case.block_table.shape[1],
                        torch.cuda.get_device_properties(0).multi_processor_count, case.fmt)
    assert cfg["keys_as_m"] and cfg["block_m"] == 32
    compare_to_reference(case, tol=5e-3 if dtype == torch.float32 else 1.5e-2)


@pytest.mark.parametrize("fmt", [f for f in tqops.FORMATS if tqops.get_format(f).key_mode != "dense"])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [16, 5, 16]], ids=["decode", "blocks"])
def test_l2_prefetch_changes_no_output(fmt, q_lens):
    # The L2 prefetch of the next tile's slots is a hint: on or off, the outputs are the same bits. The last block of
    # the 40-key sequence is prefetched past its end (block ids clamped into the cache).
    from tqops.attention.triton_paged import launch_config, paged_attention_triton

    case = make_case(fmt, q_lens=q_lens, seq_lens=[1500, 333, 40], num_kv_heads=8, group=2, head_dim=128,
                     block_size=16, causal=True, dtype=torch.bfloat16, seed=6, device="cuda")
    cfg = launch_config(sum(q_lens), 3, 16, 8, 128, 16, case.block_table.shape[1],
                        torch.cuda.get_device_properties(0).multi_processor_count, case.fmt)
    # k8v4 decode tiles do not load block ids ahead (_IDS_AHEAD), which the prefetch needs; 3bit_nc blocks run
    # without it by default (_prefetches_l2), so the comparison forces it on.
    decode = q_lens[0] == 1
    assert cfg["prefetch_l2"] == ((fmt != "turboquant_k8v4" or not decode) and (fmt != "turboquant_3bit_nc" or decode))
    args = (case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc, case.fmt, True, None, None,
            128 ** -0.5, 1.0, 1.0)
    with_prefetch = paged_attention_triton(*args, prefetch_l2=True)
    without = paged_attention_triton(*args, prefetch_l2=False)
    assert torch.equal(with_prefetch, without)
    assert with_prefetch.abs().sum() > 0
