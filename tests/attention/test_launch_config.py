"""Launch heuristics: static shapes in, tile sizes and split counts out (no GPU needed)."""
import pytest
from hypothesis import given, settings, strategies as st

import tqops

from .interp import launch_config

H200_SMS = 132


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 64), q_len=st.sampled_from([1, 2, 16, 37]), kv_heads=st.sampled_from([1, 2, 8]),
       group=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([64, 128, 256]),
       block_size=st.sampled_from([16, 64]), max_blocks=st.integers(1, 8192), fmt=st.sampled_from(tqops.FORMATS))
def test_splits_stay_long_and_bounded(batch, q_len, kv_heads, group, head_dim, block_size, max_blocks, fmt):
    cfg = launch_config(batch * q_len, batch, kv_heads * group, kv_heads, head_dim, block_size, max_blocks,
                        H200_SMS, tqops.get_format(fmt))
    splits, keys = cfg["num_splits"], max_blocks * block_size
    assert splits & (splits - 1) == 0 and 1 <= splits <= 128
    assert splits == 1 or keys // splits >= 256, "a split shorter than 256 keys"
    assert cfg["block_m"] >= 16 and cfg["block_m"] >= cfg["block_q"]
    if cfg["num_warps"] == 1:  # single-warp programs: decode tiles of quantized formats on long splits only
        assert cfg["block_m"] == 16 and head_dim <= 128 and tqops.get_format(fmt).key_mode != "dense"
        assert keys // splits >= 256 and splits >= 2
    if cfg["keys_as_m"]:  # measured faster only for 32-row tiles of quantized formats at head_dim 128
        assert cfg["block_m"] == 32 and head_dim == 128 and cfg["num_warps"] == 4 and cfg["block_n"] == 128
        assert tqops.get_format(fmt).key_mode != "dense"


@pytest.mark.parametrize("fmt,warps,splits", [("bf16", 2, 2), ("fp8_e4m3", 1, 4), ("turboquant_k8v4", 1, 4),
                                              ("turboquant_4bit_nc", 1, 4), ("turboquant_3bit_nc", 1, 4)])
def test_decode_32x8k_tiles(fmt, warps, splits):
    # The attention benchmark's 32 x 8K decode shape (32 q heads, 8 kv heads): quantized formats run one warp per
    # program with twice the splits of the dense tiles.
    cfg = launch_config(32, 32, 32, 8, 128, 16, 512, H200_SMS, tqops.get_format(fmt))
    assert (cfg["num_warps"], cfg["num_splits"]) == (warps, splits)


@pytest.mark.parametrize("fmt,batch,warps,splits", [("turboquant_4bit_nc", 1, 2, 128), ("turboquant_4bit_nc", 8, 2, 32),
                                                    ("bf16", 1, 4, 64), ("bf16", 8, 4, 16)])
def test_qwen3_5_decode_tiles_at_head_dim_256(fmt, batch, warps, splits):
    # The hybrid Qwen3.5-9B attention (16 q / 4 kv heads, head_dim 256, 32K keys): 4-bit MSE decode tiles of 32 keys
    # run 2 warps with twice the splits (the attention sweep's fastest correct config), dense tiles 4 warps.
    cfg = launch_config(batch, batch, 16, 4, 256, 16, 2048, H200_SMS, tqops.get_format(fmt))
    assert (cfg["block_n"], cfg["num_warps"], cfg["num_splits"]) == (32, warps, splits)


@pytest.mark.parametrize("fmt,block_n,stages", [("turboquant_4bit_nc", 16, 1), ("bf16", 32, 2), ("fp8_e4m3", 32, 1)])
@pytest.mark.parametrize("batch", [1, 8])
def test_qwen3_5_verify_tiles_at_head_dim_256(fmt, block_n, stages, batch):
    # The hybrid Qwen3.5-9B verify (q_len 16, group 4: 64-row tiles, head_dim 256): 4-bit MSE tiles of 16 keys and
    # dense tiles pipelined 2 stages, both with block ids ahead (the attention sweep's fastest correct configs).
    cfg = launch_config(16 * batch, batch, 16, 4, 256, 16, 2048, H200_SMS, tqops.get_format(fmt))
    assert cfg["block_m"] == 64
    assert (cfg["block_n"], cfg["num_stages"], cfg["prefetch"], cfg["ids_ahead"]) == (block_n, stages, False, True)


@pytest.mark.parametrize("fmt", tqops.FORMATS)
@pytest.mark.parametrize("batch", [1, 8])
def test_e2e_verify_tiles_put_keys_on_m(fmt, batch):
    # The e2e verify / draft shape (16 q / 8 kv heads, q_len 16, 8K keys): 32-row tiles, keys as M where it won.
    cfg = launch_config(16 * batch, batch, 16, 8, 128, 16, 512, H200_SMS, tqops.get_format(fmt))
    assert cfg["block_m"] == 32
    assert cfg["keys_as_m"] == (fmt not in ("bf16", "fp16"))


@pytest.mark.parametrize("fmt,q_heads,q_len,ids_ahead", [
    ("turboquant_4bit_nc", 16, 16, True),  # keys-as-M verify tiles (e2e): block ids ahead
    ("turboquant_4bit_nc", 32, 16, False),  # 64-row tiles: 7-11% slower with them
    ("turboquant_k8v4", 32, 1, False),  # one-warp decode: 7-12% slower with them
    ("turboquant_k8v4", 32, 16, True),
    ("fp8_e4m3", 32, 1, True),
    ("turboquant_3bit_nc", 32, 16, True),
])
def test_block_ids_ahead_where_measured_faster(fmt, q_heads, q_len, ids_ahead):
    cfg = launch_config(32 * q_len, 32, q_heads, 8, 128, 16, 512, H200_SMS, tqops.get_format(fmt))
    assert cfg["ids_ahead"] == ids_ahead


@pytest.mark.parametrize("fmt", tqops.FORMATS)
def test_row_loads_only_for_3bit_keys_beside_4bit_values(fmt):
    # Measured faster for turboquant_k3v4_nc's keys-as-M tiles only; 3bit_nc (3-bit values too) got slower.
    cfg = launch_config(16 * 8, 8, 16, 8, 128, 16, 512, H200_SMS, tqops.get_format(fmt))
    assert cfg["row_loads"] == (fmt == "turboquant_k3v4_nc")


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("batch,context,q_heads,q_len", [(1, 8192, 16, 1), (32, 8192, 32, 1), (8, 8192, 16, 16),
                                                         (32, 8192, 32, 16)],
                         ids=["e2e-decode-b1", "decode-32x8k", "e2e-verify", "verify-64-rows"])
def test_dense_tiles_are_pipelined(fmt, batch, context, q_heads, q_len):
    # Dense tiles load through Triton's 3-stage pipeline rather than a register prefetch (faster at every measured
    # shape on an H200, docs/tuning.md); wider heads keep the register prefetch up to 32 rows and pipeline 2 stages
    # of 64-row tiles.
    cfg = launch_config(batch * q_len, batch, q_heads, 8, 128, 16, context // 16, H200_SMS, tqops.get_format(fmt))
    assert (cfg["num_stages"], cfg["prefetch"]) == (3, False)
    wide = launch_config(batch * q_len, batch, q_heads, 8, 256, 16, context // 16, H200_SMS, tqops.get_format(fmt))
    narrow = wide["block_m"] <= 32
    assert (wide["num_stages"], wide["prefetch"]) == ((1, True) if narrow else (2, False))


@pytest.mark.parametrize("fmt", [f for f in tqops.FORMATS if tqops.get_format(f).key_mode != "dense"])
def test_quantized_tiles_are_not_pipelined(fmt):
    for q_len in (1, 16):
        cfg = launch_config(32 * q_len, 32, 32, 8, 128, 16, 512, H200_SMS, tqops.get_format(fmt))
        assert cfg["num_stages"] == 1


@pytest.mark.parametrize("fmt,prefetch_l2", [("fp8_e4m3", True), ("fp8_e5m2", True), ("turboquant_k8v4", False),
                                             ("turboquant_4bit_nc", False), ("turboquant_3bit_nc", False)])
def test_64_row_tiles_prefetch_l2_for_fp8_only(fmt, prefetch_l2):
    # 32 x 8K, q_len 16, 32 q heads: 64-row tiles. fp8 gains 6% from the L2 prefetch there, turboquant_k8v4 loses.
    cfg = launch_config(32 * 16, 32, 32, 8, 128, 16, 512, H200_SMS, tqops.get_format(fmt))
    assert cfg["block_m"] == 64 and cfg["prefetch_l2"] == prefetch_l2


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "turboquant_4bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("batch,context,splits", [(32, 8192, 1), (16, 8192, 2), (8, 8192, 4), (4, 8192, 8),
                                                  (1, 32768, 32), (1, 131072, 32)],
                         ids=["32x8k", "16x8k", "8x8k", "4x8k", "1x32k", "1x128k"])
def test_verify_tiles_fill_one_wave(fmt, batch, context, splits):
    # q_len 16 at 32 q heads (64-row tiles): the split count each shape was fastest at on an H100 (docs/tuning.md):
    # the fewest that give about 2 programs per SM. 32 x 8K's 256 tiles-with-rows need no split.
    cfg = launch_config(16 * batch, batch, 32, 8, 128, 16, context // 16, H200_SMS, tqops.get_format(fmt))
    assert cfg["block_m"] == 64 and cfg["num_splits"] == splits


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 64), q_len=st.sampled_from([16, 37]), group=st.sampled_from([2, 4, 8]),
       max_blocks=st.integers(1, 8192))
def test_multi_token_splits_are_the_fewest_that_fill_a_wave(batch, q_len, group, max_blocks):
    cfg = launch_config(batch * q_len, batch, 8 * group, 8, 128, 16, max_blocks, H200_SMS, tqops.get_format("bf16"))
    assert cfg["block_m"] > 16
    programs = -(-batch * q_len // cfg["block_q"]) * 8
    wave = 0.9 * 2 * H200_SMS
    splits = cfg["num_splits"]
    assert splits == 1 or programs * splits // 2 < wave, "a split more than one wave needs"
    capped = splits * 2 > min(64, max(1, max_blocks * 16 // 256))
    assert capped or programs * splits >= wave, "fewer programs than one wave while splits were allowed"
