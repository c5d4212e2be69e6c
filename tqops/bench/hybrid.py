"""Step costs of the hybrid Qwen3.5 target (Gated DeltaNet + gated attention) and a DFlash drafter, captured."""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from tqdm import tqdm

from tqops.cudagraph import steps as cg
from tqops.graphs import slots_for_positions
from tqops.models import DFlashDrafter, Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3Config
from tqops.models.generate import CACHE_BLOCK_SIZE as BLOCK
from tqops.models.steps import drafter_step, target_step

from .e2e import _compiled, decode_weight_bytes, fill_caches
from .hf import _free
from .hybrid_hf import bench_hybrid_hf
from .timing import copy_bandwidth, median_ms

# transformers' Qwen3_5TextConfig() defaults: 32 layers, 24 Gated DeltaNet and 8 gated full attention.
QWEN3_5_9B = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, full_attention_interval=4, tie_word_embeddings=False,
                  rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.25, "rope_type": "default"})
# z-lab's Qwen3.5 drafters have the Qwen3 drafter layout: 5 layers at the target's hidden size.
DRAFTER_9B = dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=5,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, block_size=16,
                  rope_parameters={"rope_theta": 1e7, "rope_type": "default"},
                  dflash_config={"target_layer_ids": [1, 8, 15, 22, 29], "mask_token_id": 248077})
SHAPES = {"qwen3.5-9b": (QWEN3_5_9B, DRAFTER_9B, 32768)}

log = logging.getLogger(__name__)


def build_hybrid(fmt: str, target_cfg: dict, drafter_cfg: dict, device="cuda", dtype=torch.bfloat16):
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3_5ForCausalLM(Qwen3_5Config.from_dict(target_cfg), cache_format=fmt).to(dtype).eval()
        for p in target.parameters():  # a usable random model: weights of the scale a trained one has
            p.data.normal_(0, 0.02)
        drafter = DFlashDrafter(Qwen3Config.from_dict(drafter_cfg), cache_format=fmt, target=target)
    return target, drafter.to(dtype).eval()


def state_bytes(target, batch: int) -> int:
    """Conv and recurrent state bytes of ``batch`` rows over every linear-attention layer (one read or write)."""
    return sum(batch * (s.conv_state[0].numel() * s.conv_state.element_size() +
                        s.recurrent_state[0].numel() * s.recurrent_state.element_size()) for s in target.state_layers)


def captured_steps(fmt: str, target_cfg: dict, drafter_cfg: dict, context: int, batches: Sequence[int],
                   device="cuda"):
    """``(target, drafter, runners, block_table)``: the random pair in ``fmt`` over caches and states holding
    ``context`` tokens per row, and its compiled decode, verify and draft steps captured for ``batches``
    (``runners["decode" | "verify" | "draft"]``), every bucket's buffers filled by ``fill_steps`` (on CPU nothing is
    captured: the runners run their compiled steps)."""
    target, drafter = build_hybrid(fmt, target_cfg, drafter_cfg, device=device)
    bs, dev, big = drafter.block_size, target.lm_head.weight.device, max(batches)
    per_seq = -(-(context + 2 * bs) // BLOCK)
    table = fill_caches((target,), big, context, per_seq)
    fill_caches((drafter,), big, context, per_seq)  # its own heads and head_dim: filled apart
    target.allocate_state(big, bs, dev)
    shape_kw = dict(max_batch=big, max_blocks=per_seq, block_size=BLOCK, device=dev, buckets=list(batches))
    t_step = _compiled(target_step(target, drafter.target_layer_ids))
    runners = dict(decode=cg.make_runner(t_step, q_len=1, state_mode="commit", **shape_kw),
                   verify=cg.make_runner(t_step, q_len=bs, state_mode="stash", **shape_kw),
                   draft=cg.make_runner(_compiled(drafter_step(drafter)), q_len=bs, context_dim=drafter.context_dim,
                                        context_dtype=drafter.fc.weight.dtype, **shape_kw))
    fill_steps(runners, table, big, context, drafter)  # every bucket's views hold real inputs
    for r in runners.values():
        r.capture(progress=False)
    return target, drafter, runners, table


@torch.no_grad()
def bench_hybrid(shape: str = "qwen3.5-9b", formats: Sequence[str] = ("bf16", "turboquant_4bit_nc"),
                 batches: Sequence[int] = (1, 8), transformers: bool = True) -> list[dict]:
    """One row per (format, batch): the captured decode step, the draft and verify steps of a 16-token block, their
    sum (the speculative step), and the decode step's byte floor (weights + KV read + states read and written, over
    the copy bandwidth measured in the same run). With ``transformers``, one more row per batch: transformers' own
    Qwen3.5 of the same shape on its own cache (``hybrid_hf``), and each row's steps against its."""
    target_cfg, drafter_cfg, context = SHAPES[shape]
    copy_bw, rows = copy_bandwidth(), []
    for fmt in tqdm(formats, desc="hybrid e2e"):
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        target, drafter, steps, table = captured_steps(fmt, target_cfg, drafter_cfg, context, batches)
        decode, verify, draft = steps["decode"], steps["verify"], steps["draft"]
        weights = decode_weight_bytes(target)
        kv_per_token = sum(a.fmt.slot_bytes(a.head_dim) * a.num_kv_heads for a in target.attention_layers)
        for batch in batches:
            fill_steps(steps, table, batch, context, drafter)
            row = dict(format=fmt, shape=shape, context=context, batch=batch,
                       decode_captured_ms=median_ms(decode.graphs[batch].replay),
                       draft_captured_ms=median_ms(draft.graphs[batch].replay),
                       verify_captured_ms=median_ms(verify.graphs[batch].replay))
            row["spec_step_ms"] = row["draft_captured_ms"] + row["verify_captured_ms"]
            row["spec/decode"] = row["spec_step_ms"] / row["decode_captured_ms"]
            floor = weights + batch * context * kv_per_token + 2 * state_bytes(target, batch)
            row["decode_floor_ms"] = floor / copy_bw * 1e3
            row["decode/floor"] = row["decode_captured_ms"] / row["decode_floor_ms"]
            row["kv_bytes/token"] = kv_per_token
            row["tokens/GiB"] = 2**30 // kv_per_token
            rows.append(row)
            tqdm.write(str({c: (round(v, 3) if isinstance(v, float) else v) for c, v in row.items()}))
        del decode, verify, draft, steps, target, drafter  # the runners hold the models too
    bf16 = {r["batch"]: r for r in rows if r["format"] == "bf16"}
    for r in rows:
        if r["batch"] in bf16:
            r["spec vs bf16"] = r["spec_step_ms"] / bf16[r["batch"]]["spec_step_ms"]
            r["decode vs bf16"] = r["decode_captured_ms"] / bf16[r["batch"]]["decode_captured_ms"]
    if transformers:
        _free()  # the last format's graphs and cached blocks, before a second 9B model
        rows += _transformers_rows(shape, target_cfg, context, batches, drafter_cfg["block_size"])
        vs_transformers(rows)
    return rows


def _transformers_rows(shape: str, target_cfg: dict, context: int, batches: Sequence[int], block: int) -> list[dict]:
    try:
        return bench_hybrid_hf(target_cfg, context, batches, block, shape=shape)
    except Exception as e:  # keep tqops' rows, minutes of work; the error goes in the table
        log.exception("transformers' Qwen3.5 did not run")
        return [dict(format="transformers (bf16)", shape=shape, error=f"{type(e).__name__}: {e}"[:300])]


def vs_transformers(rows: list[dict]) -> None:
    """tqops' captured decode and verify steps over transformers' at the same batch (below 1: tqops is faster), and
    transformers' decode step over the bf16 row's byte floor (the same weights, KV and states)."""
    hf = {r["batch"]: r for r in rows if "hf_decode_ms" in r}
    floors = {r["batch"]: r["decode_floor_ms"] for r in rows if r["format"] == "bf16" and "decode_floor_ms" in r}
    for r in rows:
        batch = r.get("batch")
        if "decode_captured_ms" in r and batch in hf:
            r["decode vs transformers"] = r["decode_captured_ms"] / hf[batch]["hf_decode_ms"]
            r["verify vs transformers"] = r["verify_captured_ms"] / hf[batch]["hf_verify_ms"]
        elif "hf_decode_ms" in r and batch in floors:
            r["decode/floor"] = r["hf_decode_ms"] / floors[batch]


def fill_steps(runners: dict, table, batch: int, context: int, drafter) -> None:
    """The ``batch`` bucket's inputs of ``captured_steps``' runners at ``context``: a decode token, a verify block
    that first commits ``bs / 2 - 1`` pending tokens (7 of 16), a draft block after a block of context rows."""
    decode, verify, draft = runners["decode"], runners["verify"], runners["draft"]
    dev, bs = table.device, drafter.block_size
    L = torch.full((batch,), context, device=dev)
    tabs, rows = cg.tables(table[:batch]), torch.arange(batch, device=dev)
    vocab = drafter.config.vocab_size
    decode.buffers.fill(batch, torch.randint(0, vocab, (batch,), device=dev), L, (L + 1).int(), tabs,
                        state_indices=rows)
    pos = (L[:, None] + torch.arange(bs, device=dev)).flatten()
    block = torch.randint(0, vocab, (batch * bs,), device=dev)
    verify.buffers.fill(batch, block, pos, (L + bs).int(), tabs, state_indices=rows,
                        pending_lens=torch.full((batch,), bs // 2 - 1, dtype=torch.int32, device=dev))
    ctx_pos = pos - bs
    slots = slots_for_positions(ctx_pos, rows.repeat_interleave(bs), table[:batch], BLOCK)
    states = torch.randn(batch * bs, drafter.context_dim, device=dev, dtype=drafter.fc.weight.dtype)
    draft.buffers.fill(batch, block, pos, (L + bs).int(), tabs, context_states=states, context_positions=ctx_pos,
                       context_slot_mappings=cg.tables(slots))
