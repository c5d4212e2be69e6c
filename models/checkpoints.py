"""Checkpoint folders checked before any long work: a folder that is not the checkpoint a command line asks for
(its config.json, its safetensors' names and shapes, headers only) is one ``prog: error: ...`` line from the parser
(``tqops.cli``), not a traceback while loading."""
from __future__ import annotations

import os

import torch
from safetensors import SafetensorError, safe_open

from ..cli import Parser, folder_with_or_exit, load_or_exit
from .dflash import DFlashDrafter, is_dflash2
from .dflash2 import DFlash2Drafter
from .loading import read_config, weight_files
from .parallel import checkpoint_params
from .qwen3 import Qwen3Config, Qwen3ForCausalLM


def checkpoint_config_or_exit(parser: Parser, flag: str, path, what: str, *, target_weights: bool = True):
    """``(raw config.json dict, Qwen3Config)`` of the checkpoint folder ``path`` with its weights present, else a
    command-line error naming ``flag`` and ``what`` it should be. With ``target_weights`` the weights must also be
    those of the Qwen3 target the config makes (``weights_or_exit``: names and shapes from the safetensors headers,
    no tensor data read); without, the caller checks them against its own model."""
    folder_with_or_exit(parser, flag, path, "config.json")
    raw = load_or_exit(parser, flag, path, read_config, what="unreadable config.json")  # a JSON object
    if not isinstance(raw.get("model_type"), str):
        parser.error(f"{flag} {str(path)!r}: config.json has no model_type; expected {what}")
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                "intermediate_size"):
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            parser.error(f"{flag} {str(path)!r}: config.json {key} is {value!r}, expected a positive integer ({what})")
    # Each load names the folder (the path argument), not the config object it builds from.
    config = load_or_exit(parser, flag, path, lambda _: Qwen3Config.from_dict(raw),
                          what=f"config.json is not {what}")
    load_or_exit(parser, flag, path, weight_files, what="no readable weights")
    if target_weights:
        with torch.device("meta"):
            model = load_or_exit(parser, flag, path, lambda _: Qwen3ForCausalLM(config),
                                 what=f"config.json is not {what}")
        weights_or_exit(parser, flag, path, model, **model.checkpoint_rules())
    return raw, config


def _few(names, shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def weights_or_exit(parser: Parser, flag: str, path, model: torch.nn.Module, *, ignore=lambda name: False,
                    optional=(), rename=lambda name: name) -> None:
    """A command-line error naming ``flag`` unless the safetensors of the checkpoint folder ``path`` are readable
    and hold what ``tqops.models.loading.load_weights`` would load into ``model`` (built on the meta device, with
    that load's ``ignore``, ``optional`` and ``rename``): every parameter, in its shape, and no other tensor. Reads the
    files' headers only, so a bad checkpoint is one line before any long work rather than a traceback while
    loading."""
    found = {}
    for file in load_or_exit(parser, flag, path, weight_files, what="no readable weights"):
        try:
            with safe_open(file, framework="pt") as f:
                found.update((rename(name), tuple(f.get_slice(name).get_shape())) for name in f.keys())
        except (OSError, SafetensorError) as e:
            parser.error(f"{flag} {str(path)!r}: {os.path.relpath(file, path)} is not a readable safetensors file "
                         f"({type(e).__name__}: {e})")
    expected = {name: tuple(param.shape) for name, (param, _) in checkpoint_params(model).items()}
    missing = sorted(set(expected) - set(found) - set(optional))
    unexpected = sorted(name for name in set(found) - set(expected) if not ignore(name))
    shapes = [f"{name} has shape {list(found[name])}, expected {list(shape)}"
              for name, shape in expected.items() if name in found and found[name] != shape]
    problems = ([f"missing {_few(missing)}"] if missing else []) + \
        ([f"unexpected {_few(unexpected)}"] if unexpected else []) + shapes[:2] + \
        ([f"{len(shapes) - 2} more shapes differ"] if len(shapes) > 2 else [])
    if problems:
        parser.error(f"{flag} {str(path)!r}: weights do not match config.json: {'; '.join(problems)}")


def drafter_config_or_exit(parser: Parser, flag: str, path, target) -> None:
    """A command-line error naming ``flag`` unless ``path`` holds a DFlash drafter checkpoint that fits ``target`` (a
    ``Qwen3Config``): what ``DFlashDrafter`` and its ``share_target`` check, built on the meta device, and weights
    that match it (``weights_or_exit``, headers only)."""
    raw, config = checkpoint_config_or_exit(parser, flag, path, "a DFlash drafter checkpoint", target_weights=False)
    with torch.device("meta"):
        cls = DFlash2Drafter if is_dflash2(raw) else DFlashDrafter
        drafter = load_or_exit(parser, flag, path, lambda _: cls(config), what="not a DFlash drafter checkpoint")
    if (config.hidden_size, config.vocab_size) != (target.hidden_size, target.vocab_size):
        parser.error(f"{flag} {str(path)!r}: the drafter (hidden {config.hidden_size}, vocab {config.vocab_size}) "
                     f"does not fit the target (hidden {target.hidden_size}, vocab {target.vocab_size})")
    if max(drafter.target_layer_ids) >= target.num_hidden_layers or min(drafter.target_layer_ids) < 0:
        parser.error(f"{flag} {str(path)!r}: target_layer_ids {list(drafter.target_layer_ids)} out of range for the "
                     f"{target.num_hidden_layers}-layer target")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        parser.error(f"{flag} {str(path)!r}: mask_token_id {drafter.mask_token_id} is outside the target's "
                     f"vocabulary ({target.vocab_size})")
    # no target yet, so no embed_tokens or lm_head, as DFlashDrafter.from_pretrained loads it
    weights_or_exit(parser, flag, path, drafter, **drafter.checkpoint_rules())
