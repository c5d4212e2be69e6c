"""tqops' Qwen3.5 hybrid target: transformers' checkpoints load strictly, logits and greedy tokens match transformers,
DFlash over it is lossless in every format, and the verify block's stash rolls the recurrent states back exactly."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tqops.graphs import ForwardContext, StateMetadata, build_metadata, set_forward_context
from tqops.models import DFlashDrafter, OracleProposer, Qwen3_5ForCausalLM, generate

from .fixtures import oracle_acceptance_lengths, write_drafter

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN = 100, 64
PROMPTS = [[5, 17, 42, 8, 33, 2, 71], [3, 61, 23, 77, 12, 4, 88, 31, 50, 2, 9, 44, 70], [11, 64]]
N = 12
# (full-attention interval, head_dim): the layouts the issue names, as small as tqops' attention allows.
SHAPES = {"interval4-hd64": (4, 64), "interval2-hd256": (2, 256)}


def hf_config(interval: int, head_dim: int, layers: int = 4, **extra):
    return transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        initializer_range=0.5, pad_token_id=0, **extra)


def hf_model(interval: int, head_dim: int, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(hf_config(interval, head_dim)).eval()
    with torch.no_grad():  # transformers initializes the zero-centred norms to 0 and A_log from a range: spread them
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "norm.weight", "dt_bias")):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(SHAPES))
def hf_pair(request, tmp_path_factory):
    """(transformers' model, the path it saved itself to)."""
    model = hf_model(*SHAPES[request.param])
    path = tmp_path_factory.mktemp(f"qwen3_5-{request.param}")
    model.save_pretrained(path)
    return model, str(path)


@pytest.fixture(scope="module")
def drafter_path(tmp_path_factory):
    return write_drafter(tmp_path_factory.mktemp("drafter"), block_size=4, target_layer_ids=(0, 3), seed=5)


def _prefill_logits(model, prompts, device="cpu"):
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)
    table = torch.arange(len(prompts) * 4, dtype=torch.int32, device=device).view(-1, 4)
    model.allocate_cache(table.numel(), 16, device)
    model.allocate_state(len(prompts), 1, device)
    meta = build_metadata(lens, lens, table, 16, int(lens.sum()))
    states = StateMetadata(torch.arange(len(prompts), device=device), meta.query_start_loc)
    ids = torch.tensor(sum(prompts, []), device=device)
    pos = torch.cat([torch.arange(len(p), device=device) for p in prompts])
    with set_forward_context(ForwardContext({0: meta, 1: meta}, state_metadata=states)):
        return model.compute_logits(model(ids, pos)).split(lens.tolist())


@torch.no_grad()
def test_loads_transformers_checkpoint_and_matches_its_logits(hf_pair):
    hf, path = hf_pair
    ours = Qwen3_5ForCausalLM.from_pretrained(path, cache_format="fp16", dtype=torch.float32)
    for prompt, logits in zip(PROMPTS, _prefill_logits(ours, PROMPTS)):
        want = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, want, atol=5e-3, rtol=5e-3)


def _hf_greedy(model, prompt, n):
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
@torch.no_grad()
def test_greedy_tokens_equal_transformers(hf_pair, fmt):
    hf, path = hf_pair
    ours = Qwen3_5ForCausalLM.from_pretrained(path, cache_format=fmt, dtype=torch.float32)
    got = generate(ours, PROMPTS, N).tokens
    assert got == [_hf_greedy(hf, p, N) for p in PROMPTS]


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "turboquant_4bit_nc"])
@torch.no_grad()
def test_dflash_over_hybrid_is_lossless(hf_pair, drafter_path, fmt):
    _, path = hf_pair
    target = Qwen3_5ForCausalLM.from_pretrained(path, cache_format=fmt, dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_path, target=target, cache_format=fmt)
    plain = generate(target, PROMPTS, N)
    spec = generate(target, PROMPTS, N, drafter=drafter)
    assert spec.tokens == plain.tokens
    assert all(sum(a) == N - 1 for a in spec.acceptance_lengths)
    # an oracle right for 2 of 3 drafts: every step keeps a different prefix of its block, per row
    oracle = generate(target, PROMPTS, N, proposer=OracleProposer(plain.tokens, 2, 4, VOCAB))
    assert oracle.tokens == plain.tokens
    assert oracle.acceptance_lengths == [oracle_acceptance_lengths(2, 4, N)] * 3
    captured = generate(target, PROMPTS, N, drafter=drafter, cudagraph=True)  # the padded runner steps on CPU
    assert captured.tokens == plain.tokens


def _states(model):
    return [(s.conv_state[:-1].clone(), s.recurrent_state[:-1].clone()) for s in model.state_layers]


def _step(model, ids, lens_before, q_len, *, stash=False, pending=None):
    """One forward of ``q_len`` tokens per row (rows of ``ids`` ``[batch, q_len]``) after ``lens_before`` tokens."""
    batch = ids.shape[0]
    q_lens = torch.full((batch,), q_len, dtype=torch.int32)
    seq_lens = lens_before.int() + q_len
    table = torch.arange(batch * 4, dtype=torch.int32).view(batch, 4)
    meta = build_metadata(q_lens, seq_lens, table, 16, batch * q_len)
    states = StateMetadata(torch.arange(batch), meta.query_start_loc, pending, stash)
    positions = (lens_before[:, None] + torch.arange(q_len)).flatten()
    with set_forward_context(ForwardContext({0: meta, 1: meta}, state_metadata=states)):
        model(ids.flatten(), positions)


@torch.no_grad()
def test_rollback_state_equals_a_plain_run_over_the_accepted_tokens(hf_pair):
    """A verify block of 4 tokens per row, accepted 0..3 per row, committed by the next step: every layer's conv and
    recurrent state then equals running only the accepted tokens (a rejected token leaves the state as it was)."""
    _, path = hf_pair
    model = Qwen3_5ForCausalLM.from_pretrained(path, cache_format="bf16", dtype=torch.float32)
    model.allocate_cache(16, 16)
    g = torch.Generator().manual_seed(0)
    prefix, block = torch.randint(1, VOCAB, (4, 3), generator=g), torch.randint(1, VOCAB, (4, 4), generator=g)
    keep = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    zero = torch.zeros(4, dtype=torch.long)

    model.allocate_state(4, 4)
    _step(model, prefix, zero, 3)
    _step(model, block, zero + 3, 4, stash=True, pending=torch.zeros(4, dtype=torch.int32))
    # The next verify block commits the accepted prefix first; its own tokens are stashed, so they change nothing.
    _step(model, block, zero + 3 + keep.long(), 4, stash=True, pending=keep)
    rolled_back = _states(model)

    for row in range(4):
        model.allocate_state(1, 1)
        _step(model, prefix[row:row + 1], zero[:1], 3)
        k = int(keep[row])
        if k:
            _step(model, block[row:row + 1, :k], zero[:1] + 3, k)
        # Not bitwise: the projections' GEMMs over 16 rows and over k rows may round differently.
        for (conv, rec), (conv_row, rec_row) in zip(rolled_back, _states(model)):
            torch.testing.assert_close(conv[row], conv_row[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(rec[row], rec_row[0], atol=1e-4, rtol=1e-4)


def test_strict_loading(hf_pair, tmp_path):
    _, path = hf_pair
    tensors = load_file(f"{path}/model.safetensors")
    tensors.pop("model.layers.0.linear_attn.A_log")
    tensors["model.layers.0.linear_attn.extra"] = torch.zeros(1)
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.linear_attn.A_log'\].*unexpected"):
        Qwen3_5ForCausalLM.from_pretrained(tmp_path)


def test_bad_arguments(hf_pair):
    _, path = hf_pair
    cfg = Qwen3_5ForCausalLM.from_pretrained(path).config
    with pytest.raises(ValueError, match="layer_cache_formats\\[0\\]: layer 0 is a linear-attention layer"):
        Qwen3_5ForCausalLM(cfg, layer_cache_formats={0: "bf16"})
    moe = {**cfg.raw, "num_experts": 4}
    with pytest.raises(NotImplementedError, match="MoE"):
        type(cfg).from_dict(moe)
    model = Qwen3_5ForCausalLM(cfg)
    with pytest.raises(RuntimeError, match="has no state yet"):
        _prefill_logits_without_state(model)


def _prefill_logits_without_state(model):
    lens = torch.tensor([3], dtype=torch.int32)
    table = torch.arange(4, dtype=torch.int32).view(1, 4)
    model.allocate_cache(4, 16)
    meta = build_metadata(lens, lens, table, 16, 3)
    with set_forward_context(ForwardContext({0: meta}, state_metadata=StateMetadata(torch.arange(1),
                                                                                    meta.query_start_loc))):
        model(torch.tensor([1, 2, 3]), torch.arange(3))


@torch.no_grad()
def test_compiled_fullgraph_steps_match_eager(tmp_path, drafter_path):
    """The target, drafter and context steps compile with fullgraph=True once each (the layer ops read the states'
    rows from the forward context at run time) and give the eager tokens; then the same steps captured (CPU: the
    runners' padded steps)."""
    torch.manual_seed(1)
    transformers.Qwen3_5ForCausalLM(hf_config(4, 64)).save_pretrained(tmp_path)
    target = Qwen3_5ForCausalLM.from_pretrained(tmp_path, cache_format="turboquant_4bit_nc", dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_path, target=target, cache_format="turboquant_4bit_nc")
    plain = generate(target, PROMPTS, 6)
    compiled = generate(target, PROMPTS, 6, drafter=drafter, compile=True)
    assert compiled.tokens == plain.tokens
    assert all(r.compilations == 1 and not r.graph_breaks for r in compiled.compile_reports.values())
    assert generate(target, PROMPTS, 6, drafter=drafter, compile=True, cudagraph=True).tokens == plain.tokens


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize("fmt", ["bf16", "turboquant_4bit_nc"])
@torch.no_grad()
def test_hybrid_dflash_compiled_and_captured_on_gpu(hf_pair, drafter_path, fmt):
    """On CUDA (flash-linear-attention's kernels): logits close to transformers', and DFlash compiled and captured
    gives plain greedy decoding's tokens."""
    hf, path = hf_pair
    target = Qwen3_5ForCausalLM.from_pretrained(path, cache_format=fmt, dtype=torch.float32, device="cuda")
    if fmt == "bf16":
        for prompt, logits in zip(PROMPTS, _prefill_logits(target, PROMPTS, "cuda")):
            want = hf.to("cuda")(torch.tensor([prompt], device="cuda")).logits[0]
            torch.testing.assert_close(logits, want, atol=5e-2, rtol=5e-2)  # K/V rounded to bf16
        hf.to("cpu")
    drafter = DFlashDrafter.from_pretrained(drafter_path, target=target, cache_format=fmt)
    plain = generate(target, PROMPTS, N)
    assert generate(target, PROMPTS, N, drafter=drafter).tokens == plain.tokens
    captured = generate(target, PROMPTS, N, drafter=drafter, compile=True, cudagraph=True)
    assert captured.tokens == plain.tokens
    oracle = generate(target, PROMPTS, N, proposer=OracleProposer(plain.tokens, 2, 4, VOCAB), cudagraph=True)
    assert oracle.tokens == plain.tokens



@torch.no_grad()
def test_loads_the_language_model_of_a_vision_language_checkpoint(tmp_path):
    """A ``Qwen3_5ForConditionalGeneration`` checkpoint: its ``model.language_model.*`` tensors load strictly, the vision
    tower is skipped, and the logits are the text model's."""
    torch.manual_seed(2)
    text = hf_config(4, 64).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=HIDDEN)
    hf = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    hf.save_pretrained(tmp_path)
    ours = Qwen3_5ForCausalLM.from_pretrained(tmp_path, cache_format="fp16", dtype=torch.float32)
    for prompt, logits in zip(PROMPTS, _prefill_logits(ours, PROMPTS)):
        torch.testing.assert_close(logits, hf(torch.tensor([prompt])).logits[0], atol=5e-3, rtol=5e-3)
