"""The Python standard library as a corpus: its files, their train / validation / held-out split, the held-out file.

The corpus is every ``*.py`` file under the running interpreter's ``sysconfig.get_paths()["stdlib"]``, walked in
sorted order, leaving out directories named in ``EXCLUDED_DIRS`` (test suites, installed packages, caches, the pydoc
topic strings), ``config-*`` directories, ``_sysconfigdata*`` modules (generated per build), codec tables generated
by ``gencodec.py`` (``GENERATED_MARK`` in the text), and files that are not UTF-8.

Split rule, per file: ``bucket = int.from_bytes(sha256(rel_path).digest()[:8], "big") % 100``, where ``rel_path``
is the path relative to the stdlib root with ``/`` separators (e.g. ``"json/decoder.py"``). Held-out iff
``bucket < HELDOUT_BUCKETS``, validation iff ``bucket < HELDOUT_BUCKETS + VALID_BUCKETS``, else train. The rule
depends on the path alone, so a file keeps its split on every Python version and machine; a held-out or validation
path is never trained on, whichever interpreter runs.

The held-out texts are committed (``HELDOUT_FILE``: JSON lines ``{"path", "text"}``, sorted by path, each text cut
at the last newline before ``HELDOUT_CHARS``), so evaluation is the same everywhere; training and validation read
whatever stdlib the machine has. Validation picks the checkpoint kept at the end of training, so the held-out texts
only ever measure.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

from ..shipped import PRETRAINED_DIR

HELDOUT_FILE = PRETRAINED_DIR / "stdlib-heldout.jsonl"
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                           "lib-dynload", "pydoc_data"})
GENERATED_MARK = "gencodec.py"
HELDOUT_BUCKETS, VALID_BUCKETS = 4, 3
HELDOUT_CHARS = 20_000


@dataclasses.dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root, "/"-separated
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def bucket(rel_path: str) -> int:
    """The file's split bucket in [0, 100): a stable hash of its stdlib-relative path (not ``hash()``, salted)."""
    return int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big") % 100


def split_of(rel_path: str) -> str:
    """``"heldout"``, ``"valid"`` or ``"train"`` (the rule in the module docstring)."""
    b = bucket(rel_path)
    if b < HELDOUT_BUCKETS:
        return "heldout"
    return "valid" if b < HELDOUT_BUCKETS + VALID_BUCKETS else "train"


def source_paths(root: Optional[Path] = None) -> list[str]:
    """Relative paths of the corpus's candidate files under ``root`` (default: this interpreter's stdlib), sorted."""
    root = Path(root) if root is not None else stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith("config-"))
        rel = Path(folder).relative_to(root)
        found += [(rel / f).as_posix() for f in files if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return sorted(found)


def iter_sources(split: Optional[str] = None, root: Optional[Path] = None) -> Iterator[SourceFile]:
    """The corpus files of ``split`` (every split when None), sorted by path."""
    root = Path(root) if root is not None else stdlib_root()
    for rel in source_paths(root):
        if split is not None and split_of(rel) != split:
            continue
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if GENERATED_MARK not in text:
            yield SourceFile(rel, text)


def cut(text: str, limit: int) -> str:
    """``text`` up to its last newline within ``limit`` characters (all of it when shorter)."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    newline = head.rfind("\n")
    return head[:newline + 1] if newline >= 0 else head


def write_heldout(path: Path = HELDOUT_FILE, root: Optional[Path] = None) -> list[SourceFile]:
    """Write the held-out texts of ``root``'s stdlib to ``path`` (the committed file); returns what was written."""
    files = [SourceFile(f.path, cut(f.text, HELDOUT_CHARS)) for f in iter_sources("heldout", root)]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        for f in files:
            out.write(json.dumps({"path": f.path, "text": f.text}, ensure_ascii=False) + "\n")
    return files


def read_heldout(path: Path = HELDOUT_FILE) -> list[SourceFile]:
    """The committed held-out texts."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [SourceFile(row["path"], row["text"]) for row in rows]
