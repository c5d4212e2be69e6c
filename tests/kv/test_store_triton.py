"""The fused Triton kv_store against the torch reference, byte for byte (CPU: TRITON_INTERPRET=1)."""
import importlib
import math
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the kernel's @triton.jit, which picks compiled vs interpreted at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import tqops  # noqa: E402
from tqops.kv import triton_store  # noqa: E402
from tqops.kv.store_configs import candidate_configs  # noqa: E402
from tqops.kv.naive import kv_store_naive, unpack_codes  # noqa: E402
from tqops.quant import lloyd_max, rotation_matrix  # noqa: E402

if not torch.cuda.is_available() and not triton_store._interpreted():
    # Something imported the module before TRITON_INTERPRET was set; rebuild the kernels interpreted.
    triton_store = importlib.reload(triton_store)

INTERPRETED = triton_store._interpreted()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_compiled_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device and compiled (not interpreted) Triton"
)

NUM_BLOCKS, BLOCK_SIZE = 2, 16


# ---- comparison against the reference ---------------------------------------------------------


def _ordered(bits: torch.Tensor, sign_bit: int) -> torch.Tensor:
    """Sign-magnitude float bits (int64) -> integers whose difference counts ulps."""
    mag = bits & ((1 << sign_bit) - 1)
    return torch.where((bits >> sign_bit) & 1 == 1, -mag, mag)


def _half_bits(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian -> int64 fp16 bits."""
    b = b.long()
    return b[..., 0] | (b[..., 1] << 8)


def _half_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (_ordered(_half_bits(a), 15) - _ordered(_half_bits(b), 15)).abs()


def _fp8_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (_ordered(a.long(), 7) - _ordered(b.long(), 7)).abs()


def _check_mse_keys(ref, out, key, fmt, d):
    nb, bits = fmt.key_code_bytes(d), fmt.key_bits
    code_ref, code_out = unpack_codes(ref[..., :nb], bits), unpack_codes(out[..., :nb], bits)
    # Where the codes differ, the reference's pre-bucket value must sit on a boundary up to float rounding.
    x = key.double()
    z = (x @ rotation_matrix(d, x.device).double()) * (d**0.5 / x.norm(dim=-1, keepdim=True).clamp_min(1e-30))
    bounds = lloyd_max(bits)[1].to(x.device).double()
    near = (z.unsqueeze(-1) - bounds).abs().amin(-1) < 1e-5
    differ = code_ref != code_out
    assert bool((~differ | near).all()), f"{int((differ & ~near).sum())} key codes differ away from a boundary"
    assert int((code_ref - code_out).abs().max()) <= 1
    # The stored norm folds in 1/||c||: where a code flipped, hold it to the kernel's own codes (one flip between
    # the outer centroids moves ||c|| by ~1%), elsewhere to the reference bytes.
    centroids = lloyd_max(bits)[0].to(x.device).double()
    c_norm = centroids[code_out].norm(dim=-1) if fmt.norm_correction else torch.full_like(x[..., 0], d**0.5)
    expected = _half_bits(_half_bytes_of((x.norm(dim=-1) / c_norm).float()))
    ulps_expected = (_ordered(expected, 15) - _ordered(_half_bits(out[..., nb : nb + 2]), 15)).abs()
    assert int(ulps_expected.max()) <= 1, f"key norms off by up to {int(ulps_expected.max())} fp16 ulps"
    ulps = _half_ulps(ref[..., nb : nb + 2], out[..., nb : nb + 2])
    same_codes = ~differ.any(-1)
    assert bool((ulps[same_codes] <= 1).all()), "key norms differ from the reference by more than 1 fp16 ulp"
    return int(differ.sum())


def _half_bytes_of(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).unsqueeze(-1).view(torch.uint8)


def _check_uniform_values(ref, out, value, fmt, d):
    nb, bits = fmt.value_code_bytes(d), fmt.value_bits
    scale_ulps = _half_ulps(ref[..., nb : nb + 2], out[..., nb : nb + 2])
    zero_ulps = _half_ulps(ref[..., nb + 2 : nb + 4], out[..., nb + 2 : nb + 4])
    assert int(scale_ulps.max()) <= 1 and int(zero_ulps.max()) <= 1, "value scale/zero differ by more than 1 ulp"
    same_params = (scale_ulps == 0) & (zero_ulps == 0)
    code_ref, code_out = unpack_codes(ref[..., :nb], bits), unpack_codes(out[..., :nb], bits)
    scale = ref[..., nb : nb + 2].contiguous().view(torch.float16).float()
    zero = ref[..., nb + 2 : nb + 4].contiguous().view(torch.float16).float()
    q = torch.where(scale > 0, (value.float() - zero) / scale, torch.zeros_like(value.float()))
    tie = ((q - torch.floor(q)) - 0.5).abs() < 1e-4
    differ = code_ref != code_out
    ok = ~differ | tie | ~same_params.unsqueeze(-1)
    assert bool(ok.all()), f"{int((~ok).sum())} value codes differ with identical scale/zero"
    assert int((code_ref - code_out).abs().max()) <= 1
    return int(differ.sum())


def assert_matches_reference(ref_cache, out_cache, key, value, slot_mapping, fmt, d):
    """ref_cache/out_cache started as identical 0xFF caches; ref went through kv_store_naive."""
    num_heads, slot_bytes = ref_cache.shape[2], ref_cache.shape[3]
    ref, out = ref_cache.view(-1, num_heads, slot_bytes), out_cache.view(-1, num_heads, slot_bytes)
    keep = (slot_mapping >= 0) & (slot_mapping < ref.shape[0])
    slots = slot_mapping[keep].long()
    untouched = torch.ones(ref.shape[0], dtype=torch.bool, device=ref.device)
    untouched[slots] = False
    assert bool((out[untouched] == 0xFF).all()), "a slot that no token maps to was written"
    assert bool((ref[untouched] == 0xFF).all())
    if fmt.key_mode == "dense":
        assert torch.equal(ref, out)
        return
    if slots.numel() == 0:
        return
    r, o = ref[slots], out[slots]
    k, v = key[keep].float(), value[keep].float()
    kb, vo = fmt.key_bytes(d), fmt.value_offset(d)
    if fmt.key_mode == "fp8":
        assert int(_fp8_ulps(r[..., :kb], o[..., :kb]).max()) <= (0 if INTERPRETED else 1)
    else:
        _check_mse_keys(r[..., :kb], o[..., :kb], k, fmt, d)
    if fmt.value_mode == "fp8":
        assert int(_fp8_ulps(r[..., vo:], o[..., vo:]).max()) <= (0 if INTERPRETED else 1)
    else:
        _check_uniform_values(r[..., vo:], o[..., vo:], v, fmt, d)


def run_both(key, value, slot_mapping, fmt, d, num_heads, k_scale=1.0, v_scale=1.0, num_blocks=NUM_BLOCKS,
             block_size=BLOCK_SIZE, ref_slot_mapping=None, config=None):
    """Store with the reference and the kernel into 0xFF caches and compare."""
    shape = (num_blocks, block_size, num_heads, fmt.slot_bytes(d))
    # The kernel's cache sits inside guard bytes that a stray (out-of-range slot) write would hit.
    pad = 64 * math.ceil(8 * num_heads * fmt.slot_bytes(d) / 64)
    backing = torch.full((math.prod(shape) + 2 * pad,), 0xFF, dtype=torch.uint8, device=key.device)
    cache = backing[pad:-pad].view(shape)
    ref = cache.clone()
    kv_store_naive(key, value, ref, slot_mapping if ref_slot_mapping is None else ref_slot_mapping, fmt,
                   k_scale, v_scale)
    if config is None:
        triton_store.kv_store_triton(key, value, cache, slot_mapping, fmt, k_scale, v_scale)
    else:
        triton_store.launch(key, value, cache, slot_mapping, fmt, k_scale, v_scale, **config)
    assert bool((backing[:pad] == 0xFF).all()) and bool((backing[-pad:] == 0xFF).all()), "wrote outside the cache"
    assert_matches_reference(ref, cache, key, value, slot_mapping, fmt, d)
    return ref, cache


# ---- small cases (interpreter on CPU, compiled on CUDA) --------------------------------------------


def _case(name: str, d: int, gen: torch.Generator):
    """(key, value, slot_mapping, k_scale, v_scale, ref_slot_mapping, num_heads) for a named case."""
    num_slots = NUM_BLOCKS * BLOCK_SIZE
    heads, n, dtype, k_scale, v_scale, ref_slots = 2, 19, torch.bfloat16, 1.0, 1.0, None
    slots = torch.randperm(num_slots, generator=gen)
    if name == "empty":
        n = 0
    elif name == "one_token":
        n, heads = 1, 1
    elif name == "fp16_holes":
        dtype = torch.float16
    elif name == "fp32_wide_range":
        dtype, k_scale, v_scale, n = torch.float32, 0.37, 1.7, 7  # general scales: true division
    elif name == "pow2_scales":
        k_scale, v_scale, n = 0.25, 8.0, 5  # exact reciprocals: multiplied
    key = torch.randn(n, heads, d, generator=gen)
    value = torch.randn(n, heads, d, generator=gen) + 0.5
    if name == "fp32_wide_range":
        # Magnitudes from 1e-6 to 1e4: fp8 subnormals and saturation, far-from-unit norms.
        key = key * torch.logspace(-6, 4, n).view(n, 1, 1)
        value = value * torch.logspace(4, -6, n).view(n, 1, 1)
    if name == "degenerate":
        key[::3] = 0  # zero norm
        value[1::3] = 2.5  # constant row: scale 0
    slot_mapping = slots[:n].clone()
    if name in ("odd_shuffled_holes", "fp16_holes", "noncontig_int64", "degenerate"):
        slot_mapping[torch.rand(n, generator=gen) < 0.3] = -1
    if name == "out_of_range_slots":
        slot_mapping[::4] = num_slots + torch.arange(len(slot_mapping[::4]))  # past the end
        slot_mapping[1] = -7
        ref_slots = torch.where(slot_mapping >= num_slots, -1, slot_mapping)
    slot_mapping = slot_mapping.to(torch.int64 if name in ("noncontig_int64", "out_of_range_slots") else torch.int32)
    key, value = key.to(dtype), value.to(dtype)
    if name == "noncontig_int64":
        # Slices of a fused qkv projection output: token stride 3 * heads * d.
        qkv = torch.randn(n, 3 * heads, d, generator=gen).to(dtype)
        key, value = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
        assert not key.is_contiguous()
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(key), to(value), to(slot_mapping), k_scale, v_scale, to(ref_slots), heads


CASES = ("empty", "one_token", "odd_shuffled_holes", "fp16_holes", "fp32_wide_range", "pow2_scales",
         "noncontig_int64", "degenerate", "out_of_range_slots")


# The smoke tier takes head_dim 128 with holes in a shuffled slot mapping, for every format.
@pytest.mark.parametrize("head_dim,case", [
    pytest.param(d, c, id=f"d{d}-{c}", marks=pytest.mark.smoke if (d, c) == (128, "odd_shuffled_holes") else ())
    for d in (64, 128) for c in CASES])
@pytest.mark.parametrize("fmt_name", tqops.FORMATS)
def test_matches_reference(fmt_name, head_dim, case):
    fmt = tqops.get_format(fmt_name)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt_name}/{head_dim}/{case}".encode()))
    key, value, slot_mapping, k_scale, v_scale, ref_slots, heads = _case(case, head_dim, gen)
    run_both(key, value, slot_mapping, fmt, head_dim, heads, k_scale, v_scale, ref_slot_mapping=ref_slots)


@pytest.mark.parametrize("fmt_name,head_dim", [(f, 256) for f in tqops.FORMATS if f.startswith("turbo")]
                         + [(f, d) for f in tqops.FORMATS[:4] for d in (8, 40)],
                         ids=lambda x: x if isinstance(x, str) else f"d{x}")
def test_other_head_dims(fmt_name, head_dim):
    fmt = tqops.get_format(fmt_name)
    gen = torch.Generator().manual_seed(head_dim)
    key, value, slot_mapping, *_ = _case("odd_shuffled_holes", head_dim, gen)
    run_both(key, value, slot_mapping, fmt, head_dim, 2)


MSE_FORMATS = [f for f in tqops.FORMATS if tqops.get_format(f).key_mode == "mse"]
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=("bf16", "fp32"))
@pytest.mark.parametrize("fmt_name", MSE_FORMATS)
def test_general_kernel_mse_keys_persistent_grid(fmt_name, dtype):
    """MSE keys through the general kernel (a tuning candidate; the rows kernel is the default), launched with
    fewer programs than row blocks (grid-stride loop)."""
    fmt = tqops.get_format(fmt_name)
    d, heads, n = 128, 2, 29
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(n, heads, d, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(n, heads, d, generator=gen).to(dtype).to(DEVICE)
    slot_mapping = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:n].to(DEVICE)
    slot_mapping[5] = -1
    cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, heads, fmt.slot_bytes(d)), 0xFF, dtype=torch.uint8, device=DEVICE)
    ref = cache.clone()
    kv_store_naive(key, value, ref, slot_mapping, fmt, 1.0, 1.0)
    cfg = dict(triton_store.default_config(fmt, d, dtype), block_r=16, rows=False)
    cfg["programs_per_sm"] = 1 if INTERPRETED else 0  # on CPU one program walks all row blocks
    triton_store.launch(key, value, cache, slot_mapping, fmt, 1.0, 1.0, **cfg)
    assert_matches_reference(ref, cache, key, value, slot_mapping, fmt, d)


@pytest.mark.parametrize("counts", (False, True), ids=("select_tree", "centroid_counts"))
@pytest.mark.parametrize("block_r", (1, 4, 32), ids=lambda r: f"r{r}")
@pytest.mark.parametrize("head_dim", (64, 128, 256), ids=lambda d: f"d{d}")
@pytest.mark.parametrize("fmt_name", MSE_FORMATS)
def test_rows_kernel_layouts(fmt_name, head_dim, block_r, counts):
    """The row-per-thread kernel at 1 to 32 threads per row, both norm corrections, every head_dim (so every
    sign word); one-hot keys put every coordinate in one bucket (the largest centroid count), zero keys in the
    smallest, and a constant value row has scale 0."""
    fmt = tqops.get_format(fmt_name)
    heads, n = 2, 29
    gen = torch.Generator().manual_seed(head_dim + block_r)
    key = torch.randn(n, heads, head_dim, generator=gen)
    key[3] = 0.0
    key[4] = torch.nn.functional.one_hot(torch.tensor([5, 17]), head_dim).float() * 3.0
    value = torch.randn(n, heads, head_dim, generator=gen)
    slot_mapping = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:n]
    value[5] = 1.25
    slot_mapping[7] = -1
    cfg = dict(triton_store.default_config(fmt, head_dim, torch.bfloat16), rows=True, block_r=block_r,
               num_warps=1, c2_counts=counts)
    run_both(key.to(torch.bfloat16).to(DEVICE), value.to(torch.bfloat16).to(DEVICE), slot_mapping.to(DEVICE), fmt,
             head_dim, heads, config=cfg)


@pytest.mark.parametrize("case", ("odd_shuffled_holes", "fp32_wide_range", "degenerate"))
@pytest.mark.parametrize("fmt_name", MSE_FORMATS)
def test_general_kernel_mse(fmt_name, case):
    """The [rows, channels] kernel, which MSE formats no longer use by default, still matches the reference."""
    fmt = tqops.get_format(fmt_name)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt_name}/{case}/general".encode()))
    key, value, slot_mapping, k_scale, v_scale, ref_slots, heads = _case(case, 64, gen)
    cfg = dict(triton_store.default_config(fmt, 64, key.dtype), rows=False, block_r=16, num_warps=4)
    run_both(key, value, slot_mapping, fmt, 64, heads, k_scale, v_scale, ref_slot_mapping=ref_slots, config=cfg)


@pytest.mark.parametrize("fmt_name", ["fp8_e4m3", "fp8_e5m2", "bf16"])
def test_rounding_edges(fmt_name):
    """Every finite code, every midpoint (ties to even) and its neighbours, subnormals, saturation."""
    fmt = tqops.get_format(fmt_name)
    if fmt.fp8_dtype is not None:
        reps = torch.arange(256, dtype=torch.uint8).view(fmt.fp8_dtype).float()
        reps = reps[torch.isfinite(reps)].sort().values
        mids = (reps[1:] + reps[:-1]) / 2
        big = torch.tensor(1e30)
        vals = torch.cat([reps, mids, mids.nextafter(big), mids.nextafter(-big), reps * 1.01,
                          torch.tensor([1e6, -1e6])])
    else:
        gen = torch.Generator().manual_seed(1)
        bits = torch.randint(-(2**31), 2**31 - 1, (4000,), generator=gen, dtype=torch.int64).to(torch.int32)
        vals = bits.view(torch.float32)
        vals = torch.cat([vals[torch.isfinite(vals)], torch.tensor([3.3e38, -3.3e38, 1e-40, -1e-45])])
    d = 64
    n = math.ceil(vals.numel() / d)
    vals = torch.cat([vals, torch.zeros(n * d - vals.numel())]).view(n, 1, d).to(DEVICE)
    slot_mapping = torch.arange(n, device=DEVICE)
    run_both(vals, vals.flip(0), slot_mapping, fmt, d, 1, num_blocks=n, block_size=1)


def test_num_tokens_zero_launches_nothing():
    fmt = tqops.get_format("turboquant_4bit_nc")
    cache = torch.full((1, 16, 1, fmt.slot_bytes(64)), 0xFF, dtype=torch.uint8, device=DEVICE)
    empty = torch.empty(0, 1, 64, device=DEVICE)
    triton_store.kv_store_triton(empty, empty, cache, torch.empty(0, dtype=torch.int32, device=DEVICE), fmt, 1.0, 1.0)
    assert bool((cache == 0xFF).all())


# ---- CUDA: full size, and graph capture ---------------------------------------------------------------


CANDIDATES = sorted({name for f in tqops.FORMATS for name in candidate_configs(f)})


@pytest.mark.gpu
@needs_compiled_cuda
@pytest.mark.parametrize("config", CANDIDATES)
@pytest.mark.parametrize("fmt_name", tqops.FORMATS)
def test_cuda_large(fmt_name, config):
    """4096 tokens x 8 heads x 128 against the reference on the same GPU, for every tuning candidate."""
    fmt = tqops.get_format(fmt_name)
    candidates = candidate_configs(fmt)
    if config not in candidates:
        pytest.skip(f"{config} does not apply to {fmt_name}")
    n, heads, d = 4096, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(7)
    key = torch.randn(n, heads, d, device="cuda", generator=gen).to(torch.bfloat16)
    value = (torch.randn(n, heads, d, device="cuda", generator=gen) * 2 + 0.5).to(torch.bfloat16)
    num_blocks, block_size = 300, 16
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:n]
    slot_mapping = torch.where(torch.rand(n, device="cuda", generator=gen) < 0.1, -1, slots)
    # The default goes through the public entry point.
    cfg = None if config == "default" else candidates[config]
    run_both(key, value, slot_mapping, fmt, d, heads, num_blocks=num_blocks, block_size=block_size, config=cfg)


@pytest.mark.gpu
@needs_compiled_cuda
@pytest.mark.parametrize("fmt_name", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_cuda_persistent_grid(fmt_name):
    """One program per SM walking the row blocks writes the same bytes as one program per block."""
    fmt = tqops.get_format(fmt_name)
    n, heads, d = 3000, 8, 128
    key = torch.randn(n, heads, d, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(n, heads, d, device="cuda", dtype=torch.bfloat16)
    slot_mapping = torch.randperm(n + 100, device="cuda")[:n]
    caches = []
    for programs_per_sm in (0, 1):
        cache = torch.full((n + 100, 1, heads, fmt.slot_bytes(d)), 0xFF, dtype=torch.uint8, device="cuda")
        cfg = dict(triton_store.default_config(fmt, d, key.dtype), programs_per_sm=programs_per_sm)
        triton_store.launch(key, value, cache, slot_mapping, fmt, 1.0, 1.0, **cfg)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])


@pytest.mark.gpu
@needs_compiled_cuda
@pytest.mark.parametrize("fmt_name", ["turboquant_k3v4_nc", "fp8_e5m2"])
def test_cuda_graph_replay(fmt_name):
    """One capture, replayed with new K/V and slots written into the same static buffers."""
    fmt = tqops.get_format(fmt_name)
    n, heads, d, num_blocks, block_size = 64, 4, 128, 8, 16
    key = torch.randn(n, heads, d, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(n, heads, d, device="cuda", dtype=torch.bfloat16)
    slot_mapping = torch.arange(n, device="cuda", dtype=torch.int64)
    cache = torch.full((num_blocks, block_size, heads, fmt.slot_bytes(d)), 0xFF, dtype=torch.uint8, device="cuda")
    triton_store.kv_store_triton(key, value, cache, slot_mapping, fmt, 1.0, 1.0)  # warm-up: compile, tables
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_store.kv_store_triton(key, value, cache, slot_mapping, fmt, 1.0, 1.0)
    for step in range(2):
        cache.fill_(0xFF)
        key.copy_(torch.randn_like(key))
        value.copy_(torch.randn_like(value))
        perm = torch.randperm(num_blocks * block_size, device="cuda")[:n]
        slot_mapping.copy_(torch.where(torch.arange(n, device="cuda") % 5 == step, -1, perm))
        graph.replay()
        ref = torch.full_like(cache, 0xFF)
        kv_store_naive(key, value, ref, slot_mapping, fmt, 1.0, 1.0)
        assert_matches_reference(ref, cache, key, value, slot_mapping, fmt, d)


@pytest.mark.gpu
@needs_compiled_cuda
@pytest.mark.parametrize("fmt_name", ["bf16", "fp8_e4m3", "fp8_e5m2"])
def test_cuda_soft_cast_matches_hardware(fmt_name):
    """The integer-math casts the interpreter runs agree with the GPU's cvt instructions."""
    fmt = tqops.get_format(fmt_name)
    n, heads, d = 256, 2, 128
    key = torch.randn(n, heads, d, device="cuda") * torch.logspace(-8, 5, n, device="cuda").view(n, 1, 1)
    value = key.flip(0)
    slot_mapping = torch.arange(n, device="cuda")
    caches = []
    for soft in (False, True):
        cache = torch.full((n, 1, heads, fmt.slot_bytes(d)), 0xFF, dtype=torch.uint8, device="cuda")
        cfg = dict(triton_store.default_config(fmt, d, key.dtype), soft_cast=soft)
        triton_store.launch(key, value, cache, slot_mapping, fmt, 1.0, 1.0, **cfg)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
