"""DFlash over a Hugging Face target at captured speed: ``generate_speculative(compile=True)`` against tqops' own
Qwen3 (``generate(compile=True, cudagraph=True)``) and against the HF model's plain captured decoding."""
from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from tqops.models import OracleProposer, Qwen3Config, Qwen3ForCausalLM, generate

from .. import cli
from ..cli import Parser
from .dflash2 import batches_arg, write_table
from .e2e import _sync
from .hf import QWEN3_8B, _free, bench_hf_cache, hf_qwen3

BLOCK = 16  # DFlash's block: the verify step's tokens per row


class TimedProposer:
    """An ``OracleProposer`` that notes the time of each call, CUDA synchronized: the loops call it once a step,
    so the gaps are whole speculative steps (verify, acceptance, the proposer), the prefill outside them."""

    def __init__(self, proposer, device):
        self.proposer, self.device = proposer, torch.device(device)
        self.block_size, self.times = proposer.block_size, []

    def __call__(self, seq_ids, generated):
        _sync(self.device)
        self.times.append(time.perf_counter())
        return self.proposer(seq_ids, generated)


def wrong_proposer(batch: int, vocab_size: int) -> OracleProposer:
    """A proposer that knows nothing: its drafts are the token after 0 (right only by chance), so a run with it is
    greedy decoding one token a step, whose output is the oracle's reference (speculative decoding is lossless)."""
    return OracleProposer([[] for _ in range(batch)], 0, BLOCK, vocab_size)


def step_figures(run: Callable[[object], object], batch: int, vocab_size: int, k: int,
                 device) -> tuple[float, float, float]:
    """``run(proposer)`` -> a ``GenerateResult``. -> (ms per speculative step, new tokens per second, mean acceptance)
    of a run with an oracle right for ``k`` tokens a block: a first run with ``wrong_proposer`` compiles and captures
    the steps and gives the greedy tokens the oracle knows; the second is timed, the median gap between its
    proposer's calls."""
    reference = run(wrong_proposer(batch, vocab_size)).tokens
    timed = TimedProposer(OracleProposer(reference, k, BLOCK, vocab_size), device)
    result = run(timed)
    gaps = sorted(b - a for a, b in zip(timed.times, timed.times[1:]))
    if not gaps:
        raise ValueError("the timed run took one step: no step to time; ask for more new tokens")
    step_s = gaps[len(gaps) // 2]
    return 1e3 * step_s, len(result.tokens) * result.mean_acceptance_length / step_s, result.mean_acceptance_length


def _hf_run(model, ids, new_tokens: int, cache, compile: bool) -> Callable[[object], object]:
    import tqops.hf

    return lambda proposer: tqops.hf.generate_speculative(model, None, ids, new_tokens, proposer=proposer,
                                                          past_key_values=cache, compile=compile)


def _own_run(target, prompts, new_tokens: int, compile: bool) -> Callable[[object], object]:
    return lambda proposer: generate(target, prompts, new_tokens, proposer=proposer, compile=compile,
                                     cudagraph=compile)


def bench_hf_speculative(cfg: dict = QWEN3_8B, batches: Sequence[int] = (1, 8), context: int = 32768,
                         formats: Sequence[str] = ("bf16", "turboquant_4bit_nc"), k: int = 6, new_tokens: int = 96,
                         device="cuda") -> list[dict]:
    """One row per (format, batch), random bf16 weights, ``context`` random prompt tokens, an oracle proposer right
    for ``k`` tokens a block (greedy): ms per speculative step and tokens/s of the HF route and of tqops' own Qwen3,
    and the HF model's plain captured decoding (PagedKVCache in the format, and StaticCache + sdpa) as tokens/s.
    One HF model serves every format (the cache carries it) and one tqops Qwen3 every batch of a format."""
    import tqops.hf

    compile = torch.device(device).type == "cuda"
    vocab = cfg["vocab_size"]
    rows = []
    bar = tqdm(total=len(formats) * len(batches) * 3 + len(batches), desc="hf speculative")
    static = {}
    for batch in batches:
        bar.set_postfix_str(f"StaticCache batch {batch}")
        static[batch] = bench_hf_cache(cfg, batch, context, device, compile=compile)
        _free()
        bar.update()
    model = hf_qwen3(cfg, "tqops", device)
    for fmt in formats:
        torch.manual_seed(0)
        with torch.device(device):
            own = Qwen3ForCausalLM(Qwen3Config.from_dict(cfg), cache_format=fmt).to(torch.bfloat16).eval()
        for batch in batches:
            prompts = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(0))
            bar.set_postfix_str(f"{fmt} batch {batch}: HF DFlash")
            cache = tqops.hf.PagedKVCache(model.config, fmt, max_batch_size=batch,
                                          max_cache_len=context + new_tokens + BLOCK, device=device)
            hf_ms, hf_tps, hf_acc = step_figures(_hf_run(model, prompts.to(device), new_tokens, cache, compile),
                                                 batch, vocab, k, device)
            cache = None
            _free()
            bar.update()
            bar.set_postfix_str(f"{fmt} batch {batch}: HF plain")
            plain_ms = bench_hf_cache(cfg, batch, context, device, fmt, compile=compile, model=model)
            _free()
            bar.update()
            bar.set_postfix_str(f"{fmt} batch {batch}: tqops Qwen3")
            own_ms, own_tps, own_acc = step_figures(_own_run(own, prompts.tolist(), new_tokens, compile), batch,
                                                    vocab, k, device)
            _free()
            bar.update()
            row = dict(format=fmt, batch=batch, context=context, k=k, hf_spec_step_ms=hf_ms,
                       tqops_qwen3_spec_step_ms=own_ms, hf_vs_tqops_qwen3=hf_ms / own_ms,
                       hf_dflash_tok_s=hf_tps, hf_plain_tok_s=1e3 * batch / plain_ms,
                       static_cache_tok_s=1e3 * batch / static[batch], tqops_qwen3_dflash_tok_s=own_tps,
                       hf_acceptance=hf_acc, tqops_qwen3_acceptance=own_acc)
            row["dflash vs hf plain"] = row["hf_dflash_tok_s"] / row["hf_plain_tok_s"]
            row["dflash vs StaticCache"] = row["hf_dflash_tok_s"] / row["static_cache_tok_s"]
            row["<= 1.2x tqops Qwen3"] = row["hf_vs_tqops_qwen3"] <= 1.2
            rows.append(row)
            tqdm.write(str({c: (round(v, 3) if isinstance(v, float) else v) for c, v in row.items()}))
        own = None
        _free()
    bar.close()
    return rows


def main(argv=None) -> int:
    parser = Parser(prog="python -m tqops.bench.hf_speculative", description=__doc__)
    parser.add_argument("--batches", type=batches_arg, default=(1, 8), help="comma-separated batch sizes")
    parser.add_argument("--formats", default="bf16,turboquant_4bit_nc", help="comma-separated cache formats")
    parser.add_argument("--context", type=int, default=32768, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=96, help="new tokens per row of a timed call")
    parser.add_argument("--k", type=int, default=6, help="tokens a block the oracle proposer gets right")
    parser.add_argument("--out", default=None, help="folder for hf-speculative.json and .md")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    import tqops

    formats = cli.subset_or_exit(parser, "--formats", args.formats, tqops.FORMATS)
    for flag, value, low in (("--context", args.context, 1), ("--new-tokens", args.new_tokens, 2),
                             ("--k", args.k, 0)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    if args.k > BLOCK - 1:
        parser.error(f"--k must be <= {BLOCK - 1} (a block's drafts), got {args.k}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = bench_hf_speculative(batches=args.batches, context=args.context, formats=formats, k=args.k,
                                new_tokens=args.new_tokens, device=device)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    write_table(rows, args.out, "hf-speculative", f"`python -m tqops.bench.hf_speculative {' '.join(argv)}` on "
                f"{where}, torch {torch.__version__}: Qwen3-8B shape, random weights, oracle proposer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
