"""Bad input to generate, the drafter and the configs is a clear ValueError/TypeError naming the argument, raised
before anything is allocated, compiled or run."""
import json
import math
import os
import re

import pytest
import torch

from tqops.models import DFlashDrafter, Qwen3Config, Qwen3ForCausalLM, generate

from .fixtures import qwen3_config, write_drafter, write_target

PROMPTS = [[5, 17, 42, 8, 33], [3, 61, 23, 77]]


def _no_cache(monkeypatch, *models):
    """generate must check its arguments before it allocates a cache, so before it compiles or runs anything (an
    out-of-vocab id under compile=True aborts the whole process once a kernel runs)."""
    def allocate(*args, **kwargs):
        raise AssertionError("generate allocated a cache before checking its arguments")

    for model in models:
        monkeypatch.setattr(model, "allocate_cache", allocate)


@pytest.fixture
def models(target_path, drafter_path, monkeypatch):
    """The session's target and drafter (vocab 100), with no cache allocation allowed."""
    target = Qwen3ForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_path, target=target)
    _no_cache(monkeypatch, target, drafter)
    return target, drafter


@pytest.mark.parametrize("mode", ["eager", "compile", "cudagraph", "drafter"])
@pytest.mark.parametrize("token", [100, -3], ids=["vocab-size", "negative"])
def test_out_of_vocab_prompt_ids(models, mode, token):
    target, drafter = models
    kwargs = {"eager": {}, "compile": {"compile": True}, "cudagraph": {"cudagraph": True},
              "drafter": {"drafter": drafter}}[mode]
    prompts = [PROMPTS[0], [1, 2, token, 4]]
    with pytest.raises(ValueError, match=rf"prompts\[1\]\[2\] is token id {token}, expected ids in \[0, 100\)"):
        generate(target, prompts, 4, **kwargs)


@pytest.mark.parametrize("prompts", [[5, 17, 42], torch.tensor([5, 17, 42])], ids=["flat-list", "1d-tensor"])
def test_one_prompt_without_the_batch_list(models, prompts):
    """A tokenizer's ids for one text, passed without the batch list, would otherwise run as one-token prompts."""
    with pytest.raises(ValueError, match=r"prompts\[0\] is a single token id \(5\).*pass \[ids\]"):
        generate(models[0], prompts, 4)


NOT_INTEGERS = {
    "float-list": [1.9, 2.9, 3.9],  # casting would truncate them to [1, 2, 3]
    "float-tensor": torch.tensor([1.0, 2.0]),
    "bool-tensor": torch.tensor([True, False]),
    "strings": ["a", "b"],
}


@pytest.mark.parametrize("prompt", NOT_INTEGERS.values(), ids=list(NOT_INTEGERS))
def test_prompt_ids_must_be_integers(models, prompt):
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        generate(models[0], [PROMPTS[0], prompt], 4)


BAD_ARGUMENTS = {
    "temperature-negative": ({"temperature": -0.01}, ValueError, "temperature must be a finite number >= 0"),
    "temperature-nan": ({"temperature": math.nan}, ValueError, "temperature must be a finite number >= 0"),
    "temperature-inf": ({"temperature": math.inf}, ValueError, "temperature must be a finite number >= 0"),
    "temperature-bool": ({"temperature": True}, TypeError, "temperature must be a real number"),
    "temperature-str": ({"temperature": "0.5"}, TypeError, "temperature must be a real number"),
    "top_k-negative": ({"top_k": -1}, ValueError, r"top_k must be >= 0 \(0: off\), got -1"),
    "top_k-float": ({"top_k": 5.0}, TypeError, "top_k must be an int"),
    "top_k-bool": ({"top_k": True}, TypeError, "top_k must be an int"),
    "top_p-zero": ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
    "top_p-over-one": ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\] \(1: off\), got 1.5"),
    "top_p-nan": ({"top_p": math.nan}, ValueError, r"top_p must be in \(0, 1\]"),
    "top_p-str": ({"top_p": "0.9"}, TypeError, "top_p must be a real number"),
    "max-new-tokens-float": ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an int"),
    "max-new-tokens-bool": ({"max_new_tokens": True}, TypeError, "max_new_tokens must be an int"),
    "max-new-tokens-str": ({"max_new_tokens": "4"}, TypeError, "max_new_tokens must be an int"),
    "eos-float": ({"eos_token_id": 2.5}, TypeError, "eos_token_id must be"),
    "eos-str": ({"eos_token_id": "5"}, TypeError, "eos_token_id must be"),
    "eos-list-with-float": ({"eos_token_id": [1, 2.0]}, TypeError, "eos_token_id must be"),
    "eos-float-tensor": ({"eos_token_id": torch.tensor([1.0])}, TypeError, "eos_token_id must be"),
    "eos-2d-tensor": ({"eos_token_id": torch.tensor([[1, 2]])}, TypeError, "eos_token_id must be"),
}


@pytest.mark.parametrize("kwargs,error,message", BAD_ARGUMENTS.values(), ids=list(BAD_ARGUMENTS))
def test_bad_generate_arguments(models, kwargs, error, message):
    target, drafter = models
    kwargs = {"max_new_tokens": 4, **kwargs}
    for extra in ({}, {"drafter": drafter}):
        with pytest.raises(error, match=message):
            generate(target, PROMPTS, **kwargs, **extra)


@pytest.mark.parametrize("as_tensor", [lambda e: torch.tensor(e[0]), lambda e: torch.tensor(e),
                                       lambda e: torch.tensor(e, dtype=torch.int32)],
                         ids=["0-d", "1-d", "1-d-int32"])
@torch.no_grad()
def test_eos_token_id_tensor(target_path, as_tensor):
    target = Qwen3ForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    plain = generate(target, PROMPTS, 12).tokens
    # a token prompt 0 produces mid-way (its first occurrence), and prompt 1's first token
    cut = next(i for i in range(3, 12) if plain[0][i] not in plain[0][:i])
    eos = [plain[0][cut], plain[1][0]]
    tensor = as_tensor(eos)
    expected = generate(target, PROMPTS, 12, eos_token_id=eos[:tensor.numel()]).tokens
    assert len(expected[0]) == cut + 1
    assert generate(target, PROMPTS, 12, eos_token_id=tensor).tokens == expected


@pytest.fixture
def other_targets(tmp_path):
    """Targets a drafter built for the session's target (3 layers, vocab 100, target_layer_ids (0, 2)) does not
    fit: another vocabulary, or too few layers."""
    return {"other-vocab": write_target(tmp_path / "vocab", seed=7, vocab=120),
            "fewer-layers": write_target(tmp_path / "layers", seed=7, num_layers=2),
            "same-shapes": write_target(tmp_path / "same", seed=7)}


@pytest.mark.parametrize("which", ["other-vocab", "fewer-layers", "same-shapes", "no-target"])
def test_drafter_built_for_another_target(models, drafter_path, other_targets, monkeypatch, which):
    target, drafter = models
    if which == "no-target":  # built without a target: no shared embed_tokens / lm_head at all
        with open(os.path.join(drafter_path, "config.json")) as f:
            drafter = DFlashDrafter(Qwen3Config.from_dict(json.load(f)))
    else:
        target = Qwen3ForCausalLM.from_pretrained(other_targets[which], dtype=torch.float32)
    _no_cache(monkeypatch, target, drafter)
    with pytest.raises(ValueError, match="drafter was not built for this target"):
        generate(target, PROMPTS, 4, drafter=drafter)


BAD_DRAFTER_CONFIGS = {
    "no-mask-token-id": ({"mask_token_id": None}, "needs dflash_config.mask_token_id"),
    "block-size-1": ({"block_size": 1}, "block_size must be >= 2, got 1"),  # no mask token left to draft
    "block-size-0": ({"block_size": 0}, "block_size must be >= 2, got 0"),
    "block-size-negative": ({"block_size": -2}, "block_size must be >= 2, got -2"),
}


@pytest.mark.parametrize("dflash,message", BAD_DRAFTER_CONFIGS.values(), ids=list(BAD_DRAFTER_CONFIGS))
def test_bad_drafter_config(target_path, tmp_path, dflash, message):
    target = Qwen3ForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    path = write_drafter(tmp_path / "d")
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg["dflash_config"].update(dflash)
    cfg["dflash_config"] = {k: v for k, v in cfg["dflash_config"].items() if v is not None}
    with open(file, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=message):
        DFlashDrafter.from_pretrained(path, target=target)
    with pytest.raises(ValueError, match=message):
        DFlashDrafter(Qwen3Config.from_dict(cfg), target=target)


BAD_LAYER_FORMATS = {
    "str-key": ({"0": "bf16"}, ValueError, "layer_cache_formats keys must be int layer indices, got '0'"),
    "bool-key": ({True: "bf16"}, ValueError, "layer_cache_formats keys must be int layer indices, got True"),
    "same-layer-twice": ({0: "bf16", -3: "fp16"}, ValueError,
                         "layer_cache_formats keys 0 and -3 both name layer 0, with different formats"),
    "not-a-dict": (["bf16"] * 3, TypeError, "layer_cache_formats must be a dict"),
}


@pytest.mark.parametrize("model_class", ["target", "drafter"])
@pytest.mark.parametrize("overrides,error,message", BAD_LAYER_FORMATS.values(), ids=list(BAD_LAYER_FORMATS))
def test_bad_layer_cache_formats(model_class, overrides, error, message):
    with pytest.raises(error, match=message):
        if model_class == "target":
            Qwen3ForCausalLM(Qwen3Config.from_dict(qwen3_config(num_layers=3)), layer_cache_formats=overrides)
        else:
            cfg = qwen3_config(num_layers=3, dflash_config={"target_layer_ids": [0], "mask_token_id": 99})
            DFlashDrafter(Qwen3Config.from_dict(cfg), layer_cache_formats=overrides)


@pytest.mark.parametrize("max_window_layers", [1, None], ids=["max-window-layers-1", "max-window-layers-default"])
def test_sliding_window_default_matches_transformers(max_window_layers):
    """use_sliding_window without a "sliding_window" key: transformers' Qwen3Config defaults the window to 4096."""
    transformers = pytest.importorskip("transformers")
    d = qwen3_config(num_layers=3, use_sliding_window=True)
    del d["layer_types"], d["sliding_window"], d["architectures"]
    if max_window_layers is not None:
        d["max_window_layers"] = max_window_layers
    ours, hf = Qwen3Config.from_dict(d), transformers.Qwen3Config(**d)
    assert ours.sliding_window == hf.sliding_window == 4096
    assert list(ours.layer_types) == list(hf.layer_types)


# ---- checkpoint configs -------------------------------------------------------------------------------------------

def _qwen3_5_config():
    return {"model_type": "qwen3_5_text", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
            "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 1,
            "linear_num_value_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 32}


def _without(d, field):
    return {k: v for k, v in d.items() if k != field}


# name: (model, config.json contents, the field the error names)
BAD_CHECKPOINT_CONFIGS = {
    "qwen3-a-list": ("qwen3", [qwen3_config()], r"config.json holds a JSON list; expected an object"),
    "qwen3-no-vocab_size": ("qwen3", _without(qwen3_config(), "vocab_size"), r"config.json has no 'vocab_size'"),
    "qwen3-string-size": ("qwen3", qwen3_config(hidden_size="64"),
                          r"config.json: hidden_size is '64'; expected an int"),
    "qwen3-negative-layers": ("qwen3", qwen3_config(num_hidden_layers=-1, layer_types=None),
                              r"config.json: num_hidden_layers is -1; expected an int >= 1"),
    "qwen3-float-heads": ("qwen3", qwen3_config(num_attention_heads=2.0), "num_attention_heads is 2.0"),
    "qwen3-string-eps": ("qwen3", qwen3_config(rms_norm_eps="1e-6"), "rms_norm_eps is '1e-6'; expected a finite"),
    "qwen3-string-theta": ("qwen3", qwen3_config(rope_parameters={"rope_theta": "1e6"}),
                           r"config.json \(rope_parameters\): rope_theta is '1e6'"),
    "qwen3-layer-types-not-a-list": ("qwen3", qwen3_config(layer_types="full_attention"),
                                     "layer_types is 'full_attention'; expected a list"),
    "qwen3_5-a-string": ("qwen3_5", "Qwen3.5", r"config.json holds a JSON str"),
    "qwen3_5-no-linear-heads": ("qwen3_5", _without(_qwen3_5_config(), "linear_num_key_heads"),
                                r"config.json has no 'linear_num_key_heads'"),
    "qwen3_5-text-config-a-list": ("qwen3_5", {"text_config": [1, 2]},
                                   r"config.json \(text_config\): text_config is a list"),
    "qwen3_5-text-config-zero-vocab": ("qwen3_5", {"text_config": dict(_qwen3_5_config(), vocab_size=0)},
                                       r"config.json \(text_config\): vocab_size is 0; expected an int >= 1"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINT_CONFIGS))
def test_bad_checkpoint_config_names_the_file_and_field(tmp_path, case):
    from tqops.models import Qwen3_5ForCausalLM

    model, config, message = BAD_CHECKPOINT_CONFIGS[case]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    cls = Qwen3ForCausalLM if model == "qwen3" else Qwen3_5ForCausalLM
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + ".*" + message):
        cls.from_pretrained(tmp_path)


def test_config_that_is_not_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{vocab_size: 100")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        Qwen3ForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("index", [{"metadata": {}}, {"weight_map": ["model-00001.safetensors"]}, [1]],
                         ids=["no-weight-map", "weight-map-a-list", "a-list"])
def test_shard_index_without_a_weight_map_names_the_file(tmp_path, index):
    path = write_target(tmp_path / "t", shards=2)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match=r"model.safetensors.index.json has no weight_map"):
        Qwen3ForCausalLM.from_pretrained(path)


def test_from_pretrained_names_a_device_that_is_not_here(target_path):
    with pytest.raises(ValueError, match=r"device='cuda:99', but (this torch has no CUDA device|only)"):
        Qwen3ForCausalLM.from_pretrained(target_path, device="cuda:99")
