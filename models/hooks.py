"""Forward hooks that collect the hidden states a DFlash drafter reads from a decoder, only inside a ``with`` block."""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

from torch import nn


@contextlib.contextmanager
def layer_outputs(decoder: nn.Module, layer_ids: Sequence[int]) -> Iterator[dict]:
    """Collects ``{i: transformers' hidden_states[i + 1]}`` for ``i`` in ``layer_ids`` during the ``with`` block:
    the output of ``decoder.layers[i]`` (the first element where a layer returns a tuple), except for the last layer,
    whose entry is the output of ``decoder.norm``. That is what z-lab's DFlash reads (``hidden_states[layer_id + 1]``,
    whose last entry is final-normed), so drafters trained either way read the same states.

    Hooks rather than ``output_hidden_states``: that keeps every layer's states alive. The hooks come off on exit,
    so forwards outside the block (a generation loop, say) neither run them nor keep their outputs alive.
    """
    outputs = {}
    last = len(decoder.layers) - 1

    def saver(i):
        def save(module, args, output):
            outputs[i] = output[0] if isinstance(output, tuple) else output
        return save

    modules = {i: decoder.norm if i == last else decoder.layers[i] for i in sorted(set(layer_ids))}
    handles = [module.register_forward_hook(saver(i)) for i, module in modules.items()]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()
