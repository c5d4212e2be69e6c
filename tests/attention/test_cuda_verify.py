"""The sm_90 verify kernel of turboquant_4bit_nc (tqops.attention.cuda_verify): when it is taken, its tensor map and
launch (a fake driver on CPU), and its output against the torch reference on odd shapes, directly, through the public
op and inside a CUDA-graph capture."""
import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tqops
from tqops.attention import cuda_verify
from tqops.attention.naive import paged_attention_naive

from .cases import make_case

FMT = cuda_verify.FORMAT
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _eligible(**over):
    args = dict(fmt_name=FMT, head_dim=128, query_dtype=torch.bfloat16, group=4, sliding_window=None, cache_ptr=512,
                block_stride=16 * 8 * 134, slot_stride=8 * 134, capability=(9, 0), avg_q_len=16,
                table_keys=8 * 32768, block_size=16)
    args.update(over)
    return cuda_verify.eligible(**args)


def test_eligible_takes_the_qwen3_verify_shape():
    assert _eligible()
    assert _eligible(query_dtype=torch.float16, table_keys=cuda_verify.MIN_TABLE_KEYS)
    assert _eligible(group=8, avg_q_len=8)
    assert _eligible(group=3, avg_q_len=21)  # 63 rows
    assert _eligible(block_size=cuda_verify.MIN_BLOCK_SIZE) and _eligible(block_size=256)


@pytest.mark.parametrize("over", [
    dict(fmt_name="turboquant_3bit_nc"), dict(fmt_name="fp8_e4m3"), dict(head_dim=64),
    dict(query_dtype=torch.float32), dict(sliding_window=128), dict(cache_ptr=8),
    dict(slot_stride=4 * 134), dict(block_stride=16 * 4 * 134 + 8), dict(capability=(8, 0)),
    dict(capability=(10, 0)), dict(avg_q_len=1), dict(avg_q_len=8), dict(avg_q_len=15), dict(avg_q_len=17),
    dict(group=2), dict(group=8), dict(table_keys=cuda_verify.MIN_TABLE_KEYS - 16), dict(block_size=4),
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
    block_q, tiles, splits = cuda_verify.launch_shape(tokens, batch, group, 8, keys, 132)
    assert 1 <= block_q * group <= cuda_verify.ROWS
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
    verify = cuda_verify.paged_attention_verify

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return verify(*args, **kwargs)

    monkeypatch.setattr(cuda_verify, "paged_attention_verify", spy)
    monkeypatch.setattr(cuda_verify, "MIN_TABLE_KEYS", 0)  # a small cache stands in for a long one
    case = make_case(FMT, q_lens=[16, 16], seq_lens=[700, 300], num_kv_heads=8, group=4, head_dim=128,
                     dtype=torch.bfloat16, device="cuda")
    out = tqops.paged_attention(*case.args(), causal=True)
    assert calls == [case.query.shape]
    assert _relative_error(out, _reference(case)) < 1.5e-2
    decode = make_case(FMT, q_lens=[1, 1], seq_lens=[700, 300], num_kv_heads=8, group=4, head_dim=128,
                       dtype=torch.bfloat16, device="cuda")
    tqops.paged_attention(*decode.args(), causal=True)
    assert len(calls) == 1  # decode steps stay with cuda_paged


class _FakeDriver:
    """Records the driver calls tensor_map and launch make (CPU: no libcuda)."""

    def __init__(self):
        self.calls = []

    def cuTensorMapEncodeTiled(self, *args):
        self.calls.append(("encode", args))
        return 0

    def cuLaunchKernel(self, *args):
        # the argument values as the driver reads them, during the call: 8 bytes behind each kernelParams entry
        self.calls.append(("launch", args, [ctypes.string_at(p, 8) for p in args[9]]))
        return 0


@pytest.fixture
def fake_driver(monkeypatch):
    driver = _FakeDriver()
    monkeypatch.setattr(torch.cuda._utils, "_get_gpu_runtime_library", lambda: driver)
    monkeypatch.setattr(torch.cuda._utils, "_check_cuda", lambda result: None)
    cuda_verify._tensor_map.cache_clear()
    yield driver
    cuda_verify._tensor_map.cache_clear()  # the fake maps


@pytest.mark.parametrize("block_size, num_kv_heads", [(16, 8), (8, 16), (128, 8)], ids=["bs16-h8", "bs8-h16", "bs128-h8"])
def test_tensor_map_boxes_cover_every_row(fake_driver, block_size, num_kv_heads):
    cache = tqops.allocate_kv_cache(tqops.get_format(FMT), 5, block_size, num_kv_heads, 128)
    first = cuda_verify.tensor_map(cache)
    assert cuda_verify.tensor_map(cache) is first and len(fake_driver.calls) == 1  # one encode per cache
    (_, (address, dtype, rank, base, dims, strides, box, element_strides, *modes)), = fake_driver.calls
    assert address.value == first.address and first.address % 64 == 0 and first.size == 128
    assert (dtype, rank, base.value) == (0, 3, cache.data_ptr())
    slot, row = cache.stride(1), cache.shape[3]
    assert list(dims) == [slot, block_size, 5] and list(strides) == [slot, cache.stride(0)]
    assert list(box) == [cuda_verify.STAGE_ROW, min(block_size, 64), 1] and list(element_strides) == [1, 1, 1]
    # the kernel's box of head h starts at the 16-byte boundary at or before its row and must hold the whole row
    for h in range(num_kv_heads):
        start = h * cache.stride(2)
        assert start - start % 16 + cuda_verify.STAGE_ROW >= start + row
    cuda_verify.clear_device_constants()
    assert cuda_verify._tensor_map.cache_info().currsize == 0


def test_launch_passes_tensor_maps_by_value(fake_driver, monkeypatch):
    from tqops.attention import cuda_paged

    class Kernel:
        func = ctypes.c_void_p(1234)

    class Stream:
        _as_parameter_ = ctypes.c_void_p(77)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream)

    t = torch.zeros(4)
    owner = ctypes.create_string_buffer(b"\x07" * 128)
    by_value = cuda_paged.ByValue(ctypes.addressof(owner), 128, owner)
    cuda_paged.launch(Kernel, (3, 2, 1), (128, 1, 1), 4096, [t, 5, 2.5, by_value])
    (_, (func, gx, gy, gz, bx, by, bz, smem, stream, params, extra), values), = fake_driver.calls
    assert (func.value, gx, gy, gz, bx, by, bz, smem, stream.value, extra) == (1234, 3, 2, 1, 128, 1, 1, 4096, 77,
                                                                            None)
    assert ctypes.c_uint64.from_buffer_copy(values[0]).value == t.data_ptr()
    assert ctypes.c_int.from_buffer_copy(values[1][:4]).value == 5
    assert ctypes.c_double.from_buffer_copy(values[2]).value == 2.5
    assert params[3] == by_value.address and values[3] == b"\x07" * 8
    with pytest.raises(TypeError, match="kernel argument 0: expected a tensor, int, float or ByValue, got str"):
        cuda_paged.launch(Kernel, (1, 1, 1), (32, 1, 1), 0, ["x"])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (warpgroup MMAs)")
def test_first_call_inside_a_cuda_graph_capture():
    # The kernels are built before capture (device_constants); the tensor map is encoded inside it, on the host.
    case = make_case(FMT, q_lens=[16, 16, 16], seq_lens=[900, 400, 1300], num_kv_heads=8, group=4, head_dim=128,
                     dtype=torch.bfloat16, device="cuda")
    cuda_verify.device_constants(case.fmt, 128, case.query.device)
    cuda_verify._tensor_map.cache_clear()
    run = lambda: cuda_verify.paged_attention_verify(case.query, case.cache, case.block_table, case.seq_lens,
                                                     case.query_start_loc, FMT, True, case.sinks, 128**-0.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    assert _relative_error(out, _reference(case)) < 1.5e-2
    assert torch.equal(out, run())
