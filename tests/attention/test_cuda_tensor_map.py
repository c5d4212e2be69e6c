"""The TMA tensor maps of the CUDA kernels and their by-value launch (tqops.attention.cuda_paged), against a fake
driver on CPU: the boxes hold every head's row, maps are encoded once per cache, which kernels read one."""
import ctypes

import pytest
import torch

import tqops
from tqops.attention import cuda_launch, cuda_paged, cuda_verify

CODE_FORMATS = sorted(f for f, bits in cuda_launch.FORMATS.items() if bits[0] != 8)


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
    cuda_paged._tensor_map.cache_clear()
    yield driver
    cuda_paged._tensor_map.cache_clear()  # the fake maps


def _check_encode(call, cache, box_bytes, box_slots):
    """The one encode call: cache as [blocks][slots][slot bytes] of uint8, the given box, and every head's row inside
    the box that starts at the 16-byte boundary at or before it (where the kernels place it)."""
    (_, (address, dtype, rank, base, dims, strides, box, element_strides, *modes)) = call
    num_blocks, block_size, num_kv_heads, row = cache.shape
    slot = cache.stride(1)
    assert address.value % 64 == 0
    assert (dtype, rank, base.value) == (0, 3, cache.data_ptr())
    assert list(dims) == [slot, block_size, num_blocks] and list(strides) == [slot, cache.stride(0)]
    assert list(box) == [box_bytes, box_slots, 1] and list(element_strides) == [1, 1, 1]
    assert box_bytes % 16 == 0 and box_bytes <= 256 and box_slots <= 256  # the driver's limits on a box
    for h in range(num_kv_heads):
        start = h * cache.stride(2)
        assert start - start % 16 + box_bytes >= start + row, h
    return address.value


@pytest.mark.parametrize("block_size, num_kv_heads", [(16, 8), (8, 16), (128, 8)], ids=["bs16-h8", "bs8-h16", "bs128-h8"])
def test_verify_map_boxes_cover_every_row(fake_driver, block_size, num_kv_heads):
    cache = tqops.allocate_kv_cache(cuda_launch.VERIFY_FORMAT, 5, block_size, num_kv_heads, 128)
    first = cuda_verify.tensor_map(cache)
    assert cuda_verify.tensor_map(cache) is first and len(fake_driver.calls) == 1  # one encode per cache
    address = _check_encode(fake_driver.calls[0], cache, cuda_launch.VERIFY_STAGE_ROW, min(block_size, 64))
    assert address == first.address and first.size == 128


@pytest.mark.parametrize("fmt", CODE_FORMATS)
@pytest.mark.parametrize("num_kv_heads", [8, 16, 24], ids=["h8", "h16", "h24"])
def test_decode_map_boxes_cover_every_row(fake_driver, fmt, num_kv_heads):
    # per-head decode programs stage a 16-key M tile as one box, a staged row wide
    cache = tqops.allocate_kv_cache(tqops.get_format(fmt), 3, 32, num_kv_heads, 128)
    assert cuda_launch.copy_bytes(cache.stride(1)) == 16
    key_bits = cuda_launch.FORMATS[fmt][0]
    first = cuda_paged.tensor_map(cache, cuda_launch.stage_row_bytes(key_bits), 16)
    assert first is cuda_paged.tensor_map(cache, cuda_launch.stage_row_bytes(key_bits), 16)
    assert _check_encode(fake_driver.calls[0], cache, 160, 16) == first.address
    other = cuda_paged.tensor_map(cache, 176, 32)  # another box of the same cache is another map
    assert other is not first and len(fake_driver.calls) == 2
    cuda_paged.clear_device_constants()
    assert cuda_paged._tensor_map.cache_info().currsize == 0


def test_kernels_that_copy_with_cp_async_get_a_zero_map():
    assert cuda_paged.NO_TENSOR_MAP.size == 128 and cuda_paged.NO_TENSOR_MAP.address % 64 == 0
    assert ctypes.string_at(cuda_paged.NO_TENSOR_MAP.address, 128) == bytes(128)


@pytest.mark.parametrize("fmt", sorted(cuda_launch.FORMATS))
@pytest.mark.parametrize("capability", [(9, 0), (10, 0)], ids=["sm90", "sm100"])
def test_decode_kernel_gets_a_map_wherever_it_may_stage_by_tma(fake_driver, fmt, capability):
    # 16-byte copy pieces on sm_90 or later: a map with boxes of the format's staged row x 16 slots (which programs
    # read it is the kernel's choice)
    key_bits = cuda_launch.FORMATS[fmt][0]
    cache = tqops.allocate_kv_cache(tqops.get_format(fmt), 3, 16, 8, 128)
    cmap = cuda_paged.decode_tensor_map(cache, key_bits, 16, capability)
    assert cmap is not cuda_paged.NO_TENSOR_MAP and len(fake_driver.calls) == 1
    assert _check_encode(fake_driver.calls[0], cache, cuda_launch.stage_row_bytes(key_bits), 16) == cmap.address


@pytest.mark.parametrize("fmt", sorted(cuda_launch.FORMATS))
def test_decode_kernel_gets_the_zero_map_where_it_copies_with_cp_async(fake_driver, fmt):
    key_bits = cuda_launch.FORMATS[fmt][0]
    cache = tqops.allocate_kv_cache(tqops.get_format(fmt), 3, 16, 8, 128)
    assert cuda_paged.decode_tensor_map(cache, key_bits, 16, (8, 9)) is cuda_paged.NO_TENSOR_MAP  # TMA is sm_90's
    # 8-byte copy pieces (4 kv heads of the code formats): rows off 16-byte boundaries
    assert cuda_paged.decode_tensor_map(cache, key_bits, 8, (9, 0)) is cuda_paged.NO_TENSOR_MAP
    assert fake_driver.calls == []


def test_launch_passes_tensor_maps_by_value(fake_driver, monkeypatch):
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
