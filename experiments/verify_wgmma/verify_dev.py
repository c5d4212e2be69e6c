"""Device harness for the transposed-wgmma verify kernel (turboquant_verify.cu beside it; not part of the package):
``python experiments/verify_wgmma/verify_dev.py [debug] [check] [ablate] [bench]`` on an H100 with tqops installed.

debug: the first tile's scores and output product against torch; check: whole calls against the torch reference
(and the Triton kernel's error on the same case); ablate: 32 x 8K, q_len 16, with parts of the tile work removed
(MODE bits); bench: 32 x 8K and 8 x 32K against the Triton kernel in the same process."""
import math, sys, time
from pathlib import Path
import torch
import tqops
from tqops.attention.naive import paged_attention_naive
from tqops.attention.combine import combine_splits
from tqops.attention.launch import query_tiles
from tqops.attention.triton_paged import _centroid_pairs, _rotation_signs, paged_attention_triton
from tqops.bench.attention import _fill_cache
from tqops.bench.timing import time_graph, copy_bandwidth
from tqops.kv.naive import kv_store_naive

SRC = (Path(__file__).parent / "turboquant_verify.cu").read_text()
FMT = tqops.get_format("turboquant_4bit_nc")
LOG2E = 1.4426950408889634
_k = {}


def smem_bytes(nwg, stages):
    stage = 32768 + 16384 + nwg * 8192 + nwg * 1024 + nwg * stages * 64
    stage = (stage + 127) // 128 * 128
    return stage + max(nwg * stages * 64 * 176, nwg * 64 * 128 * 4 + nwg * 64 * 4 + 2 * nwg * 4 * 64 * 4)


def kernel(nwg, stages, bf16, dbg=0, mode=0):
    key = (nwg, stages, bf16, dbg, mode)
    if key not in _k:
        t = time.time()
        k = torch.cuda._compile_kernel(SRC, f"turboquant_verify<{nwg}, {stages}, {'true' if bf16 else 'false'}, {dbg}, {mode}>",
                                       compute_capability="90a", nvcc_options=["-std=c++17"])
        smem = smem_bytes(nwg, stages)
        lib = torch.cuda._utils._get_gpu_runtime_library()
        torch.cuda._utils._check_cuda(lib.cuFuncSetAttribute(k.func, 8, smem))
        k.set_shared_memory_config(smem)
        regs = torch.cuda._utils  # noqa
        _k[key] = (k, smem)
        print(f"built {key} smem {smem} in {time.time() - t:.1f}s", flush=True)
    return _k[key]


def run(query, cache, bt, seq_lens, qsl, causal, splits, nwg=2, stages=4, dbg=0, mode=0):
    T, H, D = query.shape
    nb, bs, kvh, _ = cache.shape
    batch, maxb = bt.shape
    group = H // kvh
    block_q = 64 // group
    ntiles = query_tiles(T, batch, block_q)
    part = torch.empty(splits, T, H, D, dtype=torch.float32, device="cuda")
    ml = torch.empty(splits, T, H, 2, dtype=torch.float32, device="cuda")
    k, smem = kernel(nwg, stages, query.dtype == torch.bfloat16, dbg, mode)
    if dbg:
        ntiles, kvh, splits = 1, 1, 1
        part = torch.zeros(32768, dtype=torch.float32, device="cuda")
    signs, pairs = _rotation_signs(D, query.device), _centroid_pairs(4, query.device)
    k(grid=(ntiles, kvh, splits), block=(128 * nwg, 1, 1), shared_mem=smem,
      args=[query, query.stride(0), query.stride(1), cache, cache.stride(0), cache.stride(1), cache.stride(2),
            bt, bt.stride(0), seq_lens, qsl, signs, pairs, part, ml, float(D ** -0.5 * LOG2E), batch, T, nb, maxb,
            bs.bit_length() - 1, block_q, group, splits, int(causal), H])
    if dbg:
        return part
    out = torch.empty_like(query)
    combine_splits(part, ml, None, qsl, out, batch)
    return out


def make_case(seq_lens, q_lens, kvh, group, bs, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(seq_lens)
    maxb = max(-(-s // bs) for s in seq_lens) + 1
    nb = batch * maxb + 3
    cache = tqops.allocate_kv_cache(FMT, nb, bs, kvh, 128, device="cuda")
    perm = torch.randperm(nb, device="cuda", generator=g).to(torch.int32)
    bt = perm[: batch * maxb].view(batch, maxb).contiguous()
    for b, s in enumerate(seq_lens):
        j = torch.arange(s, device="cuda")
        slots = bt[b, j // bs].long() * bs + j % bs
        k = torch.randn(s, kvh, 128, device="cuda", generator=g)
        v = torch.randn(s, kvh, 128, device="cuda", generator=g)
        kv_store_naive(k.to(dtype), v.to(dtype), cache, slots, FMT, 1.0, 1.0)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    query = torch.randn(int(qsl[-1]), kvh * group, 128, device="cuda", generator=g).to(dtype)
    return query, cache, bt, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), qsl


def check():
    cases = [
        dict(seq_lens=[300, 1000, 77], q_lens=[16, 16, 16], kvh=8, group=4, bs=16),
        dict(seq_lens=[513, 64, 2000], q_lens=[16, 5, 11], kvh=8, group=4, bs=64),
        dict(seq_lens=[129, 700], q_lens=[32, 9], kvh=8, group=2, bs=32),
        dict(seq_lens=[4000], q_lens=[8], kvh=8, group=8, bs=16),
        dict(seq_lens=[40, 3000, 1200, 16], q_lens=[16, 16, 3, 16], kvh=8, group=4, bs=16),
    ]
    worst = 0.0
    for i, cs in enumerate(cases):
        for dtype in (torch.bfloat16, torch.float16):
            query, cache, bt, sl, qsl = make_case(**cs, dtype=dtype, seed=i)
            for causal in (True, False):
                ref = paged_attention_naive(query, cache, bt, sl, qsl, FMT, causal, None, None, 128 ** -0.5, 1.0,
                                            1.0).float()
                tri = tqops.paged_attention(query, cache, bt, sl, qsl, FMT, causal=causal).float()
                e_tri = (tri - ref).abs().max().item()
                for splits in (1, 2, 4):
                    for nwg in (1, 2):
                        out = run(query, cache, bt, sl, qsl, causal, splits, nwg).float()
                        err = (out - ref).abs().max().item()
                        worst = max(worst, err)
                        bad = not (err < max(3 * e_tri, 2e-2)) or not torch.isfinite(out).all()
                        if bad or (splits == 1 and nwg == 2):
                            print(f"case {i} {dtype} causal={causal} splits={splits} nwg={nwg}: err {err:.2e} "
                                  f"(triton {e_tri:.2e}){'  BAD' if bad else ''}", flush=True)
    print(f"worst error {worst:.3e}", flush=True)


def bench(batch, context):
    kvh, group = 8, 4
    cache, bt = _fill_cache("turboquant_4bit_nc", batch, context, kvh, 128, 16)
    query = torch.randn(batch * 16, kvh * group, 128, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * 16
    sl = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    bw = copy_bandwidth()
    nbytes = batch * context * kvh * 134
    print(f"{batch} x {context}: {nbytes / 1e6:.0f} MB, copy {bw / 1e12:.2f} TB/s, target 50% = "
          f"{nbytes / (0.5 * bw) * 1e6:.0f} us", flush=True)
    for causal in (True, False):
        ref = tqops.paged_attention(query, cache, bt, sl, qsl, FMT, causal=causal)
        us = time_graph(lambda: tqops.paged_attention(query, cache, bt, sl, qsl, FMT, causal=causal))
        print(f"  triton causal={causal}: {us:7.1f} us ({nbytes / us / 1e6 / (bw / 1e12) * 100:.0f}%)", flush=True)
        for nwg, stages in ((2, 4), (2, 6), (1, 4)):
            for splits in (1, 2, 4):
                out = run(query, cache, bt, sl, qsl, causal, splits, nwg, stages)
                err = (out.float() - ref.float()).abs().max().item()
                us = time_graph(lambda: run(query, cache, bt, sl, qsl, causal, splits, nwg, stages))
                print(f"  verify nwg={nwg} stages={stages} splits={splits} causal={causal}: {us:7.1f} us "
                      f"({nbytes / us / 1e6 / (bw / 1e12) * 100:.0f}%)  err vs triton {err:.1e}", flush=True)
    del cache
    torch.cuda.empty_cache()


MODES = (0, 1, 2, 3, 4, 8, 16, 15, 32)


def ablate(batch=32, context=8192):
    kvh, group = 8, 4
    cache, bt = _fill_cache("turboquant_4bit_nc", batch, context, kvh, 128, 16)
    query = torch.randn(batch * 16, kvh * group, 128, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * 16
    sl = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    tiles = batch * kvh * context // 64 / 132
    names = {0: "full", 1: "no key decode", 2: "no value decode", 3: "no decode", 4: "no MMAs", 8: "no softmax",
             16: "no masks", 15: "copies and barriers only", 32: "no tiles (prologue and merge)",
             64: "output MMA retired late", 128: "no copies (compute only)", 128 + 4: "no copies, no MMAs"}
    for causal in (False, True):
        us = time_graph(lambda: paged_attention_triton(query, cache, bt, sl, qsl, FMT, causal, None, None,
                                                       128 ** -0.5, 1.0, 1.0))
        print(f"ablate {batch}x{context} causal={causal} triton {us:.1f} us", flush=True)
        for nwg, stages in ((1, 4),):
            for mode, name in names.items():
                if mode not in MODES or (causal and mode not in (0, 15, 32)):
                    continue
                us = time_graph(lambda: run(query, cache, bt, sl, qsl, causal, 1, nwg, stages, mode=mode))
                print(f"  nwg={nwg} stages={stages} {name:26s} {us:7.1f} us  {us * 1.755e3 / tiles:6.0f} cycles/tile/SM at 1.755 GHz",
                      flush=True)
    del cache
    torch.cuda.empty_cache()


def debug():
    from tqops.quant import lloyd_max  # noqa
    query, cache, bt, sl, qsl = make_case([300, 1000, 77], [16, 16, 16], 8, 4, 16, torch.float16, 0)
    scale = 128 ** -0.5 * LOG2E
    signs = _rotation_signs(128, query.device)
    H = torch.ones(1, 1, device="cuda")
    while H.shape[0] < 128:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    rows = torch.arange(64, device="cuda")
    q = query[rows // 4, rows % 4].float()  # kv head 0: q heads 0..3
    qrot = ((q * signs) @ H / math.sqrt(128)).half().float()
    keys = torch.arange(128, device="cuda")
    raw = cache[bt[0, keys // 16].long(), keys % 16, 0].long()  # [128, 134]
    codes = torch.stack([raw[:, :64] & 15, raw[:, :64] >> 4], -1).reshape(128, 128)
    cent = _centroid_pairs(4, query.device)
    cvals = (((cent[:16] & 0xFFFF) + 32768) % 65536 - 32768).to(torch.int16).view(torch.float16).float()
    norm = raw[:, 64:66].to(torch.uint8).contiguous().view(torch.float16).float().view(128)
    vscale = raw[:, 130:132].to(torch.uint8).contiguous().view(torch.float16).float().view(128)
    vcodes = torch.stack([raw[:, 66:130] & 15, raw[:, 66:130] >> 4], -1).reshape(128, 128).float()
    khat = cvals[codes]  # [128 keys, 128 ch]
    s_exp = (khat @ qrot.T) * (norm * scale)[:, None]  # [key, row]
    d1 = run(query, cache, bt, sl, qsl, False, 1, 2, 4, dbg=1)
    got = torch.cat([d1[:4096].view(64, 64), d1[4096:8192].view(64, 64)])
    print("scores: max |got - exp|", (got - s_exp).abs().max().item(), "max |exp|", s_exp.abs().max().item(), flush=True)
    print(" exp[0,:6]", s_exp[0, :6].tolist(), "\n got[0,:6]", got[0, :6].tolist(), flush=True)
    print(" exp[:6,0]", s_exp[:6, 0].tolist(), "\n got[:6,0]", got[:6, 0].tolist(), flush=True)
    d2 = run(query, cache, bt, sl, qsl, False, 1, 2, 4, dbg=2)
    for wg in range(2):
        o = d2[wg * 8192:(wg + 1) * 8192].view(64, 128)
        pt = d2[16384 + wg * 4096:16384 + (wg + 1) * 4096].view(64, 64)  # [key, row]
        o_exp = pt.T @ vcodes[64 * wg:64 * wg + 64]
        se = s_exp[64 * wg:64 * wg + 64]
        p_exp = torch.exp2(se - se.max(0).values) * vscale[64 * wg:64 * wg + 64, None]
        print(f"wg {wg}: O vs P'@codes max err {(o - o_exp).abs().max().item():.3e} (|O| {o_exp.abs().max().item():.2e});"
              f" P' vs expected {(pt - p_exp).abs().max().item():.3e} (|P'| {p_exp.abs().max().item():.2e})", flush=True)
        print("  o[0,:6]", o[0, :6].tolist(), "\n  e[0,:6]", o_exp[0, :6].tolist(), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if "debug" in sys.argv:
        debug()
    if "quick" in sys.argv:
        MODES = (0, 4, 15, 32, 128, 132)
    if "ablate" in sys.argv:
        ablate()
    if "check" in sys.argv:
        check()
    if "bench" in sys.argv:
        bench(32, 8192)
        bench(8, 32768)
