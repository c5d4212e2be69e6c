"""Decode step of a Hugging Face Qwen3 on tqops' PagedKVCache vs transformers' StaticCache, and vs tqops' own Qwen3."""
from __future__ import annotations

import gc
import time
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

from tqops.models import Qwen3Config, Qwen3ForCausalLM

from .e2e import decode_runner, fill_decode

# Decode calls per timed set-up (time_steps' defaults): the caches hold the prompt plus these, and the context the
# steps attend over grows by as many tokens (under 1% of 32K).
STEP_ROOM = 3 + 20 * 7

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                max_position_embeddings=40960, rope_parameters={"rope_theta": 1e6, "rope_type": "default"})


def hf_qwen3(cfg: dict, attn_implementation: str, device, dtype=torch.bfloat16):
    """A randomly initialised ``transformers`` Qwen3ForCausalLM (seeded), built on ``device``."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM._from_config(transformers.Qwen3Config(**cfg),
                                                            attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


def hf_decode_step(model, cache, batch: int, context: int) -> Callable[[], torch.Tensor]:
    """Prefill ``context`` random tokens per row into ``cache``, then return a decode step (``() -> logits
    [batch, 1, vocab]``). Each call appends one token to the cache (transformers 5.24's StaticCache counts its own
    length, as the paged cache does), so the cache needs room for ``context + STEP_ROOM`` tokens."""
    from tqops.hf.generation import cache_argument

    dev, cache_kw = model.device, {cache_argument(model): cache}
    prompt = torch.randint(0, model.config.vocab_size, (batch, context), device=dev)
    with torch.no_grad():
        model(input_ids=prompt, **cache_kw, cache_position=torch.arange(context, device=dev),
              use_cache=True, logits_to_keep=1)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    position_ids = torch.full((batch, 1), context, dtype=torch.long, device=dev)
    cache_position = torch.tensor([context], device=dev)

    def step():
        with torch.no_grad():
            return model(input_ids=ids, position_ids=position_ids, cache_position=cache_position,
                         **cache_kw, use_cache=True).logits

    return step


def time_steps(step: Callable[[], object], steps: int = 20, reps: int = 7) -> float:
    """Median milliseconds per call over ``reps`` runs of ``steps`` back-to-back calls, after 3 warm-up calls
    (compilation and, with mode="reduce-overhead", the CUDA-graph capture): 3 + steps * reps calls in all."""
    cuda = torch.cuda.is_available()
    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3 / steps)
    return sorted(times)[len(times) // 2]


def _free() -> None:
    """Drop the last set-up's compiled graphs and cached memory (its model and cache died with its function)."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_hf_cache(cfg: dict, batch: int, context: int, device, cache_format: Optional[str] = None,
                   compile: bool = True, model=None) -> float:
    """ms per decode step of a transformers Qwen3 compiled with mode="reduce-overhead": with ``cache_format``, the
    "tqops" attention over a PagedKVCache in that format (in ``model``, a "tqops" ``hf_qwen3``, when given); without,
    sdpa attention over a StaticCache."""
    import transformers

    if cache_format is None:
        model = hf_qwen3(cfg, "sdpa", device)
        cache = transformers.StaticCache(config=model.config, max_cache_len=context + STEP_ROOM)
    else:
        import tqops.hf

        model = hf_qwen3(cfg, "tqops", device) if model is None else model
        cache = tqops.hf.PagedKVCache(model.config, cache_format=cache_format, max_batch_size=batch,
                                      max_cache_len=context + STEP_ROOM, device=device)
    step = hf_decode_step(model, cache, batch, context)
    if compile:
        step = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    return time_steps(step)


def bench_own_qwen3(cfg: dict, batch: int, context: int, device, cache_format: str, capture: bool = True) -> float:
    """ms per decode step: tqops' own Qwen3 (compiled), captured as a CUDA graph by tqops.cudagraph on CUDA."""
    dev = torch.device(device)
    torch.manual_seed(0)
    with torch.device(dev):
        target = Qwen3ForCausalLM(Qwen3Config.from_dict(cfg), cache_format=cache_format).to(torch.bfloat16).eval()
    runner, table = decode_runner(target, [batch], context, room=STEP_ROOM, compile=capture)
    fill_decode(runner, table, batch, context)
    if capture:
        runner.capture(progress=False)
        replay = runner.graphs[batch].replay
    else:
        def replay():
            with torch.no_grad():
                runner._run(batch)
    return time_steps(replay)


def bench_hf(cfg: dict = QWEN3_8B, batches: Sequence[int] = (1,), context: int = 32768,
             formats: Sequence[str] = ("bf16", "turboquant_4bit_nc"), device="cuda") -> list[dict]:
    """One row per (batch, cache): ms per decode step of the three set-ups, and the two ratios the issue targets
    (tqops cache vs StaticCache + compile, and vs tqops' own Qwen3 with the same cache format)."""
    capture = torch.device(device).type == "cuda"
    rows = []
    bar = tqdm(total=len(batches) * (1 + 2 * len(formats)), desc="hf decode")
    for batch in batches:
        bar.set_postfix_str(f"batch {batch}: StaticCache")
        static_ms = bench_hf_cache(cfg, batch, context, device, compile=capture)
        _free()
        bar.update()
        for fmt in formats:
            bar.set_postfix_str(f"batch {batch}: {fmt}")
            paged_ms = bench_hf_cache(cfg, batch, context, device, fmt, compile=capture)
            _free()
            bar.update()
            own_ms = bench_own_qwen3(cfg, batch, context, device, fmt, capture=capture)
            _free()
            bar.update()
            row = dict(batch=batch, context=context, cache_format=fmt, static_cache_compiled_ms=static_ms,
                       hf_tqops_cache_ms=paged_ms, tqops_qwen3_ms=own_ms,
                       vs_static_cache=paged_ms / static_ms, vs_tqops_qwen3=paged_ms / own_ms)
            row["faster than StaticCache"] = row["vs_static_cache"] < 1
            row["<= 1.2x tqops Qwen3"] = row["vs_tqops_qwen3"] <= 1.2
            rows.append(row)
            tqdm.write(str({c: (round(v, 3) if isinstance(v, float) else v) for c, v in row.items()}))
    bar.close()
    return rows
