"""Command-line helpers shared by the demo, the benchmarks and the training CLI: one-line errors with exit status 2."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch


class Parser(argparse.ArgumentParser):
    """Reports a bad command line as one ``prog: error: ...`` line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        # one line even where a checkpoint loader's message spans several
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def device_or_exit(parser: Parser, name: str, flag: str = "--device") -> torch.device:
    """``torch.device(name)`` if it is the CPU or a CUDA device present here, else a command-line error."""
    try:
        device = torch.device(name)
    except RuntimeError:
        parser.error(f"{flag} {name!r} is not a torch device")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"{flag} must be cpu or cuda, got {name!r}")
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


# What loading a checkpoint raises on a bad folder; a tokenizer.json that tokenizers cannot parse raises a bare
# Exception, so tokenizer loads pass errors=(Exception,).
LOAD_ERRORS = (ValueError, KeyError, TypeError, OSError, NotImplementedError)


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


def checkpoint_config_or_exit(parser: Parser, flag: str, path, what: str):
    """``(raw config.json dict, Qwen3Config)`` of the checkpoint folder ``path`` with its weights present, else a
    command-line error naming ``flag`` and ``what`` it should be. Reads no weights."""
    from tqops.models.loading import read_config, weight_files
    from tqops.models.qwen3 import Qwen3Config

    folder_with_or_exit(parser, flag, path, "config.json")
    raw = load_or_exit(parser, flag, path, read_config, what="unreadable config.json")
    if not isinstance(raw, dict):
        parser.error(f"{flag} {str(path)!r}: config.json holds a {type(raw).__name__}, expected the JSON object of "
                     f"{what}")
    if not isinstance(raw.get("model_type"), str):
        parser.error(f"{flag} {str(path)!r}: config.json has no model_type; expected {what}")
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                "intermediate_size"):
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            parser.error(f"{flag} {str(path)!r}: config.json {key} is {value!r}, expected a positive integer ({what})")
    config = load_or_exit(parser, flag, raw, Qwen3Config.from_dict, what=f"config.json is not {what}")
    load_or_exit(parser, flag, path, weight_files, what="no readable weights")
    return raw, config


def drafter_config_or_exit(parser: Parser, flag: str, path, target) -> None:
    """A command-line error naming ``flag`` unless ``path`` holds a DFlash drafter checkpoint that fits ``target`` (a
    ``Qwen3Config``): what ``DFlashDrafter`` and its ``share_target`` check, built on the meta device (no weights)."""
    from tqops.models.dflash import DFlashDrafter

    _, config = checkpoint_config_or_exit(parser, flag, path, "a DFlash drafter checkpoint")
    with torch.device("meta"):
        drafter = load_or_exit(parser, flag, config, DFlashDrafter, what="not a DFlash drafter checkpoint")
    if (config.hidden_size, config.vocab_size) != (target.hidden_size, target.vocab_size):
        parser.error(f"{flag} {str(path)!r}: the drafter (hidden {config.hidden_size}, vocab {config.vocab_size}) "
                     f"does not fit the target (hidden {target.hidden_size}, vocab {target.vocab_size})")
    if max(drafter.target_layer_ids) >= target.num_hidden_layers or min(drafter.target_layer_ids) < 0:
        parser.error(f"{flag} {str(path)!r}: target_layer_ids {list(drafter.target_layer_ids)} out of range for the "
                     f"{target.num_hidden_layers}-layer target")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        parser.error(f"{flag} {str(path)!r}: mask_token_id {drafter.mask_token_id} is outside the target's "
                     f"vocabulary ({target.vocab_size})")
