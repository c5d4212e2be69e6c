"""DFlash speculative decoding with a Hugging Face causal LM (attn_implementation="tqops") as the target."""
from __future__ import annotations

import inspect
from typing import Optional, Sequence, Union

import torch

from ..checks import check_temperature, check_top_k, check_top_p
from ..graphs import set_forward_context
from ..models.generate import (CACHE_BLOCK_SIZE, GenerateResult, StepOutputs, eos_ids, is_integer_tensor,
                               propose_drafts, step_context, step_runner)
from ..models.hooks import layer_outputs
from ..models.sampling import choose_drafts, pick, verify
from ..models.steps import drafter_step, drafter_step_variant, step_uniforms
from .cache import ATTN_IMPLEMENTATION, PagedKVCache

Prompts = Union[torch.Tensor, Sequence[Union[Sequence[int], torch.Tensor]]]


@torch.no_grad()
def generate_speculative(hf_model, drafter, input_ids: Prompts, max_new_tokens: int, *,
                         attention_mask: Optional[torch.Tensor] = None, temperature: float = 0.0,
                         top_k: int = 0, top_p: float = 1.0, cache_format: str = "turboquant_4bit_nc", layer_cache_formats=None,
                         past_key_values: Optional[PagedKVCache] = None,
                         eos_token_id: Union[int, Sequence[int], torch.Tensor, None] = None,
                         generator: Optional[torch.Generator] = None, proposer=None,
                         compile: bool = False) -> GenerateResult:
    """Up to ``max_new_tokens`` new tokens per prompt from ``hf_model`` (a transformers causal LM loaded with
    ``attn_implementation="tqops"``), drafted by a tqops ``DFlashDrafter`` (or ``DFlash2Drafter``) that shares its
    ``embed_tokens`` and ``lm_head`` (``DFlashDrafter(config, target=hf_model)``).

    ``input_ids``: ``[batch, len]`` left-padded token ids with ``attention_mask`` ``[batch, len]`` (1 for real
    tokens; None: no padding), or a list of prompts (token-id lists / 1-D tensors of any lengths).
    Each step the drafter drafts a block (last token + ``block_size - 1`` mask tokens) in one pass, ``hf_model``
    verifies it with one ``block_size``-token forward through its own modules and a ``PagedKVCache`` in
    ``cache_format`` (``layer_cache_formats`` overrides by layer), and each row keeps its longest accepted prefix
    plus a bonus token; the rows' rejected tails are dropped with ``PagedKVCache.rollback_rows``. Greedy at
    ``temperature == 0`` (the tokens of ``hf_model.generate(do_sample=False)`` with the same cache format), else
    rejection sampling that keeps the target's distribution (filtered by ``top_k`` and ``top_p`` as ``generate``'s
    ``top_k``/``top_p`` filter it; 0 / 1: off), drawing from ``generator`` (on ``hf_model``'s device; None: the
    global one). The drafter step is ``tqops.models.generate``'s: a DFlash2 drafter's candidate selector
    walks its top-K candidates inside the step (sampled from uniforms drawn from ``generator``), and verification
    takes q over those candidates. ``proposer`` (e.g. ``tqops.models.OracleProposer``) replaces the drafter's drafts.
    ``past_key_values``: a ``PagedKVCache`` to use (reset first) instead of a new one sized to the call.

    ``compile=True`` (dense targets): the verify forward is ``torch.compile(fullgraph=True)``, replayed as a CUDA
    graph on CUDA (``mode="reduce-overhead"``: one graph for the call's batch and block), and the drafter's step is
    compiled as ``tqops.models.generate`` compiles it (once per drafter; the same compiled step serves both loops).
    The prefill stays eager. Later calls reuse the compiled steps; a new batch size or prompt width compiles them once
    more, with dynamic sizes, which then serve every shape.

    Every argument is checked before anything runs, as ``tqops.models.generate`` checks them: token ids in
    ``[0, vocab_size)`` (padding included: the embedding reads it too), a finite ``temperature >= 0``, an int
    ``top_k >= 0``, ``top_p`` in (0, 1].

    Returns ``tqops.models.GenerateResult``: per prompt the new tokens (stopping after an ``eos_token_id``), the
    tokens produced per verify step, the block tokens rolled back per step, and the mean acceptance length.
    """
    if getattr(hf_model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        raise ValueError(f"hf_model uses attn_implementation={getattr(hf_model.config, '_attn_implementation', None)!r}"
                         f"; load it with attn_implementation={ATTN_IMPLEMENTATION!r} (after import tqops.hf) or call "
                         f"hf_model.set_attn_implementation({ATTN_IMPLEMENTATION!r})")
    if drafter is None and proposer is None:
        raise ValueError("generate_speculative needs a drafter (or a proposer); for plain decoding use "
                         "hf_model.generate(past_key_values=tqops.hf.PagedKVCache(...))")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    sampling = (check_temperature(temperature), check_top_k(top_k), check_top_p(top_p))  # generate's rules
    eos = eos_ids(eos_token_id)
    if proposer is None:
        _check_drafter(hf_model, drafter)
    block_size = drafter.block_size if proposer is None else proposer.block_size
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool, got {type(compile).__name__} {compile!r}")
    ids, mask = _left_padded(input_ids, attention_mask, hf_model.device, _vocab_size(hf_model))
    # Columns the cache must take: the prompt width, every new token but the pending one, and a whole block.
    needed = ids.shape[1] + max_new_tokens - 1 + block_size
    cache = _target_cache(hf_model, past_key_values, ids.shape[0], needed, cache_format, layer_cache_formats,
                          hf_model.device)
    if compile and cache.is_hybrid:
        raise NotImplementedError("compile=True runs dense targets; a hybrid target's verify step records its Gated "
                                  "DeltaNet inputs for the rollback, which runs eagerly: call with compile=False")
    run = _Speculation(hf_model, None if proposer is not None else drafter, proposer, cache, block_size, sampling,
                       generator, compile)
    # A hybrid model's Gated DeltaNet layers hand each step's inputs to the cache, which replays the kept tokens
    # when a row rolls back; the drafter's target layers are hooked for the whole call.
    with cache.record_linear_inputs(hf_model), layer_outputs(hf_model.model, run.layer_ids) as run.outputs:
        out = StepOutputs.start(run.prefill(ids, mask, needed).tolist(), max_new_tokens, eos)
        # every row runs each step (the cache's rows are fixed); a finished row drops its whole block
        while not all(out.done):
            act = out.active()
            block, accepted, bonus = run.step(out.tokens)
            out.record(act, block[act], accepted[act], bonus[act], block_size, max_new_tokens, eos)
            run.advance(torch.tensor([not d for d in out.done], device=hf_model.device), accepted, bonus)
    return out.result(run.reports)


def _vocab_size(hf_model) -> int:
    return hf_model.config.get_text_config(decoder=True).vocab_size


class _Speculation:
    """One ``generate_speculative`` call's models, caches and per-row state: each row's pending token, the tokens
    it holds in the target cache, and the drafter's context rows for the next step."""

    def __init__(self, hf_model, drafter, proposer, cache: PagedKVCache, block_size: int, sampling: tuple,
                 generator, compile: bool):
        self.hf_model, self.drafter, self.proposer, self.cache = hf_model, drafter, proposer, cache
        self.block_size, self.generator = block_size, generator
        self.temperature, self.top_k, self.top_p = sampling
        self.cache_arg = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
        self.layer_ids = drafter.target_layer_ids if drafter is not None else ()
        self.offsets = torch.arange(block_size, device=hf_model.device)
        self.outputs: dict = {}  # the hooked layers' outputs of the last forward (layer_outputs)
        self.reports: dict = {}
        self.verify_forward = self.target
        # a replayed CUDA graph's outputs are overwritten by its next replay; the drafter reads the states a step later
        self.replayed = compile and hf_model.device.type == "cuda"
        if compile:
            self.verify_forward = torch.compile(self.target, fullgraph=True,
                                                mode="reduce-overhead" if self.replayed else None)
        if drafter is not None:
            # generate's drafter runners and names: a v1 drafter's forward then propose, or a DFlash2 drafter's
            # whole step (its walk depends on the temperature)
            variant = drafter_step_variant(drafter, self.temperature)
            fn, name = (drafter, "drafter") if variant is None else \
                (drafter_step(drafter, self.temperature), f"drafter_step(temperature={variant})")
            self.run_drafter = step_runner(drafter, fn, name, compile, self.reports)

    def target(self, tokens, positions, padding=None, logits_to_keep=0):
        """``hf_model``'s logits ``[batch, logits_to_keep or tokens, V]`` (fp32) and the outputs of ``layer_ids``
        concatenated ``[batch, tokens, len(layer_ids) * hidden]`` (None without a drafter)."""
        logits = self.hf_model(input_ids=tokens, attention_mask=padding, position_ids=positions, use_cache=True,
                               logits_to_keep=logits_to_keep, **{self.cache_arg: self.cache}).logits
        states = torch.cat([self.outputs[i] for i in self.layer_ids], -1) if self.layer_ids else None
        return logits.float(), states

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, needed: int) -> torch.Tensor:
        """The target over the left-padded prompts ``[batch, width]``; the drafter stores every real prompt row as
        context in its own paged cache (a row of blocks per sequence, positions as the target's, padding not
        counted). Returns each row's first new token ``[batch]``."""
        batch, device = ids.shape[0], ids.device
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # what transformers' generate gives left-padded rows
        logits, states = self.target(ids, positions, mask, logits_to_keep=1)
        self.pending = pick(logits[:, -1], self.temperature, self.generator, self.top_k, self.top_p)
        self.seq_len = mask.sum(1)  # [batch]: tokens in the target cache (the pending one is not in yet)
        if self.drafter is not None:
            blocks_per_row = -(-needed // CACHE_BLOCK_SIZE)
            self.table = torch.arange(batch * blocks_per_row, dtype=torch.int32, device=device).view(batch, -1)
            self.drafter.allocate_cache(batch * blocks_per_row, CACHE_BLOCK_SIZE, device)
            real = mask.bool()
            with set_forward_context(step_context(self.seq_len.int(), self.seq_len.int(), self.table, states[real],
                                                  positions[real])):
                self.drafter.prefill_context(ids[real])
            self.context_states = torch.zeros(batch, self.block_size, self.drafter.context_dim, dtype=states.dtype,
                                              device=device)
            self.context_positions = torch.full((batch, self.block_size), -1, dtype=torch.long, device=device)
        return self.pending

    def step(self, tokens: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft a block per row and verify it -> (blocks ``[batch, block_size]``, accepted drafts and bonus tokens
        ``[batch]``); ``tokens``: each row's output so far (what a proposer reads)."""
        self.positions = self.seq_len[:, None] + self.offsets  # [batch, block_size]
        if self.drafter is not None:
            drafts, q, candidates = self.draft()
        else:
            drafts, candidates = self.proposer(list(range(len(tokens))), tokens).to(self.pending.device), None
            q = torch.nn.functional.one_hot(drafts, _vocab_size(self.hf_model)).float()
        block = torch.cat([self.pending[:, None], drafts], 1)
        logits, states = self.verify_forward(block, self.positions)
        self.states = states.clone() if self.replayed and states is not None else states
        accepted, bonus = verify(logits, drafts, q, self.temperature, self.generator, candidates, self.top_k,
                                 self.top_p)
        return block, accepted, bonus

    def draft(self) -> tuple:
        """One drafter step over blocks ``[pending, mask...]`` at this step's positions, storing the previous step's
        kept context rows first -> (drafts ``[batch, block_size - 1]``, q, candidates) as ``verify`` takes them: a v1
        drafter's drafts picked from its logits (q ``[batch, block_size - 1, V]``), a DFlash2 drafter's
        candidate-selector walk (q over its candidates ``[batch, block_size - 1, K]``); q is None when greedy.

        ``tqops.models.generate``'s step (``propose_drafts``): a drafter that samples in its step takes one uniform
        per block token, drawn from ``generator`` before the pass, so both loops consume the same random numbers in
        the same order."""
        batch, block_size = self.positions.shape
        device = self.pending.device
        block = torch.full((batch, block_size), self.drafter.mask_token_id, dtype=torch.long, device=device)
        block[:, 0] = self.pending
        uniforms = torch.rand(batch * block_size, generator=self.generator, device=device) \
            if step_uniforms(self.drafter, self.temperature) else None
        query_lens = torch.full((batch,), block_size, dtype=torch.int32, device=device)
        proposal = propose_drafts(self.drafter, self.run_drafter, None, block, self.context_states,
                                  self.context_positions, self.positions.flatten(), query_lens,
                                  (self.positions[:, -1] + 1).int(), self.table, self.temperature, uniforms)
        return choose_drafts(proposal, self.temperature, self.generator, self.top_k, self.top_p)

    def advance(self, going: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor) -> None:
        """A row still ``going`` keeps pending + its accepted drafts in the cache, and its bonus token is the next
        pending one; a finished row keeps nothing of the block, so no row grows past the cache's length."""
        kept = torch.where(going, accepted + 1, 0)
        self.cache.rollback_rows(self.block_size - kept)
        self.seq_len = self.seq_len + kept
        self.pending = bonus
        if self.drafter is not None:  # next step's context rows: the kept tokens' target states, the rest not stored
            self.context_states = self.states
            self.context_positions = torch.where(self.offsets < kept[:, None], self.positions, -1)


def _check_drafter(hf_model, drafter) -> None:
    """The drafter reads ``hf_model``'s hidden states and shares its embeddings and lm_head."""
    decoder = getattr(hf_model, "model", None)
    if not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList) or \
            not isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        raise TypeError(f"hf_model ({type(hf_model).__name__}) has no decoder layers and final norm at "
                        "hf_model.model.layers and hf_model.model.norm, where the drafter's target layers are read; "
                        "expected a Llama-style ...ForCausalLM")
    text = hf_model.config.get_text_config(decoder=True)
    if drafter.config.hidden_size != text.hidden_size or drafter.config.vocab_size != text.vocab_size:
        raise ValueError(f"drafter has hidden_size={drafter.config.hidden_size}, vocab_size="
                         f"{drafter.config.vocab_size}; hf_model has hidden_size={text.hidden_size}, vocab_size="
                         f"{text.vocab_size}: build the drafter for this target")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < text.num_hidden_layers]
    if bad:
        raise ValueError(f"drafter.target_layer_ids {drafter.target_layer_ids} name layers {bad} outside hf_model's "
                         f"{text.num_hidden_layers} layers")
    if drafter.embed_tokens is not hf_model.get_input_embeddings() or \
            drafter.lm_head is not hf_model.get_output_embeddings():
        raise ValueError("drafter does not share hf_model's embed_tokens and lm_head; build it with "
                         "DFlashDrafter(config, target=hf_model) or call drafter.share_target(hf_model)")


def _left_padded(input_ids: Prompts, attention_mask: Optional[torch.Tensor], device,
                 vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and padding mask ``[batch, width]`` (long, on ``device``), left-padded, each row with >= 1 token,
    every id (padding included: the embedding reads it too) in ``[0, vocab_size)``."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.is_floating_point():
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)} ({input_ids.dtype}); expected integer "
                             "token ids [batch, len] (or a list of prompts)")
        ids = input_ids.to(device, torch.long)
        if attention_mask is None:
            mask = torch.ones_like(ids)
        elif not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
            raise ValueError(f"attention_mask is {shape}; expected input_ids' shape {tuple(input_ids.shape)}")
        else:
            mask = attention_mask.to(device, torch.long)
    else:
        if attention_mask is not None:
            raise ValueError("attention_mask goes with input_ids [batch, len]; a list of prompts is padded here")
        prompts = [_prompt(i, p) for i, p in enumerate(input_ids)]
        if not prompts:
            raise ValueError("input_ids holds no prompt; expected at least one")
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
        ids, mask = ids.to(device), mask.to(device)
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if len(bad):
        row, col = (int(i) for i in bad[0])
        # a list's prompt is named by its own index, a tensor's entry by [row, column]
        where = f"[{row}][{col - (ids.shape[1] - len(prompts[row]))}]" if not isinstance(input_ids, torch.Tensor) \
            else f"[{row}, {col}]"
        raise ValueError(f"input_ids{where} is token id {int(ids[row, col])}, expected ids in [0, {vocab_size}) "
                         "(hf_model's vocab_size)")
    if bool(((mask != 0) & (mask != 1)).any()) or bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("attention_mask must be 0 (padding) then 1 (real tokens) in each row: left padding only")
    if bool((mask.sum(1) == 0).any()):
        raise ValueError(f"prompt {int((mask.sum(1) == 0).nonzero()[0, 0])} has no tokens; every prompt needs one")
    return ids, mask


def _prompt(index: int, prompt) -> torch.Tensor:
    """Prompt ``index`` of a list of prompts as 1-D long token ids; a bare id means the list was one prompt."""
    ids = torch.as_tensor(prompt)
    if ids.dim() == 0:
        # A flat list (tokenizer(text).input_ids) would otherwise be taken for one-token prompts, one per token.
        raise ValueError(f"input_ids[{index}] is a single token id ({prompt!r}); expected a list of prompts, each a "
                         "list or 1-D tensor of token ids (for one prompt pass [input_ids])")
    if ids.numel() and not is_integer_tensor(ids):
        # Casting would truncate 5.9 to 5: the tensor path rejects non-integer ids too.
        raise ValueError(f"input_ids[{index}] holds {ids.dtype} values; expected integer token ids")
    return ids.to(torch.long).flatten()


def _target_cache(hf_model, cache: Optional[PagedKVCache], batch: int, needed: int, cache_format, layer_cache_formats,
                  device) -> PagedKVCache:
    """The given ``PagedKVCache`` (checked, then reset), or a new one for ``batch`` rows of ``needed`` columns."""
    if cache is None:
        return PagedKVCache(hf_model.config, cache_format, max_batch_size=batch, max_cache_len=needed,
                            layer_cache_formats=layer_cache_formats, device=device)
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"past_key_values must be a tqops.hf.PagedKVCache, got {type(cache).__name__}")
    if batch > cache.max_batch_size:
        raise ValueError(f"{batch} prompts exceed past_key_values' max_batch_size={cache.max_batch_size}")
    if needed > cache.max_cache_len:
        raise ValueError(f"past_key_values has max_cache_len={cache.max_cache_len}; this call needs {needed} (prompt "
                         "width + max_new_tokens - 1 + block_size)")
    cache.reset()
    return cache
