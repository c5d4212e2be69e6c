"""gated_delta_rule on CUDA (flash-linear-attention's kernels) against the torch reference on the same GPU, fused
recurrent or chunked and captured in a CUDA graph; causal_conv1d and the rollback on CUDA."""
import pytest
import torch

from tqops.deltanet import causal_conv1d, conv_state_after, gated_delta_rule, keep_mask
from tqops.deltanet import ops as dn_ops
from tqops.deltanet.naive import causal_conv1d_naive, conv_state_after_naive, gated_delta_rule_naive

from .test_ops import DTYPES, conv_inputs, delta_inputs, starts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (lens, padding rows, the FLA function the shape rule picks: mean tokens per sequence <= 64 -> fused recurrent)
CASES = {"decode": ([1] * 8, 0, "fused"), "verify": ([16, 0, 5, 16], 7, "fused"),
         "prefill": ([300, 0, 131], 5, "chunk")}
HEADS = {"gqa2_d128": (4, 8, 128, 128), "mha_d64x32": (4, 4, 64, 32)}  # (Hk, Hv, dk, dv)
# The chunked kernels autotune (about a minute per shape and dtype), so prefill runs one head shape, and the smoke
# tier leaves it out.
FLA_CASES = [pytest.param(case, heads, id=f"{case}-{heads}", marks=() if case == "prefill" else pytest.mark.smoke)
             for case in sorted(CASES) for heads in sorted(HEADS) if case != "prefill" or heads == "gqa2_d128"]


def cuda(args: dict) -> dict:
    return {name: t.cuda() for name, t in args.items()}


# (outputs, final states) tolerances by kernel and input dtype. Max abs errors seen on an H200 (outputs ~0.3, states
# ~4): fused recurrent ~1e-7 (in bf16 its outputs are the reference's rounded once); chunked 2e-4 and 8e-4 in fp32
# (its dots run in TF32), 1e-3 and 7e-3 in bf16 (it rounds the normalized q/k and intra-chunk products to bf16).
TOL = {("fused", torch.float32): (1e-5, 1e-5), ("fused", torch.bfloat16): (8e-3, 1e-5),
       ("chunk", torch.float32): (2e-3, 5e-3), ("chunk", torch.bfloat16): (1e-2, 4e-2)}


def assert_close(o, final, want_o, want_final, kernel):
    tol_o, tol_state = TOL[kernel, o.dtype]
    torch.testing.assert_close(o.float(), want_o.float(), rtol=tol_o, atol=tol_o)
    torch.testing.assert_close(final, want_final, rtol=tol_state, atol=tol_state)


@pytest.fixture
def ran(monkeypatch):
    """The FLA functions the calls ran, in order."""
    pytest.importorskip("fla")
    fused, chunk = dn_ops._fla_kernels()
    names = []

    def spy(fn, name):
        def run(*args, **kwargs):
            names.append(name)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(dn_ops, "_fla_kernels", lambda: (spy(fused, "fused"), spy(chunk, "chunk")))
    return names


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("case, heads", FLA_CASES)
def test_fla_matches_reference(case, heads, dtype, ran):
    lens, pad, kernel = CASES[case]
    dt = DTYPES[dtype]
    args = cuda(delta_inputs(torch.Generator().manual_seed(1), lens, pad, *HEADS[heads], dt, torch.int32))
    before = {name: t.clone() for name, t in args.items()}
    o, final = gated_delta_rule(**args)
    assert ran == [kernel]
    want_o, want_final = gated_delta_rule_naive(*args.values())
    assert o.dtype == dt and final.dtype == torch.float32
    assert_close(o, final, want_o, want_final, kernel)
    assert not o[sum(lens):].any()
    for b, length in enumerate(lens):
        if length == 0:
            assert torch.equal(final[b], args["state"][b])
    for name, t in args.items():
        assert torch.equal(t, before[name]), f"{name} was mutated"


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("lens", [[4, 0, 3, 1], [200]], ids=["verify", "long"])
def test_ops_capture_in_a_cuda_graph(lens, dtype, ran, monkeypatch):
    """Both ops in one captured graph; replayed on new inputs, new sequence lengths included. A capture always runs
    the fused recurrent kernel (the chunked one syncs the host), however long the sequences."""
    dt, pad, n = DTYPES[dtype], 8, sum(lens) + 8
    static = cuda(delta_inputs(torch.Generator().manual_seed(2), lens, pad, 4, 8, 128, 128, dt))
    conv = cuda(conv_inputs(torch.Generator().manual_seed(3), lens, pad, 96, 4, dt, weight_fp32=True))
    conv["query_start_loc"] = static["query_start_loc"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with monkeypatch.context() as patch, torch.cuda.stream(stream):  # warm-up: compile the kernels outside the capture
        patch.setattr(dn_ops, "FUSED_RECURRENT_MAX_MEAN_TOKENS", n)  # the kernel the capture runs
        gated_delta_rule(**static)
        causal_conv1d(**conv)
    torch.cuda.current_stream().wait_stream(stream)
    ran.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, final = gated_delta_rule(**static)
        y, conv_state = causal_conv1d(**conv)
    new_lens = [lens[0] + pad - 3, *lens[1:]][::-1]  # the same n and batch, other lengths, 3 padding rows
    new = delta_inputs(torch.Generator().manual_seed(4), new_lens, n - sum(new_lens), 4, 8, 128, 128, dt)
    new_conv = conv_inputs(torch.Generator().manual_seed(5), new_lens, n - sum(new_lens), 96, 4, dt, weight_fp32=True)
    for name, t in new.items():
        static[name].copy_(t)
    for name in ("x", "weight", "conv_state"):
        conv[name].copy_(new_conv[name])
    graph.replay()
    torch.cuda.synchronize()
    assert ran == ["fused"]
    want_o, want_final = gated_delta_rule_naive(*static.values())
    assert_close(o, final, want_o, want_final, "fused")
    want_y, want_state = causal_conv1d_naive(*(t.cpu() for t in conv.values()))
    torch.testing.assert_close(y.cpu(), want_y, rtol=2e-2 if dt == torch.bfloat16 else 1e-5, atol=1e-5)
    assert torch.equal(conv_state.cpu(), want_state)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_rollback_on_cuda(dtype, ran):
    """After a verify block, the masked recurrent state equals the kept tokens' alone (both fused recurrent: the
    same fp32 ops), and the conv state after the kept tokens is the reference's."""
    lens, keep = [16, 0, 5, 16], torch.tensor([3, 0, 5, 16], device="cuda")
    dt = DTYPES[dtype]
    args = cuda(delta_inputs(torch.Generator().manual_seed(6), lens, 4, 4, 8, 128, 128, dt))
    qsl, n = args["query_start_loc"], args["q"].shape[0]
    m = keep_mask(qsl, keep, n)
    _, masked = gated_delta_rule(**{**args, "g": args["g"] * m[:, None], "beta": args["beta"] * m[:, None]})
    rows = {name: args[name][m] for name in ("q", "k", "v", "g", "beta")}
    _, kept = gated_delta_rule(**rows, state=args["state"], query_start_loc=starts(keep.tolist()).cuda())
    torch.testing.assert_close(masked, kept, rtol=1e-6, atol=1e-6)
    conv = cuda(conv_inputs(torch.Generator().manual_seed(7), lens, 4, 96, 4, dt))
    got = conv_state_after(conv["x"], conv["conv_state"], qsl, keep)
    assert torch.equal(got.cpu(), conv_state_after_naive(conv["x"].cpu(), conv["conv_state"].cpu(), qsl.cpu(),
                                                         keep.cpu()))
