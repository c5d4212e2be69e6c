"""Batched generation: plain decoding, or DFlash speculative decoding with greedy or rejection-sampled verify."""
from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Iterable
from typing import Callable, Optional, Sequence, Union

import torch
from tqdm import tqdm

from ..checks import check_temperature, check_top_k, check_top_p
from ..cudagraph.steps import tables
from ..graphs import (KV_CACHE_GROUPS, ForwardContext, StateMetadata, build_metadata, compile_model,
                      mark_token_dim_dynamic, set_forward_context, slots_for_positions)
from ..graphs.compile import model_local
from .parallel import shared_seed
from .sampling import accept_block, choose_drafts, pick, verify
from .steps import drafter_step, drafter_step_variant, speculative_runners, step_uniforms, target_step

CACHE_BLOCK_SIZE = 16


@dataclasses.dataclass
class GenerateResult:
    """tokens[b]: new token ids of prompt b; acceptance_lengths[b]: tokens produced per decode step (accepted
    drafts + 1, capped by max_new_tokens/EOS); rollbacks[b]: block tokens dropped from the target cache per step."""

    tokens: list
    acceptance_lengths: list
    rollbacks: list
    mean_acceptance_length: float
    compile_reports: dict = dataclasses.field(default_factory=dict)


def step_context(query_lens, seq_lens, table, ctx_states=None, ctx_positions=None, state_indices=None,
                 pending_lens=None, stash: bool = False) -> ForwardContext:
    """One step's ForwardContext; every KV-cache group (full, sliding) shares the block table. ``state_indices``
    (targets with linear-attention layers): each sequence's state row, with ``pending_lens`` and ``stash`` as
    ``StateMetadata`` has them."""
    meta = build_metadata(query_lens, seq_lens, table, CACHE_BLOCK_SIZE, int(query_lens.sum()))
    if ctx_positions is not None:
        seq = torch.repeat_interleave(torch.arange(len(query_lens), device=table.device), query_lens)
        meta.context_slot_mapping = slots_for_positions(ctx_positions, seq, table, CACHE_BLOCK_SIZE)
    states = None if state_indices is None else StateMetadata(state_indices, meta.query_start_loc, pending_lens,
                                                                stash)
    return ForwardContext({g: meta for g in KV_CACHE_GROUPS}, context_states=ctx_states,
                          context_positions=ctx_positions, state_metadata=states)


def step_runner(model, fn, name: str, compile: bool, reports: dict) -> Callable:
    """``fn`` eagerly, or compiled once per model (fullgraph, dynamic token dim); its report goes to ``reports``."""
    if not compile:
        return fn
    cache = model_local(model, "_tqops_compiled")
    if name not in cache:
        cache[name] = compile_model(fn)
    compiled, reports[name] = cache[name]

    def run(*tensors, **kwargs):
        mark_token_dim_dynamic(*tensors)
        return compiled(*tensors, **kwargs)

    return run


def propose_drafts(drafter, run_drafter, draft_runner, block, ctx_states, ctx_pos, positions, q_lens, k_lens, table,
             temperature, uniforms):
    """The drafter step's ``propose`` output (DFlash v1: draft logits ``[n, bs - 1, V]``; DFlash2: its
    ``SelectedDrafts``) for blocks ``[n, bs]`` (last token + mask tokens), storing this step's context rows
    ``ctx_states`` ``[n, bs, C]`` at positions ``ctx_pos`` ``[n, bs]`` (-1: not stored) first. A captured graph when
    ``draft_runner`` is given, else ``run_drafter``: a v1 drafter's forward (eager or compiled) followed by
    ``propose``, or for a drafter that ``selects_in_step`` the whole step (``uniforms`` ``[n * bs]`` when it
    samples)."""
    n, bs = block.shape
    extra = () if uniforms is None else (uniforms,)
    if draft_runner is not None:
        rows = torch.arange(n, device=block.device).repeat_interleave(bs)
        slots = slots_for_positions(ctx_pos.flatten(), rows, table, CACHE_BLOCK_SIZE)
        more = {} if uniforms is None else {"uniforms": uniforms}
        return draft_runner(block.flatten(), positions, k_lens, tables(table),
                            context_states=ctx_states.flatten(0, 1), context_positions=ctx_pos.flatten(),
                            context_slot_mappings=tables(slots), **more)
    with set_forward_context(step_context(q_lens, k_lens, table, ctx_states.flatten(0, 1), ctx_pos.flatten())):
        out = run_drafter(block.flatten(), positions, *extra)
    return out if drafter.selects_in_step else drafter.propose(out, block.flatten(), temperature)


def is_integer_tensor(t: torch.Tensor) -> bool:
    """Integer dtype: not bool, floating or complex (token ids)."""
    return not (t.dtype == torch.bool or t.is_floating_point() or t.is_complex())


def _prompt_ids(prompts, vocab_size: int) -> list[list[int]]:
    """``generate``'s prompts as lists of token ids, every id an integer in ``[0, vocab_size)``: checked here, since
    the embedding would truncate float ids silently and index out of range in a compiled kernel aborts the
    process."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a list of prompts (token-id lists or integer tensors), got "
                        f"{type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, numbers.Integral) or (isinstance(p, torch.Tensor) and p.dim() == 0):
            # a tokenizer's ids for one text, passed without the batch list, would run as one-token prompts
            raise ValueError(f"prompts[{i}] is a single token id ({int(p)}); expected a list of prompts, each a list "
                             f"or 1-D tensor of token ids (for one prompt pass [ids])")
        try:
            ids = p if isinstance(p, torch.Tensor) else torch.as_tensor(p)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"prompts[{i}] must be a list of int token ids or an integer tensor, got "
                            f"{type(p).__name__}") from e
        if ids.numel() and not is_integer_tensor(ids):  # torch.as_tensor([]) is float: left to the empty check
            raise TypeError(f"prompts[{i}] must hold integer token ids, got {ids.dtype} values")
        ids = ids.flatten().long()
        bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
        if len(bad):
            j = int(bad[0])
            raise ValueError(f"prompts[{i}][{j}] is token id {int(ids[j])}, expected ids in [0, {vocab_size}) "
                             f"(the target's vocab_size)")
        out.append(ids.tolist())
    if not out or any(len(p) == 0 for p in out):
        raise ValueError("generate needs at least one prompt, and every prompt needs at least one token")
    return out


def eos_ids(eos_token_id) -> set:
    """``eos_token_id`` (None, an int, a list/tuple of ints, or a 0-/1-D integer tensor) as a set of ints."""
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor):
        if eos_token_id.dim() > 1 or not is_integer_tensor(eos_token_id):
            raise TypeError(f"eos_token_id must be None, an int, a list of ints or a 0-/1-D integer tensor, got a "
                            f"{eos_token_id.dim()}-D {eos_token_id.dtype} tensor")
        return set(eos_token_id.flatten().tolist())
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
        raise TypeError(f"eos_token_id must be None, an int, a list of ints or a 0-/1-D integer tensor, got "
                        f"{eos_token_id!r}")
    return {int(t) for t in ids}


def _check_drafter(target, drafter) -> None:
    """A DFlash drafter embeds and projects with the ``embed_tokens``/``lm_head`` of the target it was built for
    (``share_target``, which also checked its ``target_layer_ids`` against that target's layers); given another
    target it would draft from the other model silently, or fail deep inside on a missing layer."""
    if drafter.embed_tokens is not target.model.embed_tokens or drafter.lm_head is not target.lm_head:
        raise ValueError("drafter was not built for this target (its embed_tokens/lm_head are another model's, or "
                         "none): load it with DFlashDrafter.from_pretrained(path, target=target)")


@torch.no_grad()
def generate(target, prompts: Sequence[Union[Sequence[int], torch.Tensor]], max_new_tokens: int, *, drafter=None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, compile: bool = False,
             eos_token_id: Union[int, Sequence[int], torch.Tensor, None] = None, proposer=None,
             seed: Optional[int] = None, cudagraph: bool = False) -> GenerateResult:
    """Generate up to ``max_new_tokens`` per prompt (a batch of token-id lists / 1-D tensors of any lengths).

    Without ``drafter``/``proposer``: plain decoding. With a DFlash ``drafter``: per step it drafts a block (last
    token + mask tokens), the target verifies it causally, the longest accepted prefix plus a bonus token is kept
    and both caches roll back by seq_lens only. ``proposer`` (see ``OracleProposer``) replaces the drafter's drafts.
    Greedy at ``temperature == 0``, otherwise rejection sampling that keeps the target's distribution: softmax at
    ``temperature`` filtered by ``top_k`` (0: off) and ``top_p`` (1: off) as transformers' warpers filter it, the
    drafter's distribution filtered alike (``sampling.sampling_probs``; greedy ignores both). A DFlash2
    drafter chooses its drafts inside its step (the candidate selector's walk; sampled from uniforms this loop draws
    at temperature > 0), and verification takes q over its candidates.

    ``cudagraph=True``: the prefill runs as without it; every later step (target decode or verify, and the whole
    drafter step with its context injection) replays a CUDA graph captured per batch bucket for this call (on CPU
    the same padded steps run eagerly). With ``compile=True`` too, the captured steps are the compiled ones.
    Either way a step syncs with the host once, to read the accepted tokens.

    Tensor parallelism (a target built with ``tp_group``): every rank calls ``generate`` with the same arguments.
    Logits are all-gathered and everything else the loop reads is replicated, so every rank computes the same
    acceptance on its own: greedy argmax on identical logits, and at ``temperature > 0`` the same seeded generator
    on every rank (``seed``, or without one a seed rank 0 draws and broadcasts), with no per-step communication.
    """
    # Every argument is checked before anything is allocated, compiled or run.
    prompts, max_new_tokens, temperature, eos = _checked_args(target, prompts, max_new_tokens, temperature,
                                                              eos_token_id, drafter)
    top_k, top_p = check_top_k(top_k), check_top_p(top_p)
    dec = _decoder(target, drafter, proposer, prompts, max_new_tokens, temperature, seed, compile, cudagraph)
    dec.top_k, dec.top_p = top_k, top_p
    _prefill(dec, prompts)
    if cudagraph:
        _capture(dec)
    out = StepOutputs.start(dec.pending.tolist(), max_new_tokens, eos)
    while not all(out.done):
        step = _step_geometry(dec, out.active())
        drafts, q, candidates = _draft(dec, step, out.tokens)
        pending = dec.pending[step.idx][:, None]
        block = torch.cat([pending, drafts], 1) if dec.spec else pending  # [n, bs]
        logits, aux = _verify_block(dec, step, block)
        accepted, bonus = verify(logits, drafts, q, temperature, dec.gen, candidates, top_k, top_p)
        _advance(dec, step, accepted, bonus, aux)
        out.record(step.rows, block, accepted, bonus, dec.bs, max_new_tokens, eos)
    return out.result(dec.reports)


def _checked_args(target, prompts, max_new_tokens, temperature, eos_token_id, drafter) -> tuple:
    """``generate``'s arguments checked in order -> (prompts as lists of token ids, ``max_new_tokens`` as an int,
    the checked temperature, the set of EOS ids)."""
    prompts = _prompt_ids(prompts, target.config.vocab_size)
    # bool subclasses int, but True steps (or a True temperature) is a mistake, not 1
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__} {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    temperature = check_temperature(temperature)
    eos = eos_ids(eos_token_id)
    if drafter is not None:
        _check_drafter(target, drafter)
    return prompts, max_new_tokens, temperature, eos


@dataclasses.dataclass
class _Decoder:
    """One ``generate`` call's models, block table and step runners, and the state its steps carry on device for
    its B sequences (``bs`` tokens per step: the pending token, then ``bs - 1`` drafts; 1 for plain decoding)."""

    target: object
    drafter: object  # the DFlash drafter that drafts; None for plain decoding or when a proposer drafts
    proposer: object
    temperature: float
    gen: Optional[torch.Generator]
    device: torch.device
    bs: int
    spec: bool  # speculative: a drafter or a proposer drafts
    table: torch.Tensor  # [B, per_seq] int32: one block table per sequence, both models and KV-cache groups
    hybrid: bool  # the target has linear-attention layers: a state row per sequence
    cudagraph: bool
    state_rows: torch.Tensor  # [B]: each sequence's linear-attention state row
    pending_keep: torch.Tensor  # [B] int32: tokens of the last verify block the next step commits to the state
    layer_ids: Optional[tuple] = None  # the target layers whose hidden states the drafter reads
    reports: dict = dataclasses.field(default_factory=dict)
    run_target: Optional[Callable] = None
    run_drafter: Optional[Callable] = None
    run_context: Optional[Callable] = None
    sample_in_step: bool = False  # the drafter step samples from uniforms this loop draws
    verify_runner: Optional[Callable] = None
    draft_runner: Optional[Callable] = None
    pending: Optional[torch.Tensor] = None  # [B] long: each sequence's next input token
    seq_len: Optional[torch.Tensor] = None  # [B] long: tokens in the target cache (the pending token is not yet)
    ctx_states: Optional[torch.Tensor] = None  # [B, bs, C]: the drafter's context rows for the next step
    ctx_pos: Optional[torch.Tensor] = None  # [B, bs] long: their positions (-1: not stored)
    offsets: Optional[torch.Tensor] = None  # [bs]: 0 .. bs - 1
    top_k: int = 0  # sampling filters (0 / 1: off)
    top_p: float = 1.0


def _sampler(target, seed: Optional[int], temperature: float, device) -> Optional[torch.Generator]:
    """The generator of every sampling step (None: the global one); under tensor parallelism at temperature > 0
    seeded alike on every rank."""
    tp = getattr(target, "tp", None)
    if seed is None and temperature > 0 and tp is not None:
        seed = shared_seed(tp, device)  # each rank's global generator differs; the samplers must not
    return torch.Generator(device).manual_seed(seed) if seed is not None else None


def _decoder(target, drafter, proposer, prompts: list, max_new_tokens: int, temperature: float,
             seed: Optional[int], compile: bool, cudagraph: bool) -> _Decoder:
    """The caches of both models (and the target's linear-attention states) allocated for ``prompts``, and the step
    runners: eager, compiled once per model, or with ``cudagraph`` CUDA-graph runners kept per step geometry."""
    device = target.lm_head.weight.device
    spec = drafter is not None or proposer is not None
    bs = (proposer.block_size if proposer is not None else drafter.block_size) if spec else 1
    use_drafter = spec and proposer is None
    gen = _sampler(target, seed, temperature, device)
    B = len(prompts)

    # One block table per sequence (the same for target, drafter, and both KV-cache groups).
    per_seq = -(-(max(map(len, prompts)) + max_new_tokens + bs) // CACHE_BLOCK_SIZE)
    table = torch.arange(B * per_seq, dtype=torch.int32, device=device).view(B, per_seq)
    target.allocate_cache(B * per_seq, CACHE_BLOCK_SIZE, device)
    # Linear-attention layers: a state row per prompt. A verify block is stashed, not committed; the next step commits
    # its accepted prefix (pending) before running, which is the recurrent state's rollback.
    hybrid = bool(getattr(target, "state_layers", ()))
    if hybrid:
        target.allocate_state(B, bs, device)
    dec = _Decoder(target=target, drafter=drafter if use_drafter else None, proposer=proposer,
                   temperature=temperature, gen=gen, device=device, bs=bs, spec=spec, table=table, hybrid=hybrid,
                   cudagraph=cudagraph, state_rows=torch.arange(B, device=device),
                   pending_keep=torch.zeros(B, dtype=torch.int32, device=device))
    dec.run_target = step_runner(target, target, "target", compile, dec.reports)
    draft_name = None
    if use_drafter:
        drafter.allocate_cache(B * per_seq, CACHE_BLOCK_SIZE, device)
        draft_name = _drafter_runners(dec, compile)
        dec.layer_ids = drafter.target_layer_ids
    if cudagraph:
        dec.verify_runner, dec.draft_runner = _graph_runners(dec, compile, draft_name)
    return dec


def _drafter_runners(dec: _Decoder, compile: bool) -> str:
    """Sets the drafter's eager or compiled runners (its step, unless it replays a graph, and its prefill context
    store); returns the name of its compiled step."""
    drafter = dec.drafter
    # With cudagraph the drafter step replays a captured graph (draft_runner) instead. A drafter that selects
    # its drafts in its step (DFlash2) runs that whole step here too, one graph per temperature.
    variant = drafter_step_variant(drafter, dec.temperature)
    draft_name = "drafter_step" if variant is None else f"drafter_step(temperature={variant})"
    dec.sample_in_step = step_uniforms(drafter, dec.temperature)
    if dec.cudagraph:
        dec.run_drafter = None
    elif drafter.selects_in_step:
        dec.run_drafter = step_runner(drafter, drafter_step(drafter, dec.temperature), draft_name, compile,
                                      dec.reports)
    else:
        dec.run_drafter = step_runner(drafter, drafter, "drafter", compile, dec.reports)
    dec.run_context = step_runner(drafter, drafter.prefill_context, "drafter_context", compile, dec.reports)
    return draft_name


def _graph_runners(dec: _Decoder, compile: bool, draft_name: Optional[str]) -> tuple:
    """The (target verify, drafter) CUDA-graph runners of this call's step geometry (drafter runner None without a
    drafter), their steps compiled with ``compile``."""
    target, drafter, layer_ids, reports = dec.target, dec.drafter, dec.layer_ids, dec.reports
    B, per_seq = dec.table.shape
    key = (B, per_seq, dec.bs, str(dec.device), compile, layer_ids, id(drafter) if drafter is not None else None)
    state_mode = ("stash" if dec.spec else "commit") if dec.hybrid else None
    return speculative_runners(
        target, drafter, key,
        lambda: step_runner(target, target_step(target, layer_ids), f"target_step{layer_ids}", compile, reports),
        lambda: step_runner(drafter, drafter_step(drafter, dec.temperature), draft_name, compile, reports),
        q_len=dec.bs, max_batch=B, max_blocks=per_seq, block_size=CACHE_BLOCK_SIZE, device=dec.device,
        state_mode=state_mode, temperature=dec.temperature)


def _prefill(dec: _Decoder, prompts: list) -> None:
    """The target over the prompts (the drafter storing every prompt row as context): sets each sequence's pending
    token ``[B]`` from the logits at its last prompt token, its cache length ``[B]`` and empty drafter context rows
    ``[B, bs, C]``."""
    device, table = dec.device, dec.table
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)
    ids = torch.tensor(sum(prompts, []), dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(len(p), device=device) for p in prompts])
    with set_forward_context(step_context(lens, lens, table, state_indices=dec.state_rows if dec.hybrid else None)):
        out = dec.run_target(ids, pos, layer_ids=dec.layer_ids)
    hidden, aux = out if dec.drafter is not None else (out, None)
    dec.pending = pick(dec.target.compute_logits(hidden[lens.long().cumsum(0) - 1]), dec.temperature, dec.gen,
                       dec.top_k, dec.top_p)
    if dec.drafter is not None:
        with set_forward_context(step_context(lens, lens, table, aux, pos)):
            dec.run_context(ids)
        B = len(prompts)
        dec.ctx_states = torch.zeros(B, dec.bs, dec.drafter.context_dim, dtype=aux.dtype, device=device)
        dec.ctx_pos = torch.full((B, dec.bs), -1, dtype=torch.long, device=device)
    dec.seq_len = lens.long()
    dec.offsets = torch.arange(dec.bs, device=device)


def _capture(dec: _Decoder) -> None:
    """Captures the step graphs of every batch bucket, unless kept from an earlier call of the same geometry."""
    # after the caches are allocated and filled: warm-up steps use seq_len 0 and slot -1
    for r in (dec.verify_runner, dec.draft_runner) if dec.drafter is not None else (dec.verify_runner,):
        if not r.captured_buckets():
            r.capture(progress=False)


@dataclasses.dataclass
class _Step:
    """The n active sequences of one decode step and where their blocks go."""

    rows: list  # their indices in the batch
    idx: torch.Tensor  # [n]: the same, on device
    L: torch.Tensor  # [n] long: their tokens in the target cache
    table: torch.Tensor  # [n, per_seq]: their block tables
    positions: torch.Tensor  # [n * bs]: the block tokens' positions
    q_lens: torch.Tensor  # [n] int32: bs each
    k_lens: torch.Tensor  # [n] int32: L + bs

    @property
    def n(self) -> int:
        return len(self.rows)


def _step_geometry(dec: _Decoder, act: list) -> _Step:
    """The step of the active sequences ``act``: a block of ``bs`` tokens each, after its cached tokens."""
    n, act_t = len(act), torch.tensor(act, device=dec.device)
    L, tab = dec.seq_len[act_t], dec.table[act_t]
    positions = (L[:, None] + dec.offsets).flatten()
    q_lens, k_lens = torch.full((n,), dec.bs, dtype=torch.int32, device=dec.device), (L + dec.bs).int()
    return _Step(act, act_t, L, tab, positions, q_lens, k_lens)


def _draft(dec: _Decoder, step: _Step, tokens: list) -> tuple:
    """-> (drafts ``[n, bs - 1]``, q, candidates) for ``verify``, all None for plain decoding; a proposer's drafts
    (``tokens``: each sequence's output so far) with one-hot q ``[n, bs - 1, V]``, or the drafter's."""
    if dec.proposer is not None:
        drafts = dec.proposer(step.rows, [tokens[b] for b in step.rows]).to(dec.device)
        return drafts, torch.nn.functional.one_hot(drafts, dec.target.config.vocab_size).float(), None
    if dec.drafter is None:
        return None, None, None
    block = torch.full((step.n, dec.bs), dec.drafter.mask_token_id, dtype=torch.long, device=dec.device)
    block[:, 0] = dec.pending[step.idx]
    uniforms = torch.rand(step.n * dec.bs, generator=dec.gen, device=dec.device) if dec.sample_in_step else None
    proposal = propose_drafts(dec.drafter, dec.run_drafter, dec.draft_runner, block, dec.ctx_states[step.idx],
                        dec.ctx_pos[step.idx], step.positions, step.q_lens, step.k_lens, step.table,
                        dec.temperature, uniforms)
    return choose_drafts(proposal, dec.temperature, dec.gen, dec.top_k, dec.top_p)


def _verify_block(dec: _Decoder, step: _Step, block: torch.Tensor) -> tuple:
    """The target over the blocks ``[n, bs]`` -> (logits ``[n, bs, V]`` float32, the drafter's context rows
    ``[n * bs, C]`` or None); a verify block is stashed in the linear-attention states, a plain step committed."""
    states = {}
    if dec.hybrid:
        states = dict(state_indices=step.idx, pending_lens=dec.pending_keep[step.idx] if dec.spec else None)
    if dec.cudagraph:  # outputs are views of static graph memory, consumed before the next replay
        logits, aux = dec.verify_runner(block.flatten(), step.positions, step.k_lens, tables(step.table), **states)
        return logits.view(step.n, dec.bs, -1), aux
    with set_forward_context(step_context(step.q_lens, step.k_lens, step.table, stash=dec.spec, **states)):
        out = dec.run_target(block.flatten(), step.positions, layer_ids=dec.layer_ids)
    hidden, aux = out if dec.drafter is not None else (out, None)
    return dec.target.compute_logits(hidden).view(step.n, dec.bs, -1).float(), aux


def _advance(dec: _Decoder, step: _Step, accepted: torch.Tensor, bonus: torch.Tensor, aux) -> None:
    """Keeps each block's accepted prefix (``accepted`` ``[n]`` drafts) and its bonus token ``[n]`` as the next
    pending token; the target cache keeps pending + accepted drafts (seq_lens only)."""
    dec.seq_len[step.idx] = step.L + accepted + 1
    dec.pending[step.idx] = bonus
    dec.pending_keep[step.idx] = (accepted + 1).int()
    if dec.drafter is not None:  # next step's context rows: the kept tokens' target states, the rest skipped (-1)
        dec.ctx_states[step.idx] = aux.view(step.n, dec.bs, -1)
        dec.ctx_pos[step.idx] = torch.where(dec.offsets <= accepted[:, None], step.L[:, None] + dec.offsets, -1)


@dataclasses.dataclass
class StepOutputs:
    """Per sequence, on the host: its new tokens, the tokens each step added and the block tokens it rolled back,
    and whether it is finished."""

    tokens: list
    acceptance_lengths: list
    rollbacks: list
    done: list

    @classmethod
    def start(cls, first: list, max_new_tokens: int, eos: set) -> StepOutputs:
        """Each sequence's first token, from the prefill."""
        tokens = [[t] for t in first]
        B = len(tokens)
        return cls(tokens, [[] for _ in range(B)], [[] for _ in range(B)],
                   [t[0] in eos or max_new_tokens <= 1 for t in tokens])

    def active(self) -> list:
        return [b for b in range(len(self.done)) if not self.done[b]]

    def record(self, act: list, block: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor, bs: int,
               max_new_tokens: int, eos: set) -> None:
        """Appends a step's output for the sequences ``act``: blocks ``[n, bs]``, accepted counts and bonus tokens
        ``[n]``."""
        # The step's one host sync: block, accepted count and bonus token of every active sequence.
        step_l = torch.cat([block, accepted[:, None].long(), bonus[:, None].long()], 1).tolist()
        for i, b in enumerate(act):
            *block_i, accepted_i, bonus_i = step_l[i]
            added, self.done[b] = accept_block(self.tokens[b], block_i, accepted_i, bonus_i, max_new_tokens, eos)
            self.acceptance_lengths[b].append(added)
            self.rollbacks[b].append(bs - 1 - accepted_i)

    def result(self, reports: dict) -> GenerateResult:
        acc = self.acceptance_lengths
        steps = sum(len(a) for a in acc)
        mean = sum(map(sum, acc)) / steps if steps else 0.0
        return GenerateResult(self.tokens, acc, self.rollbacks, mean, reports)


def timed_generate(target, prompts, max_new_tokens: int, *, rounds: int = 1, warm_up: bool = True,
                   progress: Optional[str] = None, **options) -> tuple[GenerateResult, float]:
    """``generate`` timed -> (the last call's result, seconds per call over ``rounds`` calls, CUDA synchronized).

    ``warm_up``: one untimed call first with the same arguments, so compilation and graph capture stay out of the
    timing; a shorter warm-up would size the caches and block tables differently and the timed call would
    recompile. ``progress``: a tqdm bar over the rounds with that description."""
    sync = torch.cuda.synchronize if target.lm_head.weight.is_cuda else (lambda: None)
    if warm_up:
        generate(target, prompts, max_new_tokens, **options)
    sync()
    start = time.perf_counter()
    for _ in tqdm(range(rounds), desc=progress, disable=progress is None):
        result = generate(target, prompts, max_new_tokens, **options)
    sync()
    return result, (time.perf_counter() - start) / rounds
