"""tqops' speculative ``generate`` against z-lab's reference ``dflash_generate`` on the shipped pair (issue 29).

Greedy, batch 1 per prompt on the reference side (``dflash_generate`` takes one sequence), a few held-out prompts,
both sides in fp32 on CPU from the shipped bf16 weights: the transformers ``Qwen3ForCausalLM`` target and z-lab's
``DFlashDraftModel`` on one side, tqops' ``Qwen3ForCausalLM`` and ``DFlashDrafter`` on the fp16 cache on the other.
Compared exactly: the new token ids of every prompt and the tokens each decode step produced (accepted drafts + 1).

Needs z-lab's pip package, which the test extra does not install (its metadata pins tqdm, requests and datasets
exactly, and datasets brings pyarrow, pandas and aiohttp that ``dflash.model`` never imports); without it these
tests skip. To run them::

    pip install --no-deps dflash==0.1.0 && python -m pytest tests/models/test_zlab_reference.py

What the comparison has to take into account, each found by running it:

* Cache format. The reference attends over unrounded fp32 K/V; tqops' cache rounds K/V to fp16 or bf16. The
  shipped drafter's top-2 draft logits are at times closer than 1e-3. Rounding K/V to bf16 moves its fp32 logits by
  about 0.02, which flips such a draft (the third prompt's 12th step): with bf16 the tokens still match but that
  prompt's acceptance lengths part from there. On fp16 the logits move by about 0.003 and every draft agrees, so
  the tests use fp16 (a retrained drafter with a closer tie could still part: the assertion shows at which step).
* Final blocks. ``dflash_generate`` shrinks the last blocks to the tokens still to come
  (``verify_size = min(block_size, max_length - start)``), and the drafter attends over its whole block
  non-causally, so a shorter block drafts differently; tqops always drafts full blocks and caps what it keeps. The
  reference therefore runs ``block_size`` tokens longer, so that every step compared drafts a full block, and its
  output is cut to tqops' length (tokens, and the per-step counts capped as tqops caps them).
* The last target layer. z-lab's ``extract_context_feature`` reads transformers' ``hidden_states[layer_id + 1]``,
  whose last entry is the target's final-normed state; tqops feeds its drafter the same states (its target's
  ``layer_ids`` output, its training and ``tqops.hf``), and the shipped drafter reads the last layer (1, 3, 5 of 6),
  so this comparison also checks that convention.
"""
from __future__ import annotations

import time

import pytest
import torch

from tqops import shipped
from tqops.models import DFlashDrafter, Qwen3ForCausalLM, generate
from tqops.train.accept import heldout_prompts
from tqops.train.tokenizer import load_tokenizer, special_ids

from .fixtures import capped_lengths

transformers = pytest.importorskip("transformers")
zlab = pytest.importorskip("dflash.model", reason="z-lab's reference: pip install --no-deps dflash==0.1.0")

PAIR = shipped.trained_pair()
pytestmark = pytest.mark.skipif(PAIR is None, reason="the shipped pair is not trained: " + shipped.train_command())
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 3, 128, 64


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer(PAIR[0])
    return heldout_prompts(tok, PROMPTS, PROMPT_TOKENS), special_ids(tok)["eos"]


@pytest.fixture(scope="module")
def reference_models():
    target = transformers.Qwen3ForCausalLM.from_pretrained(PAIR[0], dtype=torch.float32).eval()
    drafter = zlab.DFlashDraftModel.from_pretrained(PAIR[1], dtype=torch.float32).eval()
    return target, drafter


@pytest.fixture(scope="module")
def tqops_result(prompts):
    """tqops' greedy speculative ``generate`` on the fp16 cache, all prompts in one batch."""
    batch, eos = prompts
    target = Qwen3ForCausalLM.from_pretrained(PAIR[0], cache_format="fp16", dtype=torch.float32)
    drafter = DFlashDrafter.from_pretrained(PAIR[1], target=target, cache_format="fp16")
    return generate(target, batch, NEW_TOKENS, drafter=drafter, eos_token_id=eos)


def _assert_matches_reference(models, prompts, result, monkeypatch) -> None:
    """z-lab's ``dflash_generate`` per prompt, ``block_size`` tokens longer than compared and cut to ``NEW_TOKENS``,
    gives tqops' tokens and per-step token counts."""
    # return_stats (the only way to get acceptance_lengths) times with torch.cuda.synchronize, absent on CPU torch
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)
    target, drafter = models
    batch, eos = prompts
    for i, p in enumerate(batch):
        out = zlab.dflash_generate(drafter, target, torch.tensor([p]), NEW_TOKENS + drafter.block_size, [eos],
                                   temperature=0.0, return_stats=True)
        assert result.tokens[i] == out.output_ids[0, len(p):len(p) + NEW_TOKENS].tolist(), f"prompt {i}: tokens"
        assert result.acceptance_lengths[i] == capped_lengths(out.acceptance_lengths, NEW_TOKENS), \
            f"prompt {i}: tokens per step"


def test_fp16_cache_matches_dflash_generate(prompts, reference_models, tqops_result, monkeypatch):
    _assert_matches_reference(reference_models, prompts, tqops_result, monkeypatch)
