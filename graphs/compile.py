"""Compile a model with the project's settings and report graph breaks and recompilations."""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass
class CompileReport:
    """compilations: graphs handed to the backend (1 = no recompilation); graph_breaks: reason -> count."""

    compilations: int = 0
    graph_breaks: dict = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        breaks = ", ".join(f"{r} x{n}" for r, n in self.graph_breaks.items()) or "none"
        return f"{self.compilations} compilation(s); graph breaks: {breaks}"


class ModelLocal(dict):
    """State kept in a model's ``__dict__`` that closes over that model (its compiled steps, captured graphs). A
    copy or pickle of the model starts without it: copied entries would still run the original model, with the
    original's weights and caches."""

    def __reduce__(self):
        return type(self), ()


def model_local(model, name: str) -> ModelLocal:
    """``model``'s ``ModelLocal`` called ``name``, made empty on first use. A plain attribute, not a submodule or
    buffer; its entries reference the model, a cycle the garbage collector frees with it."""
    kept = model.__dict__.get(name)
    if kept is None:
        kept = ModelLocal()
        object.__setattr__(model, name, kept)
    return kept


def compile_model(fn: Callable, *, fullgraph: bool = True, dynamic=None, backend="inductor"):
    """``torch.compile(fn, fullgraph=True)`` for inference (calls run under no_grad), counting compilations and breaks.

    Returns ``(compiled, report)``; ``report`` updates as calls compile. With ``fullgraph=True`` a graph break is
    an error at compile time; with ``fullgraph=False`` breaks are counted in ``report.graph_breaks``.
    """
    report = CompileReport()
    inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend

    def counting_backend(gm, example_inputs):
        report.compilations += 1
        return inner(gm, example_inputs)

    breaks_before = collections.Counter(torch._dynamo.utils.counters["graph_break"])
    compiled = torch.compile(fn, fullgraph=fullgraph, dynamic=dynamic, backend=counting_backend)

    @torch.no_grad()
    def run(*args, **kwargs):
        out = compiled(*args, **kwargs)
        report.graph_breaks = dict(collections.Counter(torch._dynamo.utils.counters["graph_break"]) - breaks_before)
        return out

    return run, report


def mark_token_dim_dynamic(*tensors: torch.Tensor) -> None:
    """Mark dim 0 (tokens) of each input as dynamic before calling a compiled model.

    Unbacked rather than ``mark_dynamic``: a backed size specializes on 0 and 1, so the first 1-token decode step
    would recompile; an unbacked one gives one graph for every token count.
    """
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)
