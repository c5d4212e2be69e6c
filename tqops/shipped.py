"""What tqops ships: its folder (tqops/pretrained: the held-out texts of ``tqops.train.corpus`` and the trained pair)
and the pair in it (tqops/pretrained/stdlib-py): where it lives, whether it is trained, and its tokenizer."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from tqops.formats import get_format

logger = logging.getLogger(__name__)

PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained"  # package data (pyproject.toml)
TRAINED_DIR = PRETRAINED_DIR / "stdlib-py"  # the shipped pair: target/ (with the tokenizer) and drafter/
TRAIN_COMMAND = ("python -m tqops.train target --out {d}/target && "
                 "python -m tqops.train drafter --target {d}/target --out {d}/drafter")
PROMPT_TOKENS = 128


def has_weights(folder) -> bool:
    """Whether ``folder`` is a checkpoint: config.json and at least one safetensors file."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


# The demo's drafter: DFlash2 where it is shipped (its pair decodes faster than v1's: BENCHMARKS.md, "DFlash2 against
# v1"), else v1.
DEMO_DRAFTERS = ("dflash2-drafter", "drafter")


def trained_pair(root: Path = None, drafter: str = "drafter") -> Optional[tuple[Path, Path]]:
    """``(target, drafter)`` folders of the shipped pair if both hold weights, else None (not trained yet);
    ``drafter``: the drafter's folder name (``"drafter"``, v1; ``"dflash2-drafter"``)."""
    root = Path(root) if root is not None else TRAINED_DIR
    target, drafter_dir = root / "target", root / drafter
    return (target, drafter_dir) if has_weights(target) and has_weights(drafter_dir) else None


def demo_pair(root: Path = None) -> Optional[tuple[Path, Path]]:
    """The shipped target with the first trained drafter of ``DEMO_DRAFTERS``; None if none is trained."""
    return next(filter(None, (trained_pair(root, name) for name in DEMO_DRAFTERS)), None)


def train_command(root: Path = None) -> str:
    return TRAIN_COMMAND.format(d=os.path.relpath(root if root is not None else TRAINED_DIR))


def folder_tokenizer(folder):
    """The ``tokenizers.Tokenizer`` of a checkpoint folder's tokenizer.json; None without one (or the library)."""
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:  # the "train" extra; without it the demo falls back to token ids
        logger.warning("no text: pip install tokenizers to decode the checkpoint's tokenizer.json")
        return None
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def kv_bytes_per_token(model, fmt=None) -> int:
    """KV-cache bytes one token takes in all of ``model``'s attention layers, in each layer's own format (or all in
    ``fmt``), from the formats' slot sizes."""
    return sum(get_format(fmt or attn.fmt).slot_bytes(attn.head_dim) * attn.num_kv_heads
               for attn in model.attention_layers)
