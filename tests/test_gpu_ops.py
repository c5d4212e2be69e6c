"""Every op on CUDA against the CPU reference, for every format, causal and not, through the Attention layer:
kv_store and paged_attention inside tqops::layer_kv_store / tqops::layer_attention, kv_load for the readback."""
import pytest
import torch

import tqops
from tqops.graphs import Attention, ForwardContext, build_metadata, set_forward_context

pytestmark = [pytest.mark.gpu, pytest.mark.smoke]


def _steps(layer, device, gen_seed=0):
    """A prefill of 40 + 9 tokens, then a 16-token block for sequence 0 and one decode token for sequence 1."""
    gen = torch.Generator().manual_seed(gen_seed)
    table = torch.tensor([[3, 0, 5, 6], [1, 7, 2, 4]], device=device)
    outs = []
    for q_lens, seq_lens in (([40, 9], [40, 9]), ([16, 1], [56, 10])):
        n = sum(q_lens)
        meta = build_metadata(torch.tensor(q_lens, device=device), torch.tensor(seq_lens, device=device), table, 16, n)
        q = torch.randn(n, 8, 128, generator=gen).to(device, torch.bfloat16)
        k = torch.randn(n, 2, 128, generator=gen).to(device, torch.bfloat16) * 2 + 0.5
        v = torch.randn(n, 2, 128, generator=gen).to(device, torch.bfloat16)
        with set_forward_context(ForwardContext({0: meta})):
            outs.append(layer(q, k, v).float().cpu())
    slots = (table[:, :, None] * 16 + torch.arange(16, device=device)).flatten()
    return outs, tqops.kv_load(layer.kv_cache, slots, layer.fmt, 128)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("fmt", tqops.FORMATS)
def test_layer_ops_match_cpu(fmt, causal):
    layers = {}
    for device in ("cpu", "cuda"):
        layer = Attention(8, 2, 128, name="l0", cache_format=fmt, causal=causal, sliding_window=None)
        layer.allocate_cache(8, 16, device=device)
        layer.kv_cache.zero_()
        layers[device] = layer
    (cpu_outs, cpu_kv), (gpu_outs, gpu_kv) = _steps(layers["cpu"], "cpu"), _steps(layers["cuda"], "cuda")
    for want, got in zip(cpu_outs, gpu_outs):
        assert got.isfinite().all()
        assert float((got - want).norm() / want.norm()) < 1.5e-2
    for want, got in zip(cpu_kv, gpu_kv):  # the GPU store's readback equals the CPU store's (ties aside)
        assert float((got.cpu() - want).norm() / want.norm()) < 1e-2
