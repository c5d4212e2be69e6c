"""The CUDA kernels' sources build for sm_90 with NVRTC on any machine (the nvidia-cuda-nvrtc wheel of the test
extra, no GPU): no compile error, no register spills, the decode kernel's one-tile variants within the 128
registers its two 8-warp programs per SM assume, and the verify kernel's warpgroup MMAs not serialized by ptxas
(docs/tuning.md)."""
import ctypes
import re
from pathlib import Path

import pytest

import tqops.attention.cuda_launch as cuda_launch
import tqops.attention.cuda_paged as cuda_paged
import tqops.attention.cuda_verify as cuda_verify

nvrtc_pkg = pytest.importorskip("nvidia.cuda_nvrtc", reason="the nvidia-cuda-nvrtc wheel (test extra, Linux)")


def _build_log(names: list[str], source: Path = cuda_paged._SOURCE, arch: str = "sm_90") -> str:
    """Compile ``source`` for ``arch`` with ``names`` instantiated; return the log (ptxas -v included)."""
    lib_dir = Path(list(nvrtc_pkg.__path__)[0]) / "lib"
    lib = ctypes.CDLL(str(next(lib_dir.glob("libnvrtc.so*"))))
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(), source.name.encode(), 0, None, None) == 0
    for name in names:
        assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v", f"-I{source.parent}".encode()]
    res = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    text = log.value.decode()
    assert res == 0, text
    return text


@pytest.mark.parametrize("bits", sorted(set(cuda_launch.FORMATS.values())), ids=lambda b: f"k{b[0]}v{b[1]}")
def test_every_shipped_variant_builds_without_spills(bits):
    # The variants device_constants builds, (query tiles, warps, key tiles), for bf16 queries and one fp16 one; and
    # one key tile per iteration, which the tests still run.
    variants = ["1, 4, 2, true", "1, 8, 2, true", "2, 4, 1, true", "1, 8, 2, false", "1, 8, 1, true"]
    if bits[0] == 8:  # fp8 keys run one key tile per iteration (cuda_launch.paged_key_tiles)
        variants = sorted({v.replace(", 2, ", ", 1, ") for v in variants})
    names = [f"turboquant_attention<{v}, {bits[0]}, {bits[1]}>" for v in variants]
    # and the all-heads programs device_constants builds (one warp per kv head: 8 or 4 warps)
    kt = 1 if bits[0] == 8 else 2
    names += [f"turboquant_attention<1, {w}, {kt}, {b}, {bits[0]}, {bits[1]}, true>"
              for w in cuda_launch.ALL_HEADS_KV_HEADS for b in ("true", "false")]
    variants += ["all heads"] * 2 * len(cuda_launch.ALL_HEADS_KV_HEADS)
    # and the per-head programs with 8-byte copy pieces (slots that are a multiple of 8 bytes only: 4 kv heads)
    names += [f"turboquant_attention<{v}, {bits[0]}, {bits[1]}, false, 8>" for v in variants[:2]]
    variants += variants[:2]
    log = _build_log(names)
    # ptxas reports each entry point as: Compiling entry function '<mangled>' ... N bytes spill stores ... Used N
    # registers; mangled names carry the template arguments as ILi<n>ELi<warps>ELi<key tiles>E.
    entries = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers", log,
                         re.S)
    assert len(entries) == len(variants), log
    for mangled, spills, regs in entries:
        n_tiles, warps = (int(x) for x in re.search(r"ILi(\d+)ELi(\d+)ELi", mangled).groups())
        assert int(spills) == 0, (mangled, log)
        if n_tiles == 1:
            assert int(regs) <= 128, (mangled, regs)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_decode_kernel_builds_before_sm_90(arch):
    # TMA boxes, bulk copies and mbarrier transactions are sm_90's (common.cuh's TQ_TMA): built for an older GPU the
    # kernel copies with cp.async, and ptxas would reject any of those instructions. fp8 keys need sm_89.
    formats = sorted(b for b in set(cuda_launch.FORMATS.values()) if arch == "sm_89" or b[0] != 8)
    names = []
    for key_bits, value_bits in formats:
        kt = 1 if key_bits == 8 else 2
        names += [f"turboquant_attention<1, 8, {kt}, true, {key_bits}, {value_bits}>",
                  f"turboquant_attention<1, 8, {kt}, true, {key_bits}, {value_bits}, true>",
                  f"turboquant_attention<1, 8, {kt}, true, {key_bits}, {value_bits}, false, 8>"]
    log = _build_log(names, arch=arch)
    entries = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores", log, re.S)
    assert len(entries) == len(names), log


def test_verify_kernel_builds_without_spills_or_serialized_wgmmas():
    log = _build_log(["turboquant_verify<true>", "turboquant_verify<false>"], cuda_verify._SOURCE, "sm_90a")
    entries = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers", log,
                         re.S)
    assert len(entries) == 2, log
    for mangled, spills, regs in entries:
        assert int(spills) == 0, (mangled, log)
        # two one-warpgroup programs per SM (cuda_launch.VERIFY_PROGRAMS_PER_SM)
        assert int(regs) * cuda_launch.VERIFY_THREADS * cuda_launch.VERIFY_PROGRAMS_PER_SM <= 65536, (mangled, regs)
    # ptxas's C7510-C7520 notes: wgmmas serialized (an accumulator or A fragment touched mid-pipeline, or the loop
    # on a path it treats as divergent), which costs most of the kernel's overlap
    assert "serialized" not in log, log
