"""End-to-end step costs: a Qwen3-shaped target (0.6B or 8B) and a 5-layer DFlash drafter per cache format, captured."""
from __future__ import annotations

import os
import time
import traceback
from typing import Optional, Sequence

import torch
from tqdm import tqdm

import tqops
from tqops.cudagraph import steps as cg
from tqops.graphs import compile_model, mark_token_dim_dynamic, slots_for_positions
from tqops.models import DFlashDrafter, Qwen3Config, Qwen3ForCausalLM
from tqops.models.generate import CACHE_BLOCK_SIZE as BLOCK
from tqops.models.steps import drafter_step, target_step

from .timing import copy_bandwidth, median_ms

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
DRAFTER = dict(QWEN3_0_6B, num_hidden_layers=5, block_size=16,
               dflash_config={"target_layer_ids": [1, 7, 13, 19, 25], "mask_token_id": 151669})
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
DRAFTER_8B = dict(QWEN3_8B, num_hidden_layers=5, block_size=16,
                  dflash_config={"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669})
# name -> (target config, drafter config, context): the shapes the issues' targets are stated at.
SHAPES = {"qwen3-0.6b": (QWEN3_0_6B, DRAFTER, 8192), "qwen3-8b": (QWEN3_8B, DRAFTER_8B, 32768)}
BUDGET_GIB = 16


def build_models(fmt: str, target_cfg: dict = QWEN3_0_6B, drafter_cfg: dict = DRAFTER, device="cuda",
                 dtype=torch.bfloat16):
    """Random weights (seeded, so every format runs the same model)."""
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(Qwen3Config.from_dict(target_cfg), cache_format=fmt).to(dtype).eval()
        drafter = DFlashDrafter(Qwen3Config.from_dict(drafter_cfg), cache_format=fmt, target=target)
    return target, drafter.to(dtype).eval()


def fill_caches(models, batch: int, context: int, per_seq: int) -> torch.Tensor:
    """Random K/V for ``context`` tokens of each of ``batch`` sequences in every layer; returns the block table."""
    cfg, dev = models[0].config, models[0].lm_head.weight.device
    table = torch.arange(batch * per_seq, dtype=torch.int32, device=dev).view(batch, per_seq)
    pos = torch.arange(context, device=dev).repeat(batch)
    seq = torch.arange(batch, device=dev).repeat_interleave(context)
    slots = slots_for_positions(pos, seq, table, BLOCK)
    k, v = (torch.randn(batch * context, cfg.num_key_value_heads, cfg.head_dim, device=dev,
                        dtype=models[0].lm_head.weight.dtype) for _ in range(2))
    for model in models:
        model.allocate_cache(batch * per_seq, BLOCK, dev)
        for attn in model.attention_layers:  # the same K/V in every layer: only the step cost matters
            tqops.kv_store(k, v, attn.kv_cache, slots, attn.fmt)
    return table


def decode_runner(target, batches: Sequence[int], context: int, room: int = BLOCK, compile: bool = True):
    """``(runner, block_table)``: the target's decode step (q_len 1, compiled) as a CudaGraphRunner for ``batches``,
    over caches holding ``context`` random keys per sequence and room for ``room`` more; ``fill_decode`` sets a
    bucket's static inputs."""
    per_seq = -(-(context + room) // BLOCK)
    table = fill_caches((target,), max(batches), context, per_seq)
    step = target_step(target)
    runner = cg.make_runner(_compiled(step) if compile else step, q_len=1, max_batch=max(batches),
                            max_blocks=per_seq, block_size=BLOCK, device=table.device, buckets=list(batches))
    return runner, table


def fill_decode(runner, table: torch.Tensor, batch: int, context: int) -> None:
    """Static inputs of ``runner``'s ``batch`` bucket: one token per sequence at position ``context``."""
    table = table[:batch]
    lens = torch.full((batch,), context, device=table.device)
    ids = torch.zeros(batch, dtype=torch.long, device=table.device)
    runner.buffers.fill(batch, ids, lens, (lens + 1).int(), cg.tables(table))


class SpecBench:
    """Runners for one format: eager and compiled target/drafter steps, decode (q_len 1) and verify/draft (q_len 16).

    One compiled target step (with the drafter's aux layers, a small concat) serves decode and verify: the token
    dim is unbacked, so each model compiles once per format.
    """

    def __init__(self, target, drafter, table, context: int, batches: Sequence[int], compile: bool = True):
        self.target, self.drafter, self.table, self.context = target, drafter, table, context
        self.bs, self.dev, self.dtype = drafter.block_size, table.device, drafter.fc.weight.dtype
        shape = dict(max_batch=max(batches), max_blocks=table.shape[1], block_size=BLOCK, device=self.dev,
                     buckets=batches)
        ctx = dict(context_dim=drafter.context_dim, context_dtype=self.dtype)
        wrap = _compiled if compile else (lambda f: f)
        t_eager, d_eager = target_step(target, drafter.target_layer_ids), drafter_step(drafter)
        t_step, d_step = wrap(t_eager), wrap(d_eager)
        self.decode_eager = cg.make_runner(t_eager, q_len=1, **shape)
        self.decode = cg.make_runner(t_step, q_len=1, **shape)
        self.verify = cg.make_runner(t_step, q_len=self.bs, **shape)
        self.draft_eager = cg.make_runner(d_eager, q_len=self.bs, **shape, **ctx)
        self.draft = cg.make_runner(d_step, q_len=self.bs, **shape, **ctx)
        for r in (self.decode, self.verify, self.draft):
            r.capture(progress=False)

    def fill(self, batch: int) -> None:
        """Static inputs of every runner for ``batch`` sequences at ``context`` keys (draft: a full context block)."""
        dev = self.dev
        L = torch.full((batch,), self.context, device=dev)
        table, tabs = self.table[:batch], cg.tables(self.table[:batch])
        ids = torch.randint(0, self.target.config.vocab_size, (batch,), device=dev)
        for r in (self.decode_eager, self.decode):
            r.buffers.fill(batch, ids, L, (L + 1).int(), tabs)
        offs = torch.arange(self.bs, device=dev)
        pos = (L[:, None] + offs).flatten()
        block = torch.randint(0, self.target.config.vocab_size, (batch * self.bs,), device=dev)
        self.verify.buffers.fill(batch, block, pos, (L + self.bs).int(), tabs)
        ctx_pos = pos - self.bs
        slots = slots_for_positions(ctx_pos, torch.arange(batch, device=dev).repeat_interleave(self.bs), table, BLOCK)
        states = torch.randn(batch * self.bs, self.drafter.context_dim, device=dev, dtype=self.dtype)
        for r in (self.draft_eager, self.draft):
            r.buffers.fill(batch, block, pos, (L + self.bs).int(), tabs, context_states=states,
                           context_positions=ctx_pos, context_slot_mappings=cg.tables(slots))

    def spec_loop(self, batch: int, k: int, steps: int = 12) -> float:
        """Seconds per speculative step (draft + verify + bookkeeping, one host sync) with acceptance fixed at k.

        The controllable proposer: the drafter runs as usual, but exactly k drafts are accepted per step, so the
        cost is measured at a known acceptance (random weights would accept ~0).
        """
        bs, dev = self.bs, self.dev
        table, tabs = self.table[:batch], cg.tables(self.table[:batch])
        L = torch.full((batch,), self.context, device=dev)
        pending = torch.zeros(batch, dtype=torch.long, device=dev)
        states = torch.zeros(batch, bs, self.drafter.context_dim, device=dev, dtype=self.dtype)
        ctx_pos = torch.full((batch, bs), -1, device=dev)
        offs, rows = torch.arange(bs, device=dev), torch.arange(batch, device=dev)
        accepted = torch.full((batch,), min(k, bs - 1), device=dev)
        for i in range(steps + 2):  # two untimed steps
            if i == 2:
                _sync(dev)
                start = time.perf_counter()
            pos, k_lens = (L[:, None] + offs).flatten(), (L + bs).int()
            block = torch.full((batch, bs), self.drafter.mask_token_id, device=dev)
            block[:, 0] = pending
            slots = slots_for_positions(ctx_pos.flatten(), rows.repeat_interleave(bs), table, BLOCK)
            drafts = self.draft(block.flatten(), pos, k_lens, tabs, context_states=states.flatten(0, 1),
                                context_positions=ctx_pos.flatten(), context_slot_mappings=cg.tables(slots))
            block = torch.cat([pending[:, None], drafts.argmax(-1)], 1)
            logits, aux = self.verify(block.flatten(), pos, k_lens, tabs)
            pending = logits.view(batch, bs, -1).argmax(-1)[rows, accepted]
            states.copy_(aux.view(batch, bs, -1))
            ctx_pos = torch.where(offs <= accepted[:, None], L[:, None] + offs, -1)
            L = L + accepted + 1
            torch.cat([accepted, pending]).tolist()  # the step's one host sync, as in generate()
        _sync(dev)
        return (time.perf_counter() - start) / steps


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _compiled(fn):
    compiled, _ = compile_model(fn)

    def run(*tensors):  # input_ids, positions and, for a sampled DFlash2 step, uniforms: all [tokens]
        mark_token_dim_dynamic(*tensors)
        return compiled(*tensors)

    return run


@torch.no_grad()
def bench_e2e(formats: Sequence[str] = tqops.FORMATS, batches: Sequence[int] = (1, 8), shape: Optional[str] = None,
              ks: Sequence[int] = (0, 7, 15)) -> list[dict]:
    """One row per (format, batch): step times in ms, tokens/s at acceptance k, KV capacity, the decode step's byte
    floor (weight bytes + KV bytes read, over the copy bandwidth measured in the same run); targets checked.

    Each format compiles its own target and drafter steps (the format is a constant in the graph), which dominates
    the runtime. ``TQOPS_E2E_FORMATS`` (comma-separated) restricts the formats; ``TQOPS_E2E_BUDGET_S`` skips formats
    that would not finish within that many seconds (TurboQuant formats and bf16 run first); ``shape`` picks the
    shape (``SHAPES``), else ``TQOPS_E2E_SHAPE``, else Qwen3-0.6B.
    """
    formats = os.environ.get("TQOPS_E2E_FORMATS", ",".join(formats)).split(",")
    shape = shape or os.environ.get("TQOPS_E2E_SHAPE", "qwen3-0.6b")
    if shape not in SHAPES:
        raise ValueError(f"TQOPS_E2E_SHAPE / shape must be one of {sorted(SHAPES)}, got {shape!r}")
    target_cfg, drafter_cfg, context = SHAPES[shape]
    copy_bw = copy_bandwidth()
    budget = float(os.environ.get("TQOPS_E2E_BUDGET_S", "inf"))
    order = sorted(formats, key=lambda f: (f != "bf16", not f.startswith("turboquant"), f))
    rows, start, longest = [], time.perf_counter(), 0.0
    bar = tqdm(total=len(order), desc="e2e")
    for fmt in order:
        began = time.perf_counter()
        if began - start + longest > budget:
            tqdm.write(f"skipping {fmt}: the {budget:g} s budget would run out")
            continue
        bar.set_postfix_str(fmt)
        try:
            rows += _bench_format(fmt, batches, context, ks, target_cfg, drafter_cfg, copy_bw, shape)
        except Exception as e:  # keep the other formats' numbers; the error goes in the table
            rows.append(dict(format=fmt, error=f"{type(e).__name__}: {e}"[:300]))
            tqdm.write(f"{fmt} failed:\n{traceback.format_exc()}")
        longest = max(longest, time.perf_counter() - began)
        bar.update()
    bar.close()
    rank = {f: i for i, f in enumerate(formats)}
    return _targets(sorted(rows, key=lambda r: (rank[r["format"]], r.get("batch", 0))), target_cfg)


def decode_weight_bytes(target) -> int:
    """Weight bytes a decode step reads: every parameter once (a tied embedding is the LM head), except an untied
    input embedding, of which a step reads only its tokens' rows."""
    seen, total = set(), 0
    for name, p in target.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name == "model.embed_tokens.weight" and not target.config.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size()
    return total


def decode_kv_bytes(cfg: dict, fmt: str, batch: int, context: int) -> int:
    """KV-cache bytes a decode step reads: ``context`` slots per sequence in every layer."""
    return batch * context * kv_bytes_per_token(cfg, fmt)


def kv_bytes_per_token(cfg: dict, fmt: str) -> int:
    return tqops.get_format(fmt).slot_bytes(cfg["head_dim"]) * cfg["num_key_value_heads"] * cfg["num_hidden_layers"]


def _bench_format(fmt: str, batches: Sequence[int], context: int, ks: Sequence[int], target_cfg: dict = QWEN3_0_6B,
                  drafter_cfg: dict = DRAFTER, copy_bw: float = 0.0, shape: str = "qwen3-0.6b") -> list[dict]:
    torch._dynamo.reset()  # fresh models per format: drop the last format's graphs, start the recompile count over
    torch.cuda.empty_cache()
    target, drafter = build_models(fmt, target_cfg, drafter_cfg)
    weight_bytes = decode_weight_bytes(target)
    per_seq = -(-(context + 64 * max(ks) + 64) // BLOCK)  # room for the spec loops' growth
    table = fill_caches((target, drafter), max(batches), context, per_seq)
    sb = SpecBench(target, drafter, table, context, batches)
    rows = []
    for batch in batches:
        sb.fill(batch)
        row = dict(format=fmt, shape=shape, context=context, batch=batch,
                   decode_eager_ms=median_ms(lambda: sb.decode_eager._run(batch)),
                   decode_compiled_ms=median_ms(lambda: sb.decode._run(batch)),
                   decode_captured_ms=median_ms(sb.decode.graphs[batch].replay),
                   draft_eager_ms=median_ms(lambda: sb.draft_eager._run(batch)),
                   draft_captured_ms=median_ms(sb.draft.graphs[batch].replay),
                   verify_captured_ms=median_ms(sb.verify.graphs[batch].replay))
        row["spec_step_ms"] = row["draft_captured_ms"] + row["verify_captured_ms"]
        for k in ks:
            row[f"tok/s k={k}"] = batch * (k + 1) / sb.spec_loop(batch, k)
        row["tok/s decode"] = batch / (row["decode_captured_ms"] * 1e-3)
        if copy_bw:
            floor_bytes = weight_bytes + decode_kv_bytes(target_cfg, fmt, batch, context)
            row["decode_floor_ms"] = floor_bytes / copy_bw * 1e3
            row["decode/floor"] = row["decode_captured_ms"] / row["decode_floor_ms"]
        rows.append(row)
        tqdm.write(str({c: (round(v, 3) if isinstance(v, float) else v) for c, v in row.items()}))
    return rows


def _targets(rows: list[dict], cfg: dict = QWEN3_0_6B) -> list[dict]:
    """Add KV capacity and the issue's targets (speedups, spec/decode ratio, TurboQuant vs bf16) to each row."""
    bf16 = {r["batch"]: r["spec_step_ms"] for r in rows if r["format"] == "bf16" and "batch" in r}
    for r in rows:
        if "error" in r:
            continue
        per_token = kv_bytes_per_token(cfg, r["format"])
        r["kv_bytes/token"] = per_token
        r[f"tokens in {BUDGET_GIB} GiB"] = BUDGET_GIB * 2**30 // per_token
        r["captured/eager"] = r["decode_eager_ms"] / r["decode_captured_ms"]
        r["spec/decode"] = r["spec_step_ms"] / r["decode_captured_ms"]
        if r["batch"] == 1:
            r["captured >= 3x eager"] = r["captured/eager"] >= 3
            r["spec <= 2x decode"] = r["spec/decode"] <= 2
        if r["batch"] in bf16:
            r["vs bf16"] = r["spec_step_ms"] / bf16[r["batch"]]
            if r["format"].startswith("turboquant"):
                r["tq target met"] = r["vs bf16"] <= 1.1 if r["batch"] == 1 else r["vs bf16"] < 1
    return rows


def plot_e2e(rows: list[dict], path: str) -> None:
    """PNG of tokens/s vs accepted drafts k per format, one panel per batch size."""
    import matplotlib  # the optional "plot" extra, imported only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows if "batch" in r})
    if not batches:
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 5), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for r in (r for r in rows if r.get("batch") == batch):
            ks = sorted(int(c.split("=")[1]) for c in r if c.startswith("tok/s k="))
            ax.plot(ks, [r[f"tok/s k={k}"] for k in ks], "-o", label=r["format"], markersize=4)
        context = next((r["context"] for r in rows if r.get("batch") == batch and "context" in r), None)
        ax.set_title(f"batch {batch}, context {context}, block 16 (CUDA graphs)")
        ax.set_xlabel("accepted drafts per step (k)")
        ax.set_ylabel("tokens/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
