"""Compiling a deep model stays fast: every tqops op is first lowered near the graph's start.

Inductor (torch 2.11) formats the IR arguments of an op's first implicit fallback eagerly, and that string grows
exponentially with the op's depth in the graph: an op first met after 28 layers made the decode step's compile never
end on the GPU. Newer torch formats it lazily, so this test formats it itself, as 2.11 would.
"""
import pytest
import torch
import torch._inductor.graph as inductor_graph
from torch._inductor.exc import OperatorIssue

from tqops.bench.e2e import decode_runner, fill_decode
from tqops.models import Qwen3Config, Qwen3ForCausalLM

from .fixtures import qwen3_config

LAYERS = 5
MAX_CHARS = 2_000_000  # an op first met after the last layer formats ~10^8 characters at this depth


@pytest.mark.parametrize("cache_format", ["bf16", "turboquant_4bit_nc"])
@torch.no_grad()
def test_first_fallback_of_every_tqops_op_formats_a_short_string(monkeypatch, cache_format):
    torch._dynamo.reset()
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config.from_dict(qwen3_config(num_layers=LAYERS)), cache_format=cache_format).eval()
    first: dict[str, int] = {}
    lower = inductor_graph.GraphLowering.call_function

    def call_function(self, target_op, args, kwargs):
        name = str(target_op)
        if isinstance(target_op, torch._ops.OpOverload) and target_op.namespace == "tqops" and name not in first:
            first[name] = len(OperatorIssue.operator_str(target_op, args, kwargs))
        return lower(self, target_op, args, kwargs)

    monkeypatch.setattr(inductor_graph.GraphLowering, "call_function", call_function)
    # Lower the graph even where an earlier run cached it. torch's own config patch, not monkeypatch: the config
    # modules serve their entries through __getattr__, and pytest 9.2 undoes a setattr of an attribute missing
    # from a module's __dict__ by deleting it, which removed the entries for every later test.
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        runner, table = decode_runner(target, [1], context=32)
        fill_decode(runner, table, 1, 32)
        runner._run(1)
    assert {"tqops.add_rms_norm_linear.default", "tqops.silu_mul_linear.default", "tqops.layer_attention.default",
            "tqops.layer_qk_norm_rope_store.default"} <= set(first), first
    assert max(first.values()) < MAX_CHARS, first
