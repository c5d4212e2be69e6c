"""The shipped pair (tqops/pretrained/stdlib-py): where it lives, whether it is trained, its tokenizer and prompts."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import tqops
from tqops.train.corpus import PRETRAINED_DIR, read_heldout

TRAINED_DIR = PRETRAINED_DIR / "stdlib-py"  # the shipped pair: target/ (with the tokenizer) and drafter/
TRAIN_COMMAND = ("python -m tqops.train target --out {d}/target && "
                 "python -m tqops.train drafter --target {d}/target --out {d}/drafter")
PROMPT_TOKENS = 128


def has_weights(folder) -> bool:
    """Whether ``folder`` is a checkpoint: config.json and at least one safetensors file."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def trained_pair(root: Path = None) -> Optional[tuple[Path, Path]]:
    """``(target, drafter)`` folders of the shipped pair if both hold weights, else None (not trained yet)."""
    root = Path(root) if root is not None else TRAINED_DIR
    target, drafter = root / "target", root / "drafter"
    return (target, drafter) if has_weights(target) and has_weights(drafter) else None


def train_command(root: Path = None) -> str:
    return TRAIN_COMMAND.format(d=os.path.relpath(root if root is not None else TRAINED_DIR))


def folder_tokenizer(folder):
    """The ``tokenizers.Tokenizer`` of a checkpoint folder's tokenizer.json; None without one (or the library)."""
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:  # the "train" extra; without it the demo falls back to token ids
        print("no text: pip install tokenizers to decode the checkpoint's tokenizer.json")
        return None
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def mid_file_prompts(tok, count: int, prompt_tokens: int) -> list[tuple[str, list[int]]]:
    """``(path, ids)`` of up to ``count`` held-out prompts: from each committed held-out text in path order, the last
    ``prompt_tokens`` tokens of the text before its last line break ahead of its middle character (texts with fewer
    tokens there are skipped).

    A prompt ends where a line of code ends, so the continuation starts a fresh line with its indentation (the
    tokenizer joins a line break and the indentation after it into one token); the middle of a file is code, not
    the module docstring its start is.
    """
    prompts = []
    for f in read_heldout():
        cut = f.text.rfind("\n", 0, len(f.text) // 2)
        ids = tok.encode(f.text[:cut]).ids if cut > 0 else []
        if len(ids) >= prompt_tokens:
            prompts.append((f.path, ids[-prompt_tokens:]))
        if len(prompts) == count:
            break
    return prompts


def kv_bytes_per_token(model, fmt=None) -> int:
    """KV-cache bytes one token takes in all of ``model``'s attention layers, in each layer's own format (or all in
    ``fmt``), from the formats' slot sizes."""
    return sum(tqops.get_format(fmt or attn.fmt).slot_bytes(attn.head_dim) * attn.num_kv_heads
               for attn in model.attention_layers)
