"""Forward hooks that collect chosen decoder layers' outputs of a model, only for the duration of a ``with`` block."""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

from torch import nn


@contextlib.contextmanager
def layer_outputs(layers: Sequence[nn.Module], layer_ids: Sequence[int]) -> Iterator[dict]:
    """Collects ``{i: output of layers[i]}`` for ``i`` in ``layer_ids`` during the ``with`` block (the first
    element where a layer returns a tuple). The hooks come off on exit, so forwards outside the block (a
    generation loop, say) neither run them nor keep their outputs alive.

    Hooks rather than transformers' ``output_hidden_states``: that keeps every layer's states, and replaces the
    last entry with the final-normed state, while DFlash reads each layer's output before the final norm.
    """
    outputs = {}

    def saver(i):
        def save(module, args, output):
            outputs[i] = output[0] if isinstance(output, tuple) else output
        return save

    handles = [layers[i].register_forward_hook(saver(i)) for i in sorted(set(layer_ids))]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()
