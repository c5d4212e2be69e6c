"""Command-line helpers shared by the demo and the training CLI: one-line errors with exit status 2."""
from __future__ import annotations

import argparse

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
