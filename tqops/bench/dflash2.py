"""What DFlash2's modules cost: the captured draft step of a v1 drafter and of a DFlash2 drafter of one shape."""
from __future__ import annotations

from typing import Sequence

import torch
from tqdm import tqdm

from tqops.cudagraph import steps as cg
from tqops.graphs import slots_for_positions
from tqops.models import Qwen3Config
from tqops.models.dflash2 import DFlash2Drafter
from tqops.models.generate import CACHE_BLOCK_SIZE as BLOCK
from tqops.models.steps import drafter_step, step_uniforms

from .e2e import SHAPES, _compiled, build_models, fill_caches
from .timing import median_ms

# The modules' sizes at a 4096-wide drafter (no published default to copy: z-lab's config leaves them to the
# checkpoint): a 4-tap conv with one dynamic tap weight per 64 channels, a rank-64 selector over 8 candidates.
DFLASH2_FIELDS = dict(conv_kernel_size=4, conv_group_size=64, selector_rank=64, selector_top_k=8)


def dflash2_config(drafter_cfg: dict, fields: dict = DFLASH2_FIELDS) -> dict:
    """The v1 drafter config ``drafter_cfg`` as a DFlash2 one: ``architectures`` and the modules' ``fields``."""
    return dict(drafter_cfg, architectures=["DFlash2DraftModel"],
                dflash_config={**drafter_cfg["dflash_config"], **fields})


def draft_runner(drafter, batches: Sequence[int], per_seq: int, temperature: float, device):
    """The drafter's compiled step over ``drafter.block_size`` tokens per sequence as a runner for ``batches``."""
    step = drafter_step(drafter, temperature)
    return cg.make_runner(_compiled(step), q_len=drafter.block_size, max_batch=max(batches), max_blocks=per_seq,
                          block_size=BLOCK, device=device, buckets=list(batches), context_dim=drafter.context_dim,
                          context_dtype=drafter.fc.weight.dtype, uniforms=step_uniforms(drafter, temperature))


def fill_draft(runner, drafter, table: torch.Tensor, batch: int, context: int) -> None:
    """Static inputs of ``runner``'s ``batch`` bucket: a block at ``context`` after a block of context rows."""
    dev, bs = table.device, drafter.block_size
    lens, rows = torch.full((batch,), context, device=dev), torch.arange(batch, device=dev)
    pos = (lens[:, None] + torch.arange(bs, device=dev)).flatten()
    ctx_pos = pos - bs
    slots = slots_for_positions(ctx_pos, rows.repeat_interleave(bs), table[:batch], BLOCK)
    states = torch.randn(batch * bs, drafter.context_dim, device=dev, dtype=drafter.fc.weight.dtype)
    uniforms = torch.rand(batch * bs, device=dev) if runner.buffers.uniforms is not None else None
    runner.buffers.fill(batch, torch.randint(0, drafter.config.vocab_size, (batch * bs,), device=dev), pos,
                        (lens + bs).int(), cg.tables(table[:batch]), context_states=states,
                        context_positions=ctx_pos, context_slot_mappings=cg.tables(slots), uniforms=uniforms)


def replay(runner, batch: int):
    """The captured graph of ``batch``; where nothing is captured (CPU), the compiled step it would replay."""
    return runner.graphs[batch].replay if batch in runner.graphs else lambda: runner._run(batch)


@torch.no_grad()
def bench_dflash2(shape: str = "qwen3-8b", fmt: str = "bf16", batches: Sequence[int] = (1, 8),
                  temperatures: Sequence[float] = (0.0, 1.0), device="cuda") -> list[dict]:
    """One row per (temperature, batch): ms of the captured draft step of the shape's v1 drafter and of the same
    drafter with DFlash2's convolutions and selector (``DFLASH2_FIELDS``), random weights, ``context`` cached
    tokens; their ratio is what the modules cost."""
    target_cfg, drafter_cfg, context = SHAPES[shape]
    target, v1 = build_models(fmt, target_cfg, drafter_cfg, device=device)
    with torch.device(device):
        v2 = DFlash2Drafter(Qwen3Config.from_dict(dflash2_config(drafter_cfg)), cache_format=fmt, target=target)
    v2 = v2.to(v1.fc.weight.dtype).eval()
    per_seq = -(-(context + 2 * v1.block_size) // BLOCK)
    tables = {name: fill_caches((d,), max(batches), context, per_seq) for name, d in (("v1", v1), ("dflash2", v2))}
    rows = []
    for temperature in tqdm(temperatures, desc="dflash2 draft step"):
        runners = {}
        for name, drafter in (("v1", v1), ("dflash2", v2)):
            runners[name] = draft_runner(drafter, batches, per_seq, temperature, tables[name].device)
            fill_draft(runners[name], drafter, tables[name], max(batches), context)
            runners[name].capture(progress=False)
        for batch in batches:
            row = dict(format=fmt, shape=shape, context=context, temperature=temperature, batch=batch)
            for name, drafter in (("v1", v1), ("dflash2", v2)):
                fill_draft(runners[name], drafter, tables[name], batch, context)
                row[f"{name}_draft_ms"] = median_ms(replay(runners[name], batch))
            row["dflash2/v1"] = row["dflash2_draft_ms"] / row["v1_draft_ms"]
            rows.append(row)
            tqdm.write(str({c: (round(v, 3) if isinstance(v, float) else v) for c, v in row.items()}))
        del runners
    return rows


if __name__ == "__main__":
    import argparse

    from .table import markdown_table

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--format", default="bf16")
    a = p.parse_args()
    print(markdown_table(bench_dflash2(a.shape, a.format)))
