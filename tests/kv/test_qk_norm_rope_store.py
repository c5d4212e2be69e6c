"""qk_norm_rope_store: the fused store kernel (CPU: TRITON_INTERPRET=1; CUDA: compiled) against qk_norm_rope and
kv_store run one after the other, opcheck, and bad input rejected before anything is written."""
import importlib
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' @triton.jit
pytest.importorskip("triton")

import tqops  # noqa: E402
from tqops.kv import triton_store  # noqa: E402
from tqops.kv.naive import kv_load_naive, qk_norm_rope_store_naive, unpack_codes  # noqa: E402
from tqops.kv.ops import qk_norm_rope_store  # noqa: E402
from tqops.norm import triton_norm  # noqa: E402

if not torch.cuda.is_available() and not triton_store._interpreted():
    triton_store = importlib.reload(triton_store)
    triton_norm = importlib.reload(triton_norm)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MSE = [f for f in tqops.FORMATS if tqops.get_format(f).key_mode == "mse"]
NUM_BLOCKS, BLOCK_SIZE = 3, 16


def inv_freq(head_dim: int, theta: float = 1e6) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)


def make_case(fmt, dtype, tokens, num_heads, num_kv_heads, head_dim, seed, device=DEVICE, pad=3):
    """qkv rows strided (a view into wider rows), slots shuffled with one skipped token (-1) where there are two."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(tokens, width + pad, generator=gen) * 3)[:, :width].to(dtype)
    q_weight, k_weight = ((torch.rand(head_dim, generator=gen) + 0.5).to(dtype) for _ in range(2))
    positions = torch.randint(0, 40000, (tokens,), generator=gen)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:tokens]
    if tokens > 1:
        slots[1] = -1
    cache = tqops.allocate_kv_cache(fmt, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, device=device).zero_()
    args = (qkv, q_weight, k_weight, positions, inv_freq(head_dim), num_heads, num_kv_heads, 1e-6)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), cache, slots.to(device)


def _close(fused_cache, want_cache, fmt, head_dim, dtype, v_cache=None):
    """Decoded K and V of two caches: K within a few ulps, or one step of the key format where a rounding landed the
    other side; V (untouched by the norm and rotation) equal to ``v_cache``'s (default ``want_cache``), which the
    same store kernel wrote: against the torch reference a value code may sit on the other side of a tie."""
    slots = torch.arange(NUM_BLOCKS * BLOCK_SIZE, device=fused_cache.device)
    k, v = kv_load_naive(fused_cache, slots, fmt, head_dim, 1.0, 1.0)
    k_want, v_want = kv_load_naive(want_cache, slots, fmt, head_dim, 1.0, 1.0)
    if v_cache is not None:
        v_want = kv_load_naive(v_cache, slots, fmt, head_dim, 1.0, 1.0)[1]
    torch.testing.assert_close(v, v_want, rtol=0, atol=0)
    if fmt.key_mode == "mse":
        # Codes: a key a few ulps away from the reference's (the norm's sum in another order) may cross a bucket
        # boundary, one code of a row moving one level; the decoded keys then differ in those elements only.
        nb, off = fmt.key_code_bytes(head_dim), fmt.key_norm_offset(head_dim)
        codes, want = (unpack_codes(c[..., :nb], fmt.key_bits).long() for c in (fused_cache, want_cache))
        assert (codes - want).abs().max() <= 1 and (codes != want).sum() <= max(2, 0.02 * codes.numel())
        # the stored norm (fp16; with the centroid correction of its row's codes) within a few percent
        norms, want_norms = (c[..., off:off + 2].contiguous().view(torch.float16).float() for c in
                             (fused_cache, want_cache))
        torch.testing.assert_close(norms, want_norms, rtol=0.05, atol=1e-3)
        return
    if fmt.key_mode == "dense":  # a few ulps of the coarser of the model dtype and the cache's
        eps = max(torch.finfo(dtype).eps, torch.finfo(fmt.dense_dtype).eps)
        tol = dict(rtol=4 * eps, atol=4 * eps)
    else:  # fp8 keys: one fp8 step (e5m2: 2 mantissa bits) of these O(1) keys
        tol = dict(rtol=2.0**-2, atol=2.0**-6)
    torch.testing.assert_close(k, k_want, **tol)


def _store_values(values, cache, slots, fmt, head_dim, dtype):
    """The values alone through the fused launch's kernel and tiles (zero keys): the value codes it must write."""
    cfg = triton_store.default_config(fmt, head_dim, dtype, norm_rope=True)
    triton_store.launch(torch.zeros_like(values), values, cache, slots, fmt, 1.0, 1.0, **cfg)


@given(fmt=st.sampled_from(tqops.FORMATS), dtype=st.sampled_from(sorted(DTYPES)), tokens=st.integers(2, 5),
       num_kv_heads=st.integers(1, 3), group=st.sampled_from([0, 1, 2]), head_dim=st.sampled_from([64, 80, 128]),
       seed=st.integers(0, 2**31 - 1))
def test_fused_kernel_matches_reference(fmt, dtype, tokens, num_kv_heads, group, head_dim, seed):
    fmt = tqops.get_format(fmt)
    if fmt.is_turboquant and head_dim == 80:  # 80: not a power of two (masked channels), dense and fp8 only
        head_dim = 64
    dtype = DTYPES[dtype]
    args, cache, slots = make_case(fmt, dtype, tokens, group * num_kv_heads, num_kv_heads, head_dim, seed)
    want_cache, v_cache = cache.clone(), cache.clone()
    want_q = qk_norm_rope_store_naive(*args, want_cache, slots, fmt, 1.0, 1.0)
    q = triton_store.qk_norm_rope_store_triton(*args, cache, slots, fmt, 1.0, 1.0)
    assert q.shape == want_q.shape and q.dtype == dtype and q.is_contiguous()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(q, want_q, rtol=4 * eps, atol=4 * eps)
    qkv, n_kv = args[0], num_kv_heads
    values = qkv[:, (group + 1) * n_kv * head_dim:].unflatten(-1, (n_kv, head_dim))
    _store_values(values, v_cache, slots, fmt, head_dim, dtype)
    _close(cache, want_cache, fmt, head_dim, dtype, v_cache)  # the skipped token (slot -1) wrote nothing anywhere


@pytest.mark.parametrize("fmt,tokens", [(f, 1) for f in tqops.FORMATS] + [(f, 4) for f in MSE],
                         ids=lambda v: str(v))
def test_one_token_and_long_mse_blocks_run_qk_norm_rope_then_the_store(fmt, tokens, monkeypatch):
    # One token (a batch-1 decode step) runs faster as two launches, and MSE blocks past NORM_ROPE_MSE_MAX_TOKENS
    # (here 3) store faster with the row-per-thread kernel, which takes no prologue: the op runs the two kernels
    # it replaces, so its results are theirs, bit for bit.
    monkeypatch.setattr(triton_store, "NORM_ROPE_MSE_MAX_TOKENS", 3)
    fmt = tqops.get_format(fmt)
    args, cache, slots = make_case(fmt, torch.bfloat16, tokens, 4, 2, 128, seed=3)
    want_cache = cache.clone()
    q_want, k = triton_norm.qk_norm_rope_triton(*args)
    values = args[0][:, 6 * 128:].unflatten(-1, (2, 128))
    triton_store.kv_store_triton(k, values, want_cache, slots, fmt, 1.0, 1.0)
    q = triton_store.qk_norm_rope_store_triton(*args, cache, slots, fmt, 1.0, 1.0)
    assert torch.equal(q, q_want) and torch.equal(cache, want_cache)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "turboquant_4bit_nc"])
def test_op_matches_reference_and_passes_opcheck(fmt):
    args, cache, slots = make_case(fmt, torch.bfloat16, 3, 4, 2, 64, seed=1, device="cpu")
    want_cache = cache.clone()
    want_q = qk_norm_rope_store_naive(*args, want_cache, slots, tqops.get_format(fmt), 1.0, 1.0)
    q = qk_norm_rope_store(*args, cache, slots, fmt)
    assert torch.equal(q, want_q) and torch.equal(cache, want_cache)
    torch.library.opcheck(torch.ops.tqops.qk_norm_rope_store, (*args, cache, slots, fmt, 1.0, 1.0))


def _bad(over):
    args, cache, slots = make_case("bf16", torch.bfloat16, 3, 4, 2, 64, seed=2, device="cpu")
    qkv, q_weight, k_weight, positions, freqs, num_heads, num_kv_heads, eps = args
    kw = dict(qkv=qkv, q_weight=q_weight, k_weight=k_weight, positions=positions, inv_freq=freqs,
              num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps, kv_cache=cache, slot_mapping=slots, fmt="bf16")
    kw.update(over(kw))
    return kw


@pytest.mark.parametrize("over,match", [
    (lambda kw: dict(qkv=kw["qkv"][:, :-64]), r"qkv has shape \(3, 448\); expected \[num_tokens, 512\]"),
    (lambda kw: dict(fmt="fp8_e4m3"), "kv_cache"),
    (lambda kw: dict(slot_mapping=kw["slot_mapping"][:2]), r"slot_mapping has 2 entries; expected one per token"),
    (lambda kw: dict(slot_mapping=torch.tensor([0, 0, 1])), "slot_mapping stores slot 0 more than once"),
    (lambda kw: dict(num_kv_heads=1, num_heads=6), "key has 1 kv heads; the cache was allocated for 2"),
    (lambda kw: dict(eps=float("nan")), "eps must be a finite float"),
], ids=["qkv-width", "format", "slots-length", "duplicate-slots", "kv-heads", "eps"])
def test_rejects_bad_input_before_writing(over, match):
    kw = _bad(over)
    before = kw["kv_cache"].clone()
    with pytest.raises(ValueError, match=match):
        qk_norm_rope_store(**kw)
    assert torch.equal(kw["kv_cache"], before)


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize("fmt", tqops.FORMATS)
@pytest.mark.parametrize("tokens", [2, 37], ids=["tokens2", "tokens37"])
def test_fused_launch_equals_the_two_kernels_on_gpu(fmt, tokens):
    # Compiled on CUDA: the fused launch against qk_norm_rope's kernel and the plain store, on the decode shape of
    # the e2e model (16 / 8 heads, head_dim 128) and a ragged block of tokens.
    fmt = tqops.get_format(fmt)
    args, cache, slots = make_case(fmt, torch.bfloat16, tokens, 16, 8, 128, seed=5, device="cuda")
    want_cache = cache.clone()
    q_want, k = triton_norm.qk_norm_rope_triton(*args)
    values = args[0][:, 24 * 128:].unflatten(-1, (8, 128))
    triton_store.kv_store_triton(k, values, want_cache, slots, fmt, 1.0, 1.0)
    v_cache = cache.clone()
    _store_values(values, v_cache, slots, fmt, 128, torch.bfloat16)  # MSE: the row kernel may round values apart
    q = triton_store.qk_norm_rope_store_triton(*args, cache, slots, fmt, 1.0, 1.0)
    torch.testing.assert_close(q, q_want, rtol=2 * 2.0**-8, atol=2 * 2.0**-8)
    _close(cache, want_cache, fmt, 128, torch.bfloat16, v_cache)
