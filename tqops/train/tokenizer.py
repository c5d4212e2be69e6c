"""Byte-level BPE tokenizer for Python source, trained with the tokenizers library and saved for AutoTokenizer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from ..shipped import TRAINED_DIR

SHIPPED_DIR = TRAINED_DIR / "target"
VOCAB_SIZE = 4096
MAX_LENGTH = 2048
EOS, PAD, MASK = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = (EOS, PAD, MASK)  # ids 0, 1, 2
# Pre-split before byte-level BPE: an identifier (underscores included) with one leading non-alphanumeric
# character, up to 3 digits, a run of punctuation with an optional leading space, a line break together with the
# indentation that follows it (one token per common indentation level), or other whitespace.
SPLIT_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{L}_][\p{L}\p{N}_]*|\p{N}{1,3}| ?[^\s\p{L}\p{N}_]+"
                 r"|[ \t]*[\r\n]+[ \t]*|\s+(?!\S)|\s+")
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def empty_tokenizer() -> Tokenizer:
    """The untrained pipeline: no normalizer (so decoding returns the exact input), split, bytes, BPE."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Sequence[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """BPE of ``vocab_size`` tokens (special tokens and all 256 bytes included) over ``texts``.

    Deterministic for the same texts in the same order: the trainer breaks count ties by pair.
    """
    tok = empty_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def save_tokenizer(tok: Tokenizer, folder) -> list[Path]:
    """``tokenizer.json`` plus the config files ``transformers.AutoTokenizer.from_pretrained(folder)`` reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"), pretty=False)
    special = {"eos_token": EOS, "pad_token": PAD, "mask_token": MASK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": MAX_LENGTH,
        # the default clean-up drops spaces before punctuation, which would change decoded code
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    for name, data in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (folder / name).write_text(json.dumps(data, indent=2) + "\n")
    return [folder / name for name in FILES]


def load_tokenizer(folder=SHIPPED_DIR) -> Tokenizer:
    """The ``tokenizers`` object of a saved folder (the shipped one by default)."""
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """``{"eos": id, "pad": id, "mask": id}``."""
    return {name: tok.token_to_id(token) for name, token in zip(("eos", "pad", "mask"), SPECIAL_TOKENS)}


def chars_per_token(tok: Tokenizer, texts: Iterable[str]) -> float:
    texts = list(texts)
    return sum(map(len, texts)) / max(1, sum(len(e.ids) for e in tok.encode_batch(texts)))
