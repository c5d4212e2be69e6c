"""Run records written next to a checkpoint: the JSON training log and its loss plot."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from .plot import plot_log

LOG_FILE, PLOT_FILE = "training_log.json", "loss.png"


def write_json(path, data: dict) -> None:
    """``data`` as indented JSON at ``path``, written whole (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def jsonable(obj):
    """Dataclasses, tuples and paths as JSON values."""
    if dataclasses.is_dataclass(obj):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def plot_or_warn(log: dict, path: Path) -> bool:
    """Draw the log's loss plot at ``path``; without matplotlib say so on stderr instead."""
    try:
        plot_log(log, path)
        return True
    except ImportError as e:  # matplotlib is the optional "train" extra; the JSON log has every number
        print(f"no plot: {e} (python -m tqops.train plot {Path(path).parent / LOG_FILE} draws it later)",
              file=sys.stderr)
        return False
