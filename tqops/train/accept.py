"""Acceptance of a trained pair: tqops' speculative generate() on held-out prompts, against plain greedy decoding."""
from __future__ import annotations

from pathlib import Path

import torch

from ..models import DFlashDrafter, Qwen3ForCausalLM
from ..models.generate import timed_generate
from . import corpus
from .tokenizer import load_tokenizer, special_ids


def heldout_prompts(tok, count: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``prompt_tokens`` tokens of the first ``count`` held-out files, each after end-of-text (the document
    separator the target saw before every file in training)."""
    eos = special_ids(tok)["eos"]
    prompts = []
    for f in corpus.read_heldout():
        ids = tok.encode(f.text).ids
        if len(ids) >= prompt_tokens:
            prompts.append([eos] + ids[:prompt_tokens])
        if len(prompts) == count:
            break
    return prompts


@torch.no_grad()
def measure_acceptance(target_dir, drafter_dir, *, prompts: int = 8, prompt_tokens: int = 128,
                       new_tokens: int = 128, device="cpu", cache_format: str = "bf16") -> dict:
    """Greedy DFlash generation with the tqops models (paged cache in ``cache_format``): mean acceptance length,
    whether each continuation equals plain greedy decoding, timing, and the first continuation as text."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok = load_tokenizer(Path(target_dir))
    eos = special_ids(tok)["eos"]
    batch = heldout_prompts(tok, prompts, prompt_tokens)
    target = Qwen3ForCausalLM.from_pretrained(target_dir, cache_format=cache_format, dtype=dtype, device=device)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, target=target, cache_format=cache_format)
    spec, spec_seconds = timed_generate(target, batch, new_tokens, drafter=drafter, eos_token_id=eos)
    plain, plain_seconds = timed_generate(target, batch, new_tokens, eos_token_id=eos)
    return {
        "prompts": len(batch), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "cache_format": cache_format,
        "mean_acceptance_length": round(spec.mean_acceptance_length, 3),
        "same_as_greedy": sum(a == b for a, b in zip(spec.tokens, plain.tokens)),
        "speculative_seconds": round(spec_seconds, 2), "greedy_seconds": round(plain_seconds, 2),
        "sample_prompt": tok.decode(batch[0][1:])[-300:] if batch else "",
        "sample_continuation": tok.decode(spec.tokens[0]) if batch else "",
    }
