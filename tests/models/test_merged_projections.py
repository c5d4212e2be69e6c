"""q/k/v and gate/up run as one GEMM each, loaded from and saved as the checkpoint's separate HF tensors."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from tqops.models import DFlashDrafter, Qwen3Config, Qwen3ForCausalLM, generate
from tqops.models.loading import load_weights, read_config, weight_files
from tqops.models.parallel import TensorParallel, shard_hook
from tqops.models.qwen3 import Qwen3DecoderLayer

from .fixtures import HEAD_DIM, HIDDEN, write_checkpoint, write_target

# 4 query / 2 KV heads split 2/1 per rank, an MLP width split 65/64, biases on q/k/v/o
SHAPE = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=129, attention_bias=True)
ATTN, MLP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def _tensors(path) -> dict:
    out = {}
    for f in weight_files(path):
        out.update(load_file(f))
    return out


def _separate(x, ref, prefix, names):
    """``x`` through each of the checkpoint's separate projections ``prefix.name`` (with its bias if it has one)."""
    return [F.linear(x, ref[f"{prefix}.{n}.weight"], ref.get(f"{prefix}.{n}.bias")) for n in names]


@torch.no_grad()
def test_merged_layers_load_hf_tensors_and_equal_separate_projections(tmp_path):
    path = write_target(tmp_path / "t", seed=7, num_layers=2, **SHAPE)
    ref = _tensors(path)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = model.state_dict()
    assert set(state) == set(ref) and all(torch.equal(state[k], ref[k]) for k in ref)  # HF names, both ways
    fresh = Qwen3ForCausalLM(model.config)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))

    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(model.model.layers):
        attn, mlp, prefix = layer.self_attn, layer.mlp, f"model.layers.{i}"
        want = _separate(x, ref, f"{prefix}.self_attn", ATTN)
        for got, expected in zip(attn.qkv_proj.forward_parts(x), want):
            torch.testing.assert_close(got, expected)
        for got, expected in zip(attn.qkv_proj.forward_parts(x, first=1), want[1:]):  # context rows: k, v only
            torch.testing.assert_close(got, expected)
        gate, up = _separate(x, ref, f"{prefix}.mlp", MLP)
        (down,) = _separate(F.silu(gate) * up, ref, f"{prefix}.mlp", ("down_proj",))
        torch.testing.assert_close(mlp(x), down)


@torch.no_grad()
def test_attention_bias_checkpoint_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from .test_parity_hf import PROMPTS, _prefill_logits

    cfg = transformers.Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64, attention_bias=True,
                                   initializer_range=0.5)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    for name, p in hf.named_parameters():
        if name.endswith("bias"):  # transformers starts biases at zero
            p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    ours = Qwen3ForCausalLM.from_pretrained(tmp_path, cache_format="fp16", dtype=torch.float32)
    for prompt, got in zip(PROMPTS, _prefill_logits(ours, PROMPTS)):
        want = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got, want, rtol=0.003, atol=0.003 * want.abs().max().item())  # fp16 K/V cache


@pytest.mark.parametrize("rank", [0, 1])
@torch.no_grad()
def test_a_tensor_parallel_rank_reads_and_merges_its_slices(tmp_path, rank):
    path = write_target(tmp_path / "t", seed=8, num_layers=1, **SHAPE)
    full = {k.removeprefix("model.layers.0."): v for k, v in _tensors(path).items() if k.startswith("model.layers.0.")}
    layer_path = write_checkpoint(tmp_path / "layer", read_config(path), full)
    tp = TensorParallel(group=None, name="unused", rank=rank, size=2)  # column-parallel layers need no collectives
    layer = Qwen3DecoderLayer(Qwen3Config.from_dict(read_config(path)), 0, name="l", cache_format="bf16", tp=tp)
    reads, hook = {}, shard_hook(layer)
    load_weights(layer, layer_path, shard=lambda name, tensor: reads.setdefault(name, hook(name, tensor)))

    q, kv = slice(rank * 2 * HEAD_DIM, (rank + 1) * 2 * HEAD_DIM), slice(rank * HEAD_DIM, (rank + 1) * HEAD_DIM)
    ffn = slice(0, 65) if rank == 0 else slice(65, 129)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    for merged, prefix, names, rows in ((layer.self_attn.qkv_proj, "self_attn", ATTN, (q, kv, kv)),
                                        (layer.mlp.gate_up_proj, "mlp", MLP, (ffn, ffn))):
        for name, part in zip(names, rows):  # the rank read only its slice of each part
            for kind in ("weight", "bias") if f"{prefix}.{name}.bias" in full else ("weight",):
                assert torch.equal(reads[f"{prefix}.{name}.{kind}"], full[f"{prefix}.{name}.{kind}"][part])
        want = [out[:, part] for out, part in zip(_separate(x, full, prefix, names), rows)]
        assert merged.weight.shape[0] == sum(w.shape[-1] for w in want)
        for got, expected in zip(merged.forward_parts(x), want):
            torch.testing.assert_close(got, expected)


class GemmCount(TorchDispatchMode):
    """Counts the matrix products dispatched under it: the linear ops (the model's projections, alone or fused with
    the norm or activation before them) and bare ``aten.mm``/``aten.addmm`` (what ``F.linear`` runs on)."""

    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.tqops.linear, torch.ops.tqops.add_rms_norm_linear,
                                   torch.ops.tqops.silu_mul_linear, torch.ops.aten.mm, torch.ops.aten.addmm):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _count_per_call(module, counter, into: list) -> None:
    starts = []
    module.register_forward_pre_hook(lambda m, args: starts.append(counter.calls))
    module.register_forward_hook(lambda m, args, out: into.append(counter.calls - starts.pop()))


@torch.no_grad()
def test_a_decoder_layer_runs_four_gemms(target_path, drafter_path):
    target = Qwen3ForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_path, target=target)
    prompts = [[3, 9, 1, 14, 7], [5, 8]]
    plain = generate(target, prompts, 6).tokens
    counter, per_layer, per_draft = GemmCount(), [], []
    for layer in [*target.model.layers, *drafter.layers]:
        _count_per_call(layer, counter, per_layer)
    _count_per_call(drafter, counter, per_draft)
    with counter:
        assert generate(target, prompts, 6, drafter=drafter).tokens == plain
    # qkv, o, gate_up, down (separate q/k/v and gate/up projections made it 7)
    assert per_layer and set(per_layer) == {4}
    # a draft step: fc, one k/v GEMM per layer for the context rows, then the layers
    n = len(drafter.layers)
    assert per_draft and set(per_draft) == {1 + n + 4 * n}
