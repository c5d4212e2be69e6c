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


def subset_or_exit(parser: Parser, flag: str, text: str, known) -> list[str]:
    """The comma-separated names of ``text``, each one of ``known``, else a command-line error naming ``flag``."""
    names = text.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; expected a comma-separated subset of {', '.join(known)}")
    return names
