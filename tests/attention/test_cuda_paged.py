"""The CUDA kernel of the TurboQuant caches (tqops.attention.cuda_paged): when it is taken, and its output against the
torch reference on odd shapes, through the public op and with every launch override."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tqops
from tqops.attention import cuda_launch, cuda_paged
from tqops.attention.naive import paged_attention_naive
from tqops.attention.plan import DeviceProps, plan_attention

from .cases import compare_to_reference, make_case, replay_with_seq_lens

pytestmark = pytest.mark.smoke

FMT = "turboquant_4bit_nc"
FORMATS = sorted(cuda_launch.FORMATS)


def _eligible(**over):
    args = dict(fmt=FMT, head_dim=128, query_dtype=torch.bfloat16, group=4, sliding_window=None, cache_ptr=512,
                block_stride=16 * 8 * 134, slot_stride=8 * 134, capability=(9, 0), avg_q_len=1, table_keys=8192)
    args.update(over)
    return cuda_launch.paged_eligible(**dict(args, fmt=tqops.get_format(args["fmt"])))


def test_eligible_takes_decode_and_verify_of_the_qwen3_cache():
    assert _eligible()
    assert _eligible(avg_q_len=4, query_dtype=torch.float16, group=16)
    assert _eligible(fmt="turboquant_k3v4_nc", block_stride=16 * 8 * 118, slot_stride=8 * 118)
    assert _eligible(fmt="turboquant_3bit_nc", block_stride=16 * 8 * 102, slot_stride=8 * 102)
    k8v4 = dict(fmt="turboquant_k8v4", block_stride=16 * 8 * 196, slot_stride=8 * 196)
    assert _eligible(**k8v4, capability=(8, 9), table_keys=cuda_launch.FP8_KEYS_MIN_TABLE_KEYS)
    assert not _eligible(**k8v4, table_keys=cuda_launch.FP8_KEYS_MIN_TABLE_KEYS - 16)


@pytest.mark.parametrize("fmt,kv_heads,copy", [
    ("turboquant_4bit_nc", 8, 16), ("turboquant_4bit_nc", 4, 8), ("turboquant_4bit_nc", 2, 0),
    ("turboquant_3bit_nc", 4, 8), ("turboquant_k3v4_nc", 4, 8), ("turboquant_k8v4", 4, 16), ("turboquant_k8v4", 2, 8),
    ("turboquant_k8v4", 1, 0), ("turboquant_4bit_nc", 1, 0),
], ids=lambda v: str(v))
def test_copy_pieces_by_slot_stride(fmt, kv_heads, copy):
    # Tensor parallelism over 2 ranks leaves 4 of Qwen3's 8 kv heads per rank: 8-byte pieces keep the CUDA kernel
    slot = kv_heads * tqops.get_format(fmt).slot_bytes(128)
    assert cuda_launch.copy_bytes(slot) == copy
    assert _eligible(fmt=fmt, slot_stride=slot, block_stride=16 * slot, capability=(9, 0),
                     table_keys=cuda_launch.FP8_KEYS_MIN_TABLE_KEYS) == (copy > 0)


@pytest.mark.parametrize("over", [
    dict(fmt="fp8_e4m3"), dict(fmt="bf16"),
    dict(fmt="turboquant_k8v4", block_stride=16 * 8 * 196, slot_stride=8 * 196, capability=(8, 6),
         table_keys=1 << 20),
    dict(head_dim=64), dict(head_dim=256),
    dict(query_dtype=torch.float32), dict(group=32), dict(sliding_window=128), dict(avg_q_len=5),
    dict(cache_ptr=520), dict(slot_stride=2 * 134, block_stride=16 * 2 * 134), dict(capability=(7, 5)),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_eligible_refuses(over):
    assert not _eligible(**over)


@pytest.mark.parametrize("tokens,batch,group,keys", [(1, 1, 2, 8192), (8, 8, 4, 32768), (32, 32, 4, 8192),
                                                     (128, 8, 4, 2000), (5, 3, 1, 300), (16, 1, 16, 16)])
def test_launch_shape(tokens, batch, group, keys):
    block_q, tiles, splits, warps = cuda_launch.paged_launch_shape(tokens, batch, group, 8, keys, 132)
    assert warps in (4, 8)
    assert 1 <= block_q * group <= cuda_launch.MAX_ROWS or block_q == 1
    assert tiles >= -(-tokens // block_q)  # every sequence's tiles fit the grid
    assert splits & (splits - 1) == 0 and 1 <= splits <= 128
    assert splits == 1 or keys // splits >= 256


@st.composite
def _cases(draw):
    batch = draw(st.integers(1, 4))
    q_lens = draw(st.lists(st.integers(1, 16), min_size=batch, max_size=batch))
    ctx = draw(st.lists(st.integers(0, 1200), min_size=batch, max_size=batch))
    return dict(q_lens=q_lens, seq_lens=[q + c for q, c in zip(q_lens, ctx)],
                num_kv_heads=draw(st.sampled_from((2, 4, 8, 16))), group=draw(st.sampled_from((1, 2, 3, 4, 8, 16))),
                block_size=draw(st.sampled_from((16, 32, 64))), causal=draw(st.booleans()),
                with_sinks=draw(st.booleans()), dtype=draw(st.sampled_from((torch.bfloat16, torch.float16))),
                k_scale=draw(st.sampled_from((1.0, 0.25, 3.0))), seed=draw(st.integers(0, 2**31 - 1)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@settings(max_examples=25, deadline=None)
@given(kw=_cases(), splits=st.sampled_from((None, 1, 2, 8)), num_warps=st.sampled_from((None, 2)),
       key_tiles=st.sampled_from((1, 2)))
def test_matches_reference(fmt, kw, splits, num_warps, key_tiles):
    # 2 kv heads: turboquant_k8v4's 8-byte copy pieces; the code formats' 2-head slots fit neither piece
    assume(cuda_launch.copy_bytes(kw["num_kv_heads"] * tqops.get_format(fmt).slot_bytes(128)) > 0)
    case = make_case(fmt, head_dim=128, device="cuda", **kw)
    out = cuda_paged.paged_attention_cuda(case.query, case.cache, case.block_table, case.seq_lens,
                                          case.query_start_loc, fmt, case.causal, case.sinks, 128**-0.5,
                                          num_splits=splits, num_warps=num_warps, key_tiles=key_tiles,
                                          k_scale=case.k_scale)
    ref = paged_attention_naive(case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc,
                                case.fmt, case.causal, None, case.sinks, 128**-0.5, case.k_scale, 1.0)
    assert not torch.isnan(out).any()
    err = (out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)
    assert err < 1.5e-2, f"relative error {float(err):.2e}"


@st.composite
def _all_heads_cases(draw):
    # 8 or 4 kv heads (a warp each; at 4 most formats' slots are 8 bytes past a 16-byte boundary) and one query tile
    # of at most 8 rows per sequence
    batch = draw(st.integers(1, 5))
    group = draw(st.sampled_from((1, 2, 4, 8)))
    q_lens = draw(st.lists(st.integers(1, min(4, 8 // group)), min_size=batch, max_size=batch))
    ctx = draw(st.lists(st.integers(0, 1200), min_size=batch, max_size=batch))
    return dict(q_lens=q_lens, seq_lens=[q + c for q, c in zip(q_lens, ctx)],
                num_kv_heads=draw(st.sampled_from(cuda_launch.ALL_HEADS_KV_HEADS)), group=group,
                block_size=draw(st.sampled_from((16, 32, 64))), causal=draw(st.booleans()),
                with_sinks=draw(st.booleans()), dtype=draw(st.sampled_from((torch.bfloat16, torch.float16))),
                k_scale=draw(st.sampled_from((1.0, 0.25, 3.0))), seed=draw(st.integers(0, 2**31 - 1)),
                pad_entry=draw(st.sampled_from((0, -1, 10**6))))  # unused block-table entries


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@settings(max_examples=20, deadline=None)
@given(kw=_all_heads_cases(), splits=st.sampled_from((None, 1, 2, 8)), key_tiles=st.sampled_from((1, 2)))
def test_all_heads_programs_match_reference(fmt, kw, splits, key_tiles):
    case = make_case(fmt, head_dim=128, device="cuda", **kw)
    out = cuda_paged.paged_attention_cuda(case.query, case.cache, case.block_table, case.seq_lens,
                                          case.query_start_loc, fmt, case.causal, case.sinks, 128**-0.5,
                                          num_splits=splits, key_tiles=key_tiles, k_scale=case.k_scale,
                                          all_heads=True)
    ref = paged_attention_naive(case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc,
                                case.fmt, case.causal, None, case.sinks, 128**-0.5, case.k_scale, 1.0)
    assert not torch.isnan(out).any()
    err = (out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)
    assert err < 1.5e-2, f"relative error {float(err):.2e}"


def test_all_heads_fit_slot_strides():
    # 4 kv heads of the code formats: 8 bytes past a 16-byte boundary, whole 4-byte words, so the programs run
    for fmt in FORMATS:
        slot_bytes = tqops.get_format(fmt).slot_bytes(128)
        for kv_heads in (4, 8):
            assert cuda_launch.all_heads_fit(1, kv_heads, kv_heads * slot_bytes, cuda_launch.FORMATS[fmt][0])
    assert not cuda_launch.all_heads_fit(1, 4, 4 * 134 + 2, 4)  # a stride of half words
    assert not cuda_launch.all_heads_fit(1, 2, 2 * 134, 4)  # 2 kv heads
    assert not cuda_launch.all_heads_fit(1, 8, 8 * 1000, 4)  # 64 slots past the shared memory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_all_heads_refused_where_it_cannot_run():
    case = make_case(FMT, q_lens=[4], seq_lens=[300], num_kv_heads=8, group=4, head_dim=128,
                     dtype=torch.bfloat16, seed=2, device="cuda")  # 16 rows: two query tiles
    with pytest.raises(ValueError, match="all_heads"):
        cuda_paged.paged_attention_cuda(case.query, case.cache, case.block_table, case.seq_lens,
                                        case.query_start_loc, FMT, True, None, 128**-0.5, all_heads=True)


@pytest.mark.parametrize("fmt,kv_heads,tiles,rows_tiles,keys,want", [
    ("turboquant_4bit_nc", 8, 8, 1, 8 * 32768, True), ("turboquant_4bit_nc", 8, 7, 1, 7 * 32768, False),
    ("turboquant_4bit_nc", 8, 8, 1, 8 * 8192, False), ("turboquant_4bit_nc", 16, 32, 1, 32 * 8192, False),
    ("turboquant_4bit_nc", 8, 32, 2, 32 * 8192, False), ("turboquant_k8v4", 8, 32, 1, 32 * 8192, True),
    ("turboquant_3bit_nc", 8, 64, 1, 64 * 4096, True), ("turboquant_4bit_nc", 4, 8, 1, 8 * 32768, True),
    ("turboquant_3bit_nc", 4, 32, 1, 32 * 8192, True), ("turboquant_k8v4", 4, 16, 1, 16 * 16384, True),
    ("turboquant_4bit_nc", 2, 32, 1, 32 * 8192, False), ("turboquant_4bit_nc", 4, 32, 2, 32 * 8192, False),
], ids=lambda v: str(v))
def test_all_heads_applies(fmt, kv_heads, tiles, rows_tiles, keys, want):
    bits = cuda_launch.FORMATS[fmt]
    row = {"turboquant_4bit_nc": 134, "turboquant_k8v4": 196, "turboquant_3bit_nc": 102}[fmt]
    assert cuda_launch.all_heads_applies(rows_tiles, tiles, kv_heads, kv_heads * row, bits[0], keys) == want


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch,context", [(8, 32768), (16, 16384), (32, 8192)], ids=["8x32k", "16x16k", "32x8k"])
def test_all_heads_from_eight_tiles_for_every_format(fmt, batch, context):
    # At 8 kv heads (Qwen3) and 4 (a rank of it under 2-way tensor parallelism), 256K keys: every format from 8 query
    # tiles, on every GPU
    bits = cuda_launch.FORMATS[fmt]
    slot_stride = 8 * tqops.get_format(fmt).slot_bytes(128)
    assert cuda_launch.all_heads_applies(1, batch, 8, slot_stride, bits[0], batch * context)
    assert cuda_launch.all_heads_applies(1, batch, 4, slot_stride // 2, bits[0], batch * context)


@pytest.mark.parametrize("batch,context,splits", [(8, 32768, 32), (16, 16384, 16), (32, 8192, 8), (64, 4096, 4),
                                                  (8, 16384, 32), (128, 2048, 2)],
                         ids=["8x32k", "16x16k", "32x8k", "64x4k", "8x16k", "128x2k"])
def test_all_heads_splits_fill_one_wave(batch, context, splits):
    # q_len 1 on 132 SMs: the count each shape was fastest at among the rule's, half and twice it, for every format
    # on an H100 (docs/tuning.md); 128 x 2K is where about three programs per SM (4 splits) was 10% slower.
    assert cuda_launch.all_heads_splits(batch, 1, context, 132) == splits


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pad_entry", [-1, 10**6], ids=["negative", "past_the_cache"])
@pytest.mark.parametrize("kv_heads", [8, 4], ids=["8_kv_heads", "4_kv_heads"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_op_takes_the_kernel_and_drops_bad_block_entries(fmt, pad_entry, kv_heads, monkeypatch):
    # The raw op over a block table whose unused and one used entry point outside the cache: those keys are dropped,
    # as in the reference, and nothing outside the cache is read. (fp8 keys: the kernel at any table size.) 4 kv
    # heads: the 8-byte copy pieces of most formats.
    monkeypatch.setattr(cuda_launch, "FP8_KEYS_MIN_TABLE_KEYS", 0)
    case = make_case(fmt, q_lens=[1, 1, 4], seq_lens=[700, 33, 260], num_kv_heads=kv_heads, group=4, head_dim=128,
                     block_size=16, dtype=torch.bfloat16, seed=3, device="cuda", pad_entry=pad_entry)
    case.block_table[0, 3] = pad_entry
    taken = []
    real = cuda_paged.run
    monkeypatch.setattr(cuda_paged, "run", lambda *a, **k: taken.append(1) or real(*a, **k))
    out = torch.ops.tqops.paged_attention(*case.args(), case.causal, None, None, 128**-0.5, 1.0, 1.0)
    assert taken
    ref = paged_attention_naive(case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc,
                                case.fmt, case.causal, None, None, 128**-0.5, 1.0, 1.0)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 1.5e-2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_padding_tokens_are_zero_and_graph_replay_sees_new_metadata(fmt, monkeypatch):
    monkeypatch.setattr(cuda_launch, "FP8_KEYS_MIN_TABLE_KEYS", 0)
    case = make_case(fmt, q_lens=[1, 1], seq_lens=[900, 400], num_kv_heads=8, group=4, head_dim=128,
                     dtype=torch.bfloat16, seed=6, device="cuda")
    query = torch.cat([case.query, torch.randn_like(case.query[:1])])  # a padding token past query_start_loc[-1]
    seq_lens = case.seq_lens.clone()
    run = lambda: torch.ops.tqops.paged_attention(query, case.cache, case.block_table, seq_lens,
                                                  case.query_start_loc, fmt, True, None, None, 128**-0.5, 1.0, 1.0)
    for out in replay_with_seq_lens(run, seq_lens, ([900, 400], [600, 16], [17, 899])):
        want = paged_attention_naive(query, case.cache, case.block_table, seq_lens, case.query_start_loc, case.fmt,
                                     True, None, None, 128**-0.5, 1.0, 1.0)
        assert (out[2] == 0).all()
        assert (out.float() - want.float()).norm() / want.float().norm() < 1.5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_switch_off_sends_calls_to_triton(monkeypatch):
    case = make_case(FMT, q_lens=[1], seq_lens=[300], num_kv_heads=8, group=4, head_dim=128,
                     dtype=torch.bfloat16, seed=8, device="cuda")
    assert cuda_paged.applies(case.query, case.cache, case.block_table, case.fmt, None)
    monkeypatch.setenv("TQOPS_CUDA_ATTENTION", "0")
    assert not cuda_paged.applies(case.query, case.cache, case.block_table, case.fmt, None)
    compare_to_reference(case)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kv_heads", [8, 4], ids=["8_kv_heads", "4_kv_heads"])
def test_kernels_built_at_allocation_are_the_ones_launches_look_up(fmt, kv_heads, monkeypatch):
    # _kernel is an lru_cache keyed by the arguments as given: a build that leaves out an argument the launch passes
    # would be a second NVRTC build at the first launch, possibly inside a captured step. So _kernel takes no
    # defaults, and device_constants builds every (tiles, warps) variant the launch rules pick, at this slot's copy
    # piece, and the all-heads programs.
    import inspect

    from tqops.attention import constants

    assert all(p.default is inspect.Parameter.empty
               for p in inspect.signature(cuda_paged._kernel.__wrapped__).parameters.values())
    built = []
    monkeypatch.setattr(cuda_paged, "_kernel", lambda *args: built.append(args))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(constants, "rotation_signs", lambda *a: None)
    monkeypatch.setattr(constants, "centroid_pairs", lambda *a: None)
    cuda_paged.device_constants(tqops.get_format(fmt), 128, torch.device("cuda", 0), kv_heads)
    assert built and all(len(args) == 8 for args in built)
    # the variants the plans of decode and short-query calls launch, per-head and all-heads programs alike
    device = DeviceProps(cuda=True, index=0, sm_count=132, capability=(9, 0), nvrtc=True, interpreted=False)
    launched = set()
    for batch, tokens, keys in ((1, 1, 8192), (8, 8, 32768), (8, 32, 32768), (32, 32, 8192), (32, 32, 1 << 17)):
        for dtype in (torch.bfloat16, torch.float16):
            query, cache, table = _meta_call(fmt, tokens, batch, 4 * kv_heads, kv_heads, keys, dtype)
            plan = plan_attention(query, cache, table, tqops.get_format(fmt), True, None, None, device=device,
                                  backend="cuda_paged")  # turboquant_k8v4 takes it from 32K keys only
            launched.add(plan.launch.kernel_key)
            assert plan.launch.kernel_key in built, plan.launch.kernel_key
    assert any(key[6] for key in launched) and not all(key[6] for key in launched)
    assert not [args for args in built if args[6] and args[1] != kv_heads]  # none for another head count


def _meta_call(fmt, num_tokens, batch, num_q_heads, num_kv_heads, keys, dtype, block_size=16, head_dim=128):
    """Meta tensors of a call: ``batch`` sequences of ``num_tokens // batch`` queries over ``keys`` keys each."""
    slot = tqops.get_format(fmt).slot_bytes(head_dim)
    max_blocks = keys // block_size
    return (torch.empty(num_tokens, num_q_heads, head_dim, dtype=dtype, device="meta"),
            torch.empty(batch * max_blocks, block_size, num_kv_heads, slot, dtype=torch.uint8, device="meta"),
            torch.empty(batch, max_blocks, dtype=torch.int32, device="meta"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_first_call_inside_a_cuda_graph_capture(fmt, monkeypatch):
    # The kernels are built before capture (device_constants); a per-head program's tensor map (sm_90, code keys) is
    # encoded inside it, on the host.
    monkeypatch.setattr(cuda_launch, "FP8_KEYS_MIN_TABLE_KEYS", 0)
    case = make_case(fmt, q_lens=[1, 2, 1], seq_lens=[900, 401, 1300], num_kv_heads=8, group=4, head_dim=128,
                     dtype=torch.bfloat16, seed=9, device="cuda")
    cuda_paged.device_constants(case.fmt, 128, case.query.device, 8)
    cuda_paged._tensor_map.cache_clear()
    run = lambda: cuda_paged.paged_attention_cuda(case.query, case.cache, case.block_table, case.seq_lens,
                                                  case.query_start_loc, fmt, True, case.sinks, 128**-0.5,
                                                  all_heads=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_naive(case.query, case.cache, case.block_table, case.seq_lens, case.query_start_loc,
                                case.fmt, True, None, case.sinks, 128**-0.5, 1.0, 1.0)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 1.5e-2
    assert torch.equal(out, run())
