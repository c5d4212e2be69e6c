"""Held-out perplexity per cache format: a transformers checkpoint with the "tqops" attention, forwards without a cache."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from tqops.formats import FORMATS

WINDOWS, TOKENS, BATCH = 16, 512, 8


def perplexity_windows(tokenizer, count: int = WINDOWS, tokens: int = TOKENS) -> torch.Tensor:
    """``[count, tokens]`` ids: consecutive non-overlapping windows of the committed held-out stdlib files
    (``tqops/pretrained/stdlib-heldout.jsonl``, the same texts on every machine), each file encoded whole by the
    checkpoint's own tokenizer, in path order; fewer rows if the files run out."""
    from tqops.train import corpus

    rows = []
    for f in corpus.read_heldout():
        ids = tokenizer(f.text)["input_ids"]
        rows += [ids[i:i + tokens] for i in range(0, len(ids) - tokens + 1, tokens)]
        if len(rows) >= count:
            break
    return torch.tensor(rows[:count], dtype=torch.long)


@torch.no_grad()
def mean_loss(model, windows: torch.Tensor, batch_size: int = BATCH) -> float:
    """Mean next-token cross entropy in nats over every predicted token of ``windows`` ``[n, tokens]``."""
    device = next(model.parameters()).device
    total = 0.0
    for i in range(0, windows.shape[0], batch_size):
        ids = windows[i:i + batch_size].to(device)
        total += model(ids, labels=ids, use_cache=False).loss.item() * ids.shape[0]
    return total / windows.shape[0]


def bench_perplexity(model_path=None, formats: Sequence[str] = FORMATS, windows: int = WINDOWS, tokens: int = TOKENS,
                     device: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> list[dict]:
    """One row per format, and one for the model's own attention ("sdpa": no cache format) first: held-out loss and
    perplexity of ``model_path`` (a transformers checkpoint folder; default the shipped target) with
    ``attn_implementation="tqops"`` and ``config.tqops_cache_format`` set to the format, so every layer's keys and
    values are the format's, as when decoding; each row against the sdpa row of the same run."""
    import tqops.hf  # noqa: F401  (registers attn_implementation="tqops")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tqops.shipped import TRAINED_DIR

    path = Path(model_path) if model_path is not None else TRAINED_DIR / "target"
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    ids = perplexity_windows(AutoTokenizer.from_pretrained(path), windows, tokens)
    exact = mean_loss(model, ids)
    rows = [dict(format="sdpa (no cache format)", **_columns(exact, exact), windows=ids.shape[0], tokens=tokens)]
    model.set_attn_implementation("tqops")
    for fmt in tqdm(formats, desc="perplexity"):
        model.config.tqops_cache_format = fmt
        rows.append(dict(format=fmt, **_columns(mean_loss(model, ids), exact), windows=ids.shape[0], tokens=tokens))
    return rows


def _columns(loss: float, exact: float) -> dict:
    return {"loss nats/token": loss, "perplexity": math.exp(loss), "loss vs sdpa": loss - exact,
            "perplexity vs sdpa": math.exp(loss - exact)}


def plot_perplexity(rows: list[dict], path: str, title: str = "") -> None:
    """A bar per format of its perplexity relative to the model's own attention."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["format"] for r in rows[1:]]
    ratios = [r["perplexity vs sdpa"] for r in rows[1:]]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(names, ratios, color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("perplexity / sdpa's")
    ax.set_ylim(min(0.99, min(ratios) - 0.005), max(ratios) + 0.01)
    ax.set_title(title or "held-out perplexity per cache format")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
