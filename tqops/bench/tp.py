"""Tensor-parallel step costs under torchrun: a Qwen3-shaped target and DFlash drafter split over the ranks."""
from __future__ import annotations

import gc
import json
import os
import time

import torch
import torch.distributed as dist

import tqops
from tqops.cli import Parser, out_file_or_exit, torchrun_env_or_exit
from tqops.graphs import slots_for_positions
from tqops.models import DFlashDrafter, Qwen3Config, Qwen3ForCausalLM
from tqops.models.generate import CACHE_BLOCK_SIZE as BLOCK

from .e2e import SHAPES, SpecBench

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=128, rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
TINY_DRAFTER = dict(TINY, num_hidden_layers=1, block_size=16,
                    dflash_config={"target_layer_ids": [1, 3], "mask_token_id": 511})
# name -> (target config, drafter config, context); "tiny" is the CPU smoke shape.
TP_SHAPES = dict(SHAPES, tiny=(TINY, TINY_DRAFTER, 256))


def build_models(fmt: str, shape: str, group, device, dtype):
    """Random weights (the step cost does not depend on them), each rank building only its own part."""
    target_cfg, drafter_cfg, _ = TP_SHAPES[shape]
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(Qwen3Config.from_dict(target_cfg), cache_format=fmt, tp_group=group)
        drafter = DFlashDrafter(Qwen3Config.from_dict(drafter_cfg), cache_format=fmt, target=target)
    return target.to(dtype).eval(), drafter.to(dtype).eval()


def fill_caches(models, batch: int, context: int, per_seq: int) -> torch.Tensor:
    """Random K/V of this rank's KV heads for ``context`` tokens of each sequence in every layer; the block table."""
    dev, dtype = models[0].lm_head.weight.device, models[0].lm_head.weight.dtype
    table = torch.arange(batch * per_seq, dtype=torch.int32, device=dev).view(batch, per_seq)
    slots = slots_for_positions(torch.arange(context, device=dev).repeat(batch),
                                torch.arange(batch, device=dev).repeat_interleave(context), table, BLOCK)
    attn = models[0].attention_layers[0]
    k, v = (torch.randn(batch * context, attn.num_kv_heads, attn.head_dim, device=dev, dtype=dtype)
            for _ in range(2))
    for model in models:
        model.allocate_cache(batch * per_seq, BLOCK, dev)
        for layer in model.attention_layers:  # the same K/V in every layer: only the step cost matters
            tqops.kv_store(k, v, layer.kv_cache, slots, layer.fmt)
    return table


def lockstep_ms(fn, device, group, warmup: int = 3, reps: int = 20) -> float:
    """Mean milliseconds of ``fn`` over ``reps`` back-to-back calls. Every rank makes the same number of calls
    (each holds collectives), so no adaptive timer such as do_bench."""
    for _ in range(warmup):
        fn()
    if group is not None:
        dist.barrier(group)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1e3 / reps
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def bench_format(fmt: str, args, group, device, dtype) -> list[dict]:
    torch._dynamo.reset()
    target, drafter = build_models(fmt, args.shape, group, device, dtype)
    context = args.context or TP_SHAPES[args.shape][2]
    per_seq = -(-(context + 64 * max(args.ks) + 64) // BLOCK)  # room for the spec loops' growth
    table = fill_caches((target, drafter), max(args.batches), context, per_seq)
    sb = SpecBench(target, drafter, table, context, args.batches, compile=args.compile)
    rows, tp = [], 1 if group is None else dist.get_world_size(group)
    for batch in args.batches:
        torch.manual_seed(batch)  # the same random step inputs on every rank
        sb.fill(batch)
        graphed = device.type == "cuda"
        step = {name: (runner.graphs[batch].replay if graphed else (lambda r=runner: r._run(batch)))
                for name, runner in (("decode", sb.decode), ("draft", sb.draft), ("verify", sb.verify))}
        row = dict(format=fmt, shape=args.shape, tp=tp, context=context, batch=batch, captured=graphed,
                   **{f"{name}_ms": lockstep_ms(fn, device, group) for name, fn in step.items()})
        row["spec_step_ms"] = row["draft_ms"] + row["verify_ms"]
        for k in args.ks:
            row[f"tok/s k={k}"] = batch * (k + 1) / sb.spec_loop(batch, k)
        rows.append(row)
    return rows


def int_list_or_exit(parser: Parser, flag: str, text: str, low: int) -> list[int]:
    """``text``'s comma-separated integers, each >= ``low``, or a one-line command-line error naming ``flag``."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if min(values) < low:
        parser.error(f"{flag}: each must be >= {low}, got {text!r}")
    return values


def main(argv=None) -> None:
    parser = Parser(prog="torchrun --nproc-per-node N -m tqops.bench.tp", description=__doc__)
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(TP_SHAPES))
    parser.add_argument("--formats", default="bf16,turboquant_4bit_nc")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--ks", default="0,7,15", help="accepted drafts per step for the spec-loop tokens/s")
    parser.add_argument("--context", type=int, default=None, help="keys per sequence (default: the shape's)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--out", help="write the rows as JSON here (rank 0)")
    args = parser.parse_args(argv)
    args.formats = args.formats.split(",")
    for fmt in args.formats:
        if fmt not in tqops.FORMATS:
            parser.error(f"--formats: unknown format {fmt!r} (choose from {', '.join(tqops.FORMATS)})")
    args.batches = int_list_or_exit(parser, "--batches", args.batches, low=1)
    args.ks = int_list_or_exit(parser, "--ks", args.ks, low=0)
    block = TP_SHAPES[args.shape][1]["block_size"]
    if max(args.ks) >= block:
        parser.error(f"--ks {max(args.ks)}: accepted drafts must be < the {args.shape} drafter's block size {block}")
    if args.context is not None and args.context < 1:
        parser.error(f"--context must be >= 1, got {args.context}")
    if "WORLD_SIZE" not in os.environ:
        parser.error("run under torchrun (torchrun --nproc-per-node 1 gives the one-process baseline)")
    torchrun_env_or_exit(parser, "tqops.bench.tp")
    if args.out is not None:  # rank 0 writes it after the whole run; every rank checks, so all stop together
        out_file_or_exit(parser, args.out)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    group = dist.group.WORLD if dist.get_world_size() > 1 else None  # one process: the plain model, no collectives
    rank0 = dist.get_rank() == 0
    rows = []
    try:
        with torch.no_grad():
            for fmt in args.formats:
                for row in bench_format(fmt, args, group, device, torch.bfloat16 if cuda else torch.float32):
                    rows.append(row)
                    if rank0:
                        print(json.dumps({c: round(v, 3) if isinstance(v, float) else v for c, v in row.items()}),
                              flush=True)
    finally:
        gc.collect()  # the models and captured graphs: NCCL cannot destroy a group while graphs that captured it live
        dist.destroy_process_group()
    if rank0 and args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
