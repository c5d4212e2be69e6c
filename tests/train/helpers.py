"""Paged (tqops inference) runs of a target prefill and of one DFlash draft block, as generate() sets them up; copies
of a checkpoint whose weights no longer match its config.json, for the command lines' error tests."""
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tqops.models.generate import CACHE_BLOCK_SIZE, step_context
from tqops.graphs import set_forward_context


def _table(tokens: int) -> torch.Tensor:
    return torch.arange(-(-tokens // CACHE_BLOCK_SIZE), dtype=torch.int32)[None]


def paged_prefill(target, ids: torch.Tensor, layer_ids=None):
    """The tqops target over ``ids`` ``[n]`` from position 0: hidden ``[n, H]`` (and ``[n, C]`` states)."""
    n = torch.tensor([len(ids)], dtype=torch.int32)
    table = _table(len(ids))
    target.allocate_cache(table.shape[1], CACHE_BLOCK_SIZE)
    with set_forward_context(step_context(n, n, table)):
        return target(ids, torch.arange(len(ids)), layer_ids=layer_ids)


def paged_block_logits(drafter, states: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Draft logits ``[bs - 1, V]`` of ``block`` ``[bs]`` placed right after the context rows ``states`` ``[a, C]``
    (``paged_block_hidden``)."""
    return drafter.compute_logits(paged_block_hidden(drafter, states, block)[1:])


def paged_block_hidden(drafter, states: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """The drafter's hidden ``[bs, H]`` of ``block`` ``[bs]`` placed right after the context rows ``states`` ``[a, C]``:
    the rows are stored as a prefill stores a prompt, then the block runs as a draft step with no new rows."""
    a, bs = states.shape[0], block.shape[0]
    table = _table(a + bs)
    drafter.allocate_cache(table.shape[1], CACHE_BLOCK_SIZE)
    lens = torch.tensor([a], dtype=torch.int32)
    with set_forward_context(step_context(lens, lens, table, states, torch.arange(a))):
        drafter.prefill_context(torch.zeros(a, dtype=torch.long))
    q_lens, k_lens = torch.tensor([bs], dtype=torch.int32), torch.tensor([a + bs], dtype=torch.int32)
    none = torch.full((bs,), -1)  # this step brings no context rows: slot -1, never stored
    with set_forward_context(step_context(q_lens, k_lens, table, torch.zeros(bs, states.shape[1]), none)):
        return drafter(block, torch.arange(a, a + bs))


# how break_weights spoils a checkpoint's model.safetensors, and words the command line's error must then hold
# (for "missing-tensor" and "wrong-shape": the name of the spoilt tensor)
WEIGHT_BREAKS = {"missing-tensor": None, "wrong-shape": None, "unexpected-tensor": "bogus.weight",
                 "truncated": "SafetensorError"}


def break_weights(folder: Path, out: Path, how: str) -> tuple[Path, str]:
    """A copy of the checkpoint ``folder`` at ``out``, its config.json intact and its model.safetensors spoilt as
    ``how`` (a key of ``WEIGHT_BREAKS``) says; and the words the one-line error must hold."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    file = out / "model.safetensors"
    if how == "truncated":
        data = file.read_bytes()
        file.write_bytes(data[:len(data) // 2])
        return out, WEIGHT_BREAKS[how]
    tensors = load_file(file)
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
    if how == "missing-tensor":
        del tensors[name]
    elif how == "wrong-shape":
        tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    elif how == "unexpected-tensor":
        tensors["bogus.weight"] = torch.zeros(2)
    else:
        raise ValueError(f"unknown weight break {how!r}")
    save_file(tensors, file)
    return out, WEIGHT_BREAKS[how] or name


def run_module(module: str, *argv) -> subprocess.CompletedProcess:
    """``python -m module argv...`` in a fresh interpreter, as a terminal runs it."""
    return subprocess.run([sys.executable, "-m", module, *map(str, argv)], capture_output=True, text=True,
                          timeout=300)
