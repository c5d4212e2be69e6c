"""Acceptance of a trained pair: tqops' speculative generate() on held-out prompts, against plain greedy decoding."""
from __future__ import annotations

from pathlib import Path

import torch

from ..models import DFlashDrafter, Qwen3ForCausalLM
from ..models.generate import timed_generate
from .heldout import heldout_windows
from .tokenizer import load_tokenizer, special_ids


def heldout_prompts(tok, count: int, prompt_tokens: int, new_tokens: int = 128) -> list[list[int]]:
    """The ``prompt_tokens``-token prompts of up to ``count`` held-out windows with ``new_tokens`` after the cut
    (``heldout.heldout_windows``: the demo's and the acceptance study's prompts for the same lengths)."""
    return [w.prompt(prompt_tokens) for w in heldout_windows(tok, count, prompt_tokens, new_tokens)]


@torch.no_grad()
def measure_acceptance(target_dir, drafter_dir, *, prompts: int = 8, prompt_tokens: int = 128,
                       new_tokens: int = 128, device="cpu", cache_format: str = "bf16") -> dict:
    """Greedy DFlash generation with the tqops models (paged cache in ``cache_format``): mean acceptance length,
    whether each continuation equals plain greedy decoding, timing, and the first continuation as text."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok = load_tokenizer(Path(target_dir))
    eos = special_ids(tok)["eos"]
    batch = heldout_prompts(tok, prompts, prompt_tokens, new_tokens=new_tokens)
    target = Qwen3ForCausalLM.from_pretrained(target_dir, cache_format=cache_format, dtype=dtype, device=device)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, target=target, cache_format=cache_format)
    spec, spec_seconds = timed_generate(target, batch, new_tokens, drafter=drafter, eos_token_id=eos)
    plain, plain_seconds = timed_generate(target, batch, new_tokens, eos_token_id=eos)
    return {
        "prompts": len(batch), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "cache_format": cache_format,
        "mean_acceptance_length": round(spec.mean_acceptance_length, 3),
        "same_as_greedy": sum(a == b for a, b in zip(spec.tokens, plain.tokens)),
        "speculative_seconds": round(spec_seconds, 2), "greedy_seconds": round(plain_seconds, 2),
        "sample_prompt": tok.decode(batch[0])[-300:] if batch else "",
        "sample_continuation": tok.decode(spec.tokens[0]) if batch else "",
    }
