"""Command-line helpers shared by the demo, the benchmarks and the training CLI: one-line errors with exit status 2."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from safetensors import SafetensorError


class Parser(argparse.ArgumentParser):
    """Reports a bad command line as one ``prog: error: ...`` line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        # one line even where a checkpoint loader's message spans several
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def device_or_exit(parser: Parser, name: str, flag: str = "--device") -> torch.device:
    """``torch.device(name)`` if it is the CPU (no index but 0) or a CUDA device present here, else a command-line
    error."""
    try:
        device = torch.device(name)
    except RuntimeError:
        parser.error(f"{flag} {name!r} is not a torch device")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"{flag} must be cpu or cuda, got {name!r}")
    if device.type == "cpu" and device.index not in (None, 0):
        parser.error(f"{flag} {name}: the CPU has no device index {device.index} (use {flag} cpu)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"{flag} {name}: CUDA is not available here (use {flag} cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"{flag} {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def out_dir_or_exit(parser: Parser, path: str, flag: str = "--out") -> str:
    """``path`` as an output folder, made if missing; a command-line error if it names a file or cannot be made.
    Call it once the other flags are checked and before any work, so a run never ends on a bad output path."""
    if not path:
        parser.error(f"{flag} needs a folder path, got an empty one")
    if os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"{flag} {path}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        parser.error(f"{flag} {path}: cannot make this folder ({e.strerror})")
    return path


def out_file_or_exit(parser: Parser, path: str, flag: str = "--out") -> str:
    """``path`` as an output file whose folder exists or can be made (made now); a command-line error otherwise."""
    if not path:
        parser.error(f"{flag} needs a file path, got an empty one")
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: is a folder; expected a file path")
    out_dir_or_exit(parser, os.path.dirname(path) or ".", flag)
    return path


def torchrun_env_or_exit(parser: Parser, module: str) -> None:
    """With ``WORLD_SIZE`` set, torch.distributed's env:// rendezvous also needs what torchrun sets (RANK, MASTER_ADDR,
    MASTER_PORT); a command-line error names the missing ones instead of a traceback from init_process_group."""
    missing = [name for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if "WORLD_SIZE" in os.environ and missing:
        parser.error(f"WORLD_SIZE is set but {', '.join(missing)} not: run under torchrun "
                     f"(torchrun --nproc-per-node N -m {module} ...)")


# What loading a checkpoint raises on a bad folder (weights that do not match the config: ValueError; a weight file
# safetensors cannot read, e.g. truncated: SafetensorError); a tokenizer.json that tokenizers cannot parse raises a
# bare Exception, so tokenizer loads pass errors=(Exception,).
LOAD_ERRORS = (ValueError, KeyError, TypeError, OSError, NotImplementedError, SafetensorError)


def load_or_exit(parser: Parser, flag: str, path, load, errors=LOAD_ERRORS, what: str = "cannot load"):
    """``load(path)``, with ``errors`` reported as a command-line error naming ``flag``."""
    try:
        return load(path)
    except errors as e:
        parser.error(f"{flag} {str(path)!r}: {what} ({type(e).__name__}: {e})")


def folder_with_or_exit(parser: Parser, flag: str, path, file: str) -> Path:
    """``Path(path)`` if it is a folder holding ``file``, else a command-line error naming ``flag``."""
    if not os.path.isfile(os.path.join(path, file)):
        parser.error(f"{flag} {str(path)!r} {f'has no {file}' if os.path.isdir(path) else 'is not a folder'}")
    return Path(path)


def checkpoint_config_or_exit(parser: Parser, flag: str, path, what: str, *, target_weights: bool = True):
    """``(raw config.json dict, Qwen3Config)`` of the checkpoint folder ``path`` with its weights present, else a
    command-line error naming ``flag`` and ``what`` it should be. With ``target_weights`` the weights must also be
    those of the Qwen3 target the config makes (``weights_or_exit``: names and shapes from the safetensors headers,
    no tensor data read); without, the caller checks them against its own model."""
    from tqops.models.loading import read_config, weight_files
    from tqops.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

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
    from safetensors import safe_open

    from tqops.models.loading import weight_files
    from tqops.models.parallel import checkpoint_params

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
    from tqops.models.dflash import DFlashDrafter, is_dflash2
    from tqops.models.dflash2 import DFlash2Drafter

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
