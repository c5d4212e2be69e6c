"""The sm_90 verify kernel of turboquant_4bit_nc (tqops.attention.cuda_verify): when it is taken, and its output
against the torch reference on odd shapes, directly, through the public op and inside a CUDA-graph capture (its tensor
map: test_cuda_tensor_map.py)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tqops
from tqops.attention import cuda_launch, cuda_paged, cuda_verify
from tqops.attention.naive import paged_attention_naive

from .cases import make_case

pytestmark = pytest.mark.smoke

FMT = cuda_launch.VERIFY_FORMAT.name
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _eligible(**over):
    args = dict(fmt=FMT, head_dim=128, query_dtype=torch.bfloat16, group=4, sliding_window=None, cache_ptr=512,
                block_stride=16 * 8 * 134, slot_stride=8 * 134, capability=(9, 0), avg_q_len=16,
                table_keys=8 * 32768, block_size=16)
    args.update(over)
    return cuda_launch.verify_eligible(**dict(args, fmt=tqops.get_format(args["fmt"])))


def test_eligible_takes_the_qwen3_verify_shape():
    assert _eligible()
    assert _eligible(query_dtype=torch.float16, table_keys=cuda_launch.VERIFY_MIN_TABLE_KEYS)
    assert _eligible(group=8, avg_q_len=8)
    assert _eligible(group=3, avg_q_len=21)  # 63 rows
    assert _eligible(block_size=cuda_launch.VERIFY_MIN_BLOCK_SIZE) and _eligible(block_size=256)


@pytest.mark.parametrize("over", [
    dict(fmt="turboquant_3bit_nc"), dict(fmt="fp8_e4m3"), dict(head_dim=64),
    dict(query_dtype=torch.float32), dict(sliding_window=128), dict(cache_ptr=8),
    dict(slot_stride=4 * 134), dict(block_stride=16 * 4 * 134 + 8), dict(capability=(8, 0)),
    dict(capability=(10, 0)), dict(avg_q_len=1), dict(avg_q_len=8), dict(avg_q_len=15), dict(avg_q_len=17),
    dict(group=2), dict(group=8), dict(table_keys=cuda_launch.VERIFY_MIN_TABLE_KEYS - 16), dict(block_size=4),
], ids=lambda o: next(iter(o)) + "=" + str(next(iter(o.values()))))
def test_eligible_refuses(over):
    assert not _eligible(**over)


@pytest.mark.parametrize("tokens, batch, group, keys, want_splits", [
    (32 * 16, 32, 4, 8192, 1),    # 256 programs: one wave of two per SM
    (8 * 16, 8, 4, 32768, 4),     # 64 programs
    (16, 1, 2, 8192, 32),         # 8 programs, splits of 256 keys
    (8 * 16, 8, 2, 8192, 4),
])
def test_launch_shape(tokens, batch, group, keys, want_splits):
    block_q, tiles, splits = cuda_launch.verify_launch_shape(tokens, batch, group, 8, keys, 132)
    assert 1 <= block_q * group <= cuda_launch.VERIFY_ROWS
    assert tiles * block_q >= tokens  # every token has a program
    assert splits == want_splits


@st.composite
def _cases(draw):
    batch = draw(st.integers(1, 4))
    q_lens = draw(st.lists(st.integers(1, 40), min_size=batch, max_size=batch))
    ctx = draw(st.lists(st.integers(0, 1500), min_size=batch, max_size=batch))
    return dict(q_lens=q_lens, seq_lens=[q + c for q, c in zip(q_lens, ctx)],
                num_kv_heads=draw(st.sampled_from((8, 16))), group=draw(st.sampled_from((1, 2, 3, 4, 8))),
                block_size=draw(st.sampled_from((8, 16, 32, 64, 128))), causal=draw(st.booleans()),
                with_sinks=draw(st.booleans()), dtype=draw(st.sampled_from((torch.bfloat16, torch.float16))),
                seed=draw(st.integers(0, 2**31 - 1)), pad_entry=draw(st.sampled_from((0, -1, 10**6))))


def _reference(case):
    return paged_attention_naive(case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc,
                                 case.fmt, case.causal, None, case.sinks, 128**-0.5, 1.0, 1.0)


def _relative_error(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (warpgroup MMAs)")
@settings(max_examples=40, deadline=None)
@given(kw=_cases(), splits=st.sampled_from((None, 1, 2, 8)))
def test_matches_reference(kw, splits):
    case = make_case(FMT, head_dim=128, device="cuda", **kw)
    out = cuda_verify.paged_attention_verify(case.query, case.cache, case.block_table, case.seq_lens,
                                             case.query_start_loc, FMT, case.causal, case.sinks, 128**-0.5,
                                             num_splits=splits)
    assert not torch.isnan(out).any()
    assert _relative_error(out, _reference(case)) < 1.5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (warpgroup MMAs)")
def test_the_op_takes_it_for_verify_shapes(monkeypatch):
    calls = []
    verify = cuda_verify.run

    def spy(plan, query, *args, **kwargs):
        calls.append(query.shape)
        return verify(plan, query, *args, **kwargs)

    monkeypatch.setattr(cuda_verify, "run", spy)
    monkeypatch.setattr(cuda_launch, "VERIFY_MIN_TABLE_KEYS", 0)  # a small cache stands in for a long one
    case = make_case(FMT, q_lens=[16, 16], seq_lens=[700, 300], num_kv_heads=8, group=4, head_dim=128,
                     dtype=torch.bfloat16, device="cuda")
    out = tqops.paged_attention(*case.args(), causal=True)
    assert calls == [case.query.shape]
    assert _relative_error(out, _reference(case)) < 1.5e-2
    decode = make_case(FMT, q_lens=[1, 1], seq_lens=[700, 300], num_kv_heads=8, group=4, head_dim=128,
                       dtype=torch.bfloat16, device="cuda")
    tqops.paged_attention(*decode.args(), causal=True)
    assert len(calls) == 1  # decode steps stay with cuda_paged


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (warpgroup MMAs)")
def test_first_call_inside_a_cuda_graph_capture():
    # The kernels are built before capture (device_constants); the tensor map is encoded inside it, on the host.
    case = make_case(FMT, q_lens=[16, 16, 16], seq_lens=[900, 400, 1300], num_kv_heads=8, group=4, head_dim=128,
                     dtype=torch.bfloat16, device="cuda")
    cuda_verify.device_constants(case.fmt, 128, case.query.device)
    cuda_paged._tensor_map.cache_clear()  # encoded inside the capture
    run = lambda: cuda_verify.paged_attention_verify(case.query, case.cache, case.block_table, case.seq_lens,
                                                     case.query_start_loc, FMT, True, case.sinks, 128**-0.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    assert _relative_error(out, _reference(case)) < 1.5e-2
    assert torch.equal(out, run())
