"""The plan of a paged_attention call (tqops.attention.plan): the backend it picks against the dispatch rules written
out here, that it is frozen and hashable, that it reads no tensor values (meta tensors), and that running through a
plan made before gives the same bits as the calls that make their own."""
import dataclasses
import inspect
import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tqops
from tqops.attention import cuda_launch, ops
from tqops.attention.launch import launch_config
from tqops.attention.plan import AttentionPlan, DeviceProps, cuda_indices, plan_attention

from .cases import make_case
from .interp import _interpret_env, _module, paged_attention_interpreted

H200 = DeviceProps(cuda=True, index=0, sm_count=132, capability=(9, 0), nvrtc=True, interpreted=False)
CODE_BITS = {"turboquant_4bit_nc": (4, 4), "turboquant_k3v4_nc": (3, 4), "turboquant_3bit_nc": (3, 3),
             "turboquant_k8v4": (8, 4)}


def _expected_backend(fmt, head_dim, dtype, group, window, cache_ptr, block_stride, slot_stride, block_size,
                      num_tokens, batch, table_keys, device, enabled=True):
    """The dispatch as a rule table: the sm_90 verify kernel for turboquant_4bit_nc calls whose rows fill 64, the
    decode kernel for TurboQuant calls of at most 4 tokens per sequence, Triton otherwise; the reference off CUDA."""
    if not device.cuda:
        return "reference"
    if not (enabled and device.nvrtc) or head_dim != 128 or dtype not in (torch.bfloat16, torch.float16) or window:
        return "triton"
    avg_q = -(-num_tokens // max(batch, 1))
    aligned = cache_ptr % 16 == 0 and block_stride % 16 == 0
    if (fmt == "turboquant_4bit_nc" and 64 - group < avg_q * group <= 64 and aligned and slot_stride % 16 == 0
            and block_size >= 8 and device.capability == (9, 0) and table_keys >= 32768):
        return "cuda_verify"
    if fmt in CODE_BITS and group <= 16 and avg_q <= 4 and aligned and slot_stride % 8 == 0:
        fp8_keys = CODE_BITS[fmt][0] == 8
        if device.capability >= ((8, 9) if fp8_keys else (8, 0)) and (not fp8_keys or table_keys >= 32768):
            return "cuda_paged"
    return "triton"


def _meta_call(fmt, num_tokens, batch, num_q_heads, num_kv_heads, head_dim=128, block_size=16, max_blocks=64,
               dtype=torch.bfloat16, slot_pad=0, offset=0):
    """Meta tensors of a call, the cache's slots ``slot_pad`` bytes apart past their rows and its data ``offset``
    bytes past an aligned address."""
    slot = tqops.get_format(fmt).slot_bytes(head_dim)
    shape = (batch * max_blocks, block_size, num_kv_heads, slot)
    strides = (block_size * num_kv_heads * (slot + slot_pad), num_kv_heads * (slot + slot_pad), slot + slot_pad, 1)
    storage = torch.empty(shape[0] * strides[0] + offset, dtype=torch.uint8, device="meta")
    return (torch.empty(num_tokens, num_q_heads, head_dim, dtype=dtype, device="meta"),
            storage.as_strided(shape, strides, storage_offset=offset),
            torch.empty(batch, max_blocks, dtype=torch.int32, device="meta"))


@settings(max_examples=400, deadline=None)
@given(fmt=st.sampled_from(tqops.FORMATS), head_dim=st.sampled_from((64, 128, 256)),
       dtype=st.sampled_from((torch.bfloat16, torch.float16, torch.float32)),
       group=st.sampled_from((1, 2, 3, 4, 8, 16, 32)), num_kv_heads=st.sampled_from((1, 2, 4, 8, 16)),
       block_size=st.sampled_from((8, 16, 64)),
       batch=st.integers(0, 40), q_len=st.sampled_from((0, 1, 2, 4, 5, 8, 15, 16, 17, 21, 64)),
       max_blocks=st.sampled_from((1, 64, 512, 2048)), window=st.sampled_from((None, 128)),
       slot_pad=st.sampled_from((0, 0, 2, 8)), offset=st.sampled_from((0, 0, 8)),
       capability=st.sampled_from(((9, 0), (8, 9), (8, 0), (10, 0), (7, 5))), cuda=st.booleans(),
       nvrtc=st.booleans(), enabled=st.booleans())
def test_backend_follows_the_dispatch_rules(fmt, head_dim, dtype, group, num_kv_heads, block_size, batch, q_len,
                                            max_blocks, window, slot_pad, offset, capability, cuda, nvrtc, enabled):
    device = dataclasses.replace(H200, cuda=cuda, capability=capability, nvrtc=nvrtc)
    query, cache, table = _meta_call(fmt, batch * q_len, batch, group * num_kv_heads, num_kv_heads, head_dim,
                                     block_size, max_blocks, dtype, slot_pad, offset)
    with mock.patch.dict(os.environ, {"TQOPS_CUDA_ATTENTION": "1" if enabled else "0"}):
        plan = plan_attention(query, cache, table, tqops.get_format(fmt), True, window, None, device=device)
    assert plan.backend == _expected_backend(fmt, head_dim, dtype, group, window, offset, cache.stride(0),
                                             cache.stride(1), block_size, batch * q_len, batch,
                                             batch * max_blocks * block_size, device, enabled)
    assert (plan.launch is None) == (plan.backend == "reference" or batch * q_len == 0 or batch == 0)


def _plans(device=H200):
    """One plan of each backend (meta tensors: Qwen3's 8 kv heads and group 4, 8 sequences of 8K keys)."""
    yield plan_attention(*_meta_call("turboquant_4bit_nc", 128, 8, 32, 8, max_blocks=512),
                         tqops.get_format("turboquant_4bit_nc"), True, None, None, device=device)
    yield plan_attention(*_meta_call("turboquant_k3v4_nc", 8, 8, 32, 8, max_blocks=512),
                         tqops.get_format("turboquant_k3v4_nc"), True, None, torch.zeros(32, device="meta"),
                         device=device)
    yield plan_attention(*_meta_call("bf16", 8, 8, 32, 8, max_blocks=512), tqops.get_format("bf16"), False, 64,
                         None, device=device)
    yield plan_attention(*_meta_call("fp8_e4m3", 8, 8, 32, 8), tqops.get_format("fp8_e4m3"), True, None, None,
                         device=dataclasses.replace(device, cuda=False))


def test_one_plan_of_each_backend():
    assert [plan.backend for plan in _plans()] == ["cuda_verify", "cuda_paged", "triton", "reference"]


def test_plans_are_frozen_hashable_values():
    plans = list(_plans())
    assert plans == list(_plans()) and len({hash(plan) for plan in plans}) == len(plans)
    assert len({plan: i for i, plan in enumerate(plans + list(_plans()))}) == len(plans)
    for plan in plans:
        assert isinstance(plan, AttentionPlan)
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.backend = "triton"
        if plan.launch is not None:
            with pytest.raises(dataclasses.FrozenInstanceError):
                plan.launch.num_warps = 1


def test_a_plan_reads_shapes_not_values():
    # No index tensor whose values change between a captured step's replays is an argument, and meta tensors (no
    # values) give the plans real tensors of the same shapes, strides and alignment give.
    params = set(inspect.signature(plan_attention).parameters)
    assert not params & {"seq_lens", "query_start_loc", "scale", "k_scale", "v_scale"}
    fmt = tqops.get_format("turboquant_4bit_nc")
    for backend in ("cuda_verify", "cuda_paged", "triton"):
        meta = _meta_call(fmt.name, 32, 2, 16, 8, max_blocks=4)
        real = [torch.empty_like(t, device="cpu") for t in meta]
        for tensors in (meta, real):
            assert tensors[1].data_ptr() % 16 == 0
        want = plan_attention(*meta, fmt, True, None, None, backend=backend, device=H200)
        assert plan_attention(*real, fmt, True, None, None, backend=backend, device=H200) == want


@settings(max_examples=150, deadline=None)
@given(fmt=st.sampled_from(tqops.FORMATS), batch=st.integers(1, 40), q_len=st.sampled_from((1, 2, 16, 37)),
       kv_heads=st.sampled_from((1, 2, 8)), group=st.sampled_from((1, 2, 4, 8)),
       head_dim=st.sampled_from((64, 128, 256)), max_blocks=st.integers(1, 4096),
       dtype=st.sampled_from((torch.bfloat16, torch.float32)))
def test_triton_plan_carries_launch_config(fmt, batch, q_len, kv_heads, group, head_dim, max_blocks, dtype):
    query, cache, table = _meta_call(fmt, batch * q_len, batch, kv_heads * group, kv_heads, head_dim,
                                     max_blocks=max_blocks, dtype=dtype)
    plan = plan_attention(query, cache, table, tqops.get_format(fmt), True, None, None, backend="triton",
                          device=H200)
    cfg = launch_config(batch * q_len, batch, kv_heads * group, kv_heads, head_dim, 16, max_blocks, 132,
                        tqops.get_format(fmt))
    assert {key: getattr(plan.launch, key) for key in cfg} == cfg
    mse = tqops.get_format(fmt).key_mode == "mse"
    in_kernel = mse and head_dim <= 128 and batch * q_len * kv_heads * group <= 4096 and dtype != torch.float32
    assert (plan.launch.rotate_in_kernel, plan.launch.host_rotation) == (in_kernel, mse and not in_kernel)
    assert plan.launch.split_query == (dtype == torch.float32)
    overridden = plan_attention(query, cache, table, tqops.get_format(fmt), True, None, None, backend="triton",
                                device=H200, overrides=dict(num_splits=2, block_q=1, prefetch_l2=False))
    assert (overridden.launch.num_splits, overridden.launch.block_q, overridden.launch.prefetch_l2) == (2, 1, False)


def test_wrong_overrides_and_backends_are_refused():
    args = (*_meta_call("bf16", 4, 2, 4, 2), tqops.get_format("bf16"), True, None, None)
    with pytest.raises(TypeError, match="unknown launch overrides"):
        plan_attention(*args, backend="triton", device=H200, overrides=dict(splits=2))
    with pytest.raises(ValueError, match="launch overrides need a backend"):
        plan_attention(*args, device=H200, overrides=dict(num_splits=2))
    with pytest.raises(ValueError, match="backend 'cuda'"):
        plan_attention(*args, backend="cuda", device=H200)
    with pytest.raises(ValueError, match="reads turboquant"):
        plan_attention(*args, backend="cuda_paged", device=H200)
    with pytest.raises(ValueError, match="all_heads"):
        plan_attention(*_meta_call("turboquant_4bit_nc", 8, 2, 16, 16), tqops.get_format("turboquant_4bit_nc"), True,
                       None, None, backend="cuda_paged", device=H200, overrides=dict(all_heads=True))
    with pytest.raises(ValueError, match="slot stride that is a multiple of 8"):
        plan_attention(*_meta_call("turboquant_4bit_nc", 8, 2, 8, 2), tqops.get_format("turboquant_4bit_nc"), True,
                       None, None, backend="cuda_paged", device=H200)


def test_verify_and_decode_launches():
    verify, paged, *_ = _plans()
    # 8 sequences of 16 tokens x group 4: one 64-row program per (sequence, kv head), splits filling one wave
    assert (verify.launch.block_q, verify.launch.grid, verify.launch.splits) == (16, (16, 8, 4), 4)
    assert verify.launch.q_bf16 and verify.launch.device_index == 0
    # 8 one-token sequences of 8K keys: per-head programs (fewer than 128K keys over the table), fed by TMA on sm_90
    assert not paged.launch.all_heads and paged.launch.tma and paged.launch.grid[1] == 8
    assert paged.launch.bits == (3, 4) and paged.launch.copy_piece == 16
    assert paged.launch.shared_mem == cuda_launch.smem_bytes(paged.launch.num_warps, 3)


def test_the_switch_sends_plans_to_triton(monkeypatch):
    verify = next(_plans())
    assert verify.backend == "cuda_verify"
    monkeypatch.setenv("TQOPS_CUDA_ATTENTION", "0")
    assert [plan.backend for plan in _plans()] == ["triton", "triton", "triton", "reference"]


CASES = [
    dict(fmt="turboquant_4bit_nc", q_lens=[1, 5], seq_lens=[20, 37], group=2, causal=True, with_sinks=True),
    dict(fmt="turboquant_k8v4", q_lens=[3, 0, 2], seq_lens=[40, 9, 3], num_kv_heads=2, group=2, causal=False,
         sliding_window=7, k_scale=0.5),
    dict(fmt="bf16", q_lens=[16], seq_lens=[50], group=4, causal=True, dtype=torch.float16),
    dict(fmt="fp8_e5m2", q_lens=[2, 3], seq_lens=[18, 30], num_kv_heads=2, group=3, causal=False, v_scale=2.0),
]


@pytest.mark.parametrize("kw", CASES, ids=[kw["fmt"] for kw in CASES])
@pytest.mark.parametrize("overrides", [{}, dict(num_splits=2, block_n=16)], ids=["default", "overrides"])
def test_a_plan_made_before_gives_the_same_bits(kw, overrides):
    kw = dict(kw)
    case = make_case(kw.pop("fmt"), seed=3, **kw)
    args = (case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc, case.fmt, case.causal,
            case.sliding_window, case.sinks, 0.125, case.k_scale, case.v_scale)
    with _interpret_env():
        plan = _module().plan_attention(case.query, case.cache, case.block_table, case.fmt, case.causal,
                                        case.sliding_window, case.sinks, backend="triton", overrides=overrides)
    assert plan.backend == "triton" and plan.launch.interpreted
    made_here = paged_attention_interpreted(*args, **overrides)
    assert torch.equal(paged_attention_interpreted(*args, plan=plan), made_here)
    with pytest.raises(ValueError, match="no launch overrides"):
        paged_attention_interpreted(*args, plan=plan, num_splits=4)
    # the CPU op runs the reference, through its own plan or one made before
    reference = plan_attention(case.query, case.cache, case.block_table, case.fmt, case.causal, case.sliding_window,
                               case.sinks)
    assert reference.backend == "reference"
    op = torch.ops.tqops.paged_attention(*args[:5], case.fmt.name, *args[6:])
    assert torch.equal(ops.run_attention(reference, *args[:5], case.sinks, 0.125, case.k_scale, case.v_scale), op)


def test_a_plan_runs_only_the_call_it_was_made_for():
    case = make_case("bf16", q_lens=[2, 3], seq_lens=[20, 3], num_kv_heads=2, group=2, seed=0)
    plan = plan_attention(case.query, case.cache, case.block_table, case.fmt, True, None, None)
    with pytest.raises(ValueError, match="the plan was made for"):
        ops.run_attention(plan, case.query[:4], case.cache, case.block_table, case.seq_lens, case.query_start_loc,
                          None, 0.125)
    with pytest.raises(ValueError, match="no sinks"):
        ops.run_attention(plan, case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc,
                          torch.zeros(4), 0.125)


def test_cuda_backends_refuse_a_cache_the_plan_was_not_made_for():
    case = make_case("turboquant_4bit_nc", q_lens=[1, 1], seq_lens=[20, 3], num_kv_heads=4, group=2, seed=0)
    plan = plan_attention(case.query, case.cache, case.block_table, case.fmt, True, None, None, backend="cuda_paged",
                          device=H200)
    nbytes = case.cache.numel()
    buffer = torch.empty(nbytes + 32, dtype=torch.uint8)
    offset = (plan.shape.cache_align + 8 - buffer.data_ptr()) % 16  # 8 bytes past the plan's alignment
    moved = buffer[offset:offset + nbytes].view(case.cache.shape)
    with pytest.raises(AssertionError, match="another cache"):
        cuda_indices(plan, case.query, moved, case.block_table, case.seq_lens, case.query_start_loc)
