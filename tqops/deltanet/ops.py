"""The gated_delta_rule / causal_conv1d custom ops (Qwen3.5's Gated DeltaNet layers) and the rollback helpers of
speculative decoding: registration, fake impls, validation and device dispatch.

Both ops take tqops' packed varlen layout: the tokens of ``batch`` sequences back to back, sequence b the rows
``[query_start_loc[b], query_start_loc[b + 1])``; rows past ``query_start_loc[-1]`` are padding (their outputs are 0)
and a sequence may be empty (its state comes back unchanged). States are inputs, never mutated: each op returns new
ones. Inference only (no autograd). On CUDA ``causal_conv1d`` runs one Triton kernel (``triton_conv``) and
``gated_delta_rule`` flash-linear-attention's kernels (an optional dependency); elsewhere both run torch references.
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Optional

import torch
import torch.nn.functional as F

from ..checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_size, check_scale, check_tensor, in_graph_region
from .naive import gated_delta_rule_naive

logger = logging.getLogger(__name__)

# CUDA: up to this mean of tokens per sequence (n / batch, known from shapes alone) FLA's fused recurrent kernel runs
# (a program per sequence and head, serial over tokens: decode and verify blocks); past it, its chunked kernel.
FUSED_RECURRENT_MAX_MEAN_TOKENS = 64
ACTIVATIONS = ("silu", None)


def _check_device(name: str, t: torch.Tensor, device: torch.device, of: str) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, but {of} is on {device}; expected the same device")


def _check_query_start_loc(query_start_loc, batch, device, of: str) -> None:
    check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, ndim=1)
    _check_device("query_start_loc", query_start_loc, device, of)
    check_same_size(query_start_loc.shape[0] == batch + 1,
                    f"query_start_loc has {query_start_loc.shape[0]} entries; expected batch + 1 = {batch + 1} "
                    f"({of} holds {batch} sequences)")


def check_query_start_loc_values(query_start_loc: torch.Tensor, num_tokens: int) -> None:
    """Eager-only (a host sync; skipped in a graph region): starts at 0, non-decreasing, ends at most at num_tokens."""
    if in_graph_region():
        return
    starts = query_start_loc.tolist()
    if starts[0] != 0 or starts[-1] > num_tokens:
        raise ValueError(f"query_start_loc must start at 0 and end at most at num_tokens={num_tokens}; got first "
                         f"{starts[0]}, last {starts[-1]}")
    for b in range(len(starts) - 1):
        if starts[b + 1] < starts[b]:
            raise ValueError(f"query_start_loc must be non-decreasing; got query_start_loc[{b + 1}] = {starts[b + 1]} "
                             f"< query_start_loc[{b}] = {starts[b]}")


def _bounds(query_start_loc: torch.Tensor, num_tokens) -> torch.Tensor:
    """query_start_loc as a new int64 tensor clamped into [0, num_tokens] and non-decreasing: whatever values reach a
    raw op (the eager wrappers reject bad ones first), it reads no row outside its inputs, on CPU and GPU alike."""
    return torch.cummax(query_start_loc.long().clamp(0, num_tokens), 0).values


# ---- gated_delta_rule ------------------------------------------------------------------------------------------------

def check_gated_delta_rule_args(q, k, v, g, beta, state, query_start_loc, scale, use_qk_l2norm) -> None:
    """Shapes, dtypes, devices and scalars (no tensor values), so the op and its fake impl both run it."""
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    n, hk, dk = q.shape
    check_tensor("k", k, dtypes=(q.dtype,), ndim=3)
    check_tensor("v", v, dtypes=(q.dtype,), ndim=3)
    hv, dv = v.shape[1:]
    if k.shape[1:] != q.shape[1:]:
        raise ValueError(f"k has shape {tuple(k.shape)}; expected q's shape {tuple(q.shape)}")
    check_same_size(k.shape[0] == n, f"k has shape {tuple(k.shape)}; expected q's shape {tuple(q.shape)}")
    check_same_size(v.shape[0] == n, f"v has {v.shape[0]} rows; expected one per q row ({n})")
    if hk < 1 or hv % hk:
        raise ValueError(f"v has {hv} heads, not a multiple of q and k's {hk} heads (each key head serves "
                         f"Hv / Hk value heads)")
    for name, t in (("g", g), ("beta", beta)):
        check_tensor(name, t, dtypes=(torch.float32,), ndim=2)
        if t.shape[1] != hv:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [num_tokens, Hv] = [{n}, {hv}]")
        check_same_size(t.shape[0] == n, f"{name} has shape {tuple(t.shape)}; expected [num_tokens, Hv] = [{n}, {hv}]")
    check_tensor("state", state, dtypes=(torch.float32,), ndim=4)
    batch = state.shape[0]
    if state.shape[1:] != (hv, dk, dv):
        raise ValueError(f"state has shape {tuple(state.shape)}; expected [batch, Hv, dk, dv] = "
                         f"[{batch}, {hv}, {dk}, {dv}]")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        _check_device(name, t, q.device, "q")
    _check_query_start_loc(query_start_loc, batch, q.device, "state")
    if scale is not None:
        check_scale("scale", scale)
    if not isinstance(use_qk_l2norm, bool):
        raise TypeError(f"use_qk_l2norm must be a bool, got {type(use_qk_l2norm).__name__}")


@functools.cache
def _fla_kernels():
    """FLA's (fused recurrent, chunked) gated delta rule functions, or None, with one warning, where it is missing."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as e:
        logger.warning("tqops.deltanet: flash-linear-attention is not installed (%s); gated_delta_rule runs its "
                       "torch reference on CUDA, one token at a time (pip install fla-core)", e)
        return None
    return fused_recurrent_gated_delta_rule, chunk_gated_delta_rule


def _gated_delta_rule_cuda(q, k, v, g, beta, state, query_start_loc, scale, use_qk_l2norm):
    n, batch = q.shape[0], state.shape[0]
    cu = _bounds(query_start_loc, n)  # a new tensor every call: FLA caches chunk indices by cu_seqlens' identity
    kernels = _fla_kernels()
    if kernels is None:
        return gated_delta_rule_naive(q, k, v, g, beta, state, cu, scale, use_qk_l2norm)
    if n == 0 or batch == 0:
        return v.new_zeros(v.shape), state.clone(memory_format=torch.contiguous_format)
    fused, chunk = kernels
    # Padding rows past cu[-1] belong to no sequence. FLA reads only rows [cu[b], cu[b + 1]) of each sequence, so the
    # fused kernel gets every row and the rows it never writes are zeroed below: no extra sequence, no host sync, so
    # it captures in a CUDA graph. The chunked kernel syncs the host for its chunk indices anyway (so it runs outside
    # graph regions only) and gets the covered rows alone.
    end, run = n, fused
    if not in_graph_region() and n > FUSED_RECURRENT_MAX_MEAN_TOKENS * batch:
        end = int(cu[-1])
        run = chunk if end > FUSED_RECURRENT_MAX_MEAN_TOKENS * batch else fused
    o, final = run(q[None, :end], k[None, :end], v[None, :end], g=g[None, :end], beta=beta[None, :end], scale=scale,
                   initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
                   cu_seqlens=cu)  # g and beta by name: the fused kernel's fifth argument is gk
    rows = torch.arange(n, device=q.device)
    covered = ((rows >= cu[0]) & (rows < cu[-1]))[:, None, None]
    return torch.where(covered, F.pad(o[0], (0, 0, 0, 0, 0, n - end)), 0).to(v.dtype), final.float()


@torch.library.custom_op("tqops::gated_delta_rule", mutates_args=())
def _gated_delta_rule_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, query_start_loc: torch.Tensor, scale: Optional[float],
                         use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    check_gated_delta_rule_args(q, k, v, g, beta, state, query_start_loc, scale, use_qk_l2norm)
    if q.is_cuda:
        return _gated_delta_rule_cuda(q, k, v, g, beta, state, query_start_loc, scale, use_qk_l2norm)
    return gated_delta_rule_naive(q, k, v, g, beta, state, _bounds(query_start_loc, q.shape[0]), scale,
                                  use_qk_l2norm)


@_gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, state, query_start_loc, scale, use_qk_l2norm):
    check_gated_delta_rule_args(q, k, v, g, beta, state, query_start_loc, scale, use_qk_l2norm)
    return v.new_empty(v.shape), state.new_empty(state.shape)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, query_start_loc: torch.Tensor, *, scale: Optional[float] = None,
                     use_qk_l2norm: bool = True):
    """The gated delta rule of Qwen3.5's linear-attention layers over packed sequences.

    q, k ``[num_tokens, Hk, dk]``, v ``[num_tokens, Hv, dv]`` (bf16/fp16/fp32, one dtype; Hv a multiple of Hk, key
    head j serving value heads ``[j * Hv / Hk, (j + 1) * Hv / Hk)``), g (log decay, normally <= 0) and beta
    ``[num_tokens, Hv]`` fp32, state ``[batch, Hv, dk, dv]`` fp32 (each sequence's initial state, not mutated),
    query_start_loc ``[batch + 1]`` int32/int64. Per value head and token, in fp32: q and k l2-normalized over dk
    (``use_qk_l2norm``), q scaled by ``scale`` (default dk ** -0.5); ``S = S * exp(g)``, ``S += outer(k, (v - k @ S)
    * beta)``, ``o = q @ S``. Returns (o ``[num_tokens, Hv, dv]`` in v's dtype, final state ``[batch, Hv, dk, dv]``
    fp32). A token with g = 0 and beta = 0 leaves the state exactly as it was (the rollback below relies on it).
    """
    check_gated_delta_rule_args(q, k, v, g, beta, state, query_start_loc, scale, use_qk_l2norm)
    check_query_start_loc_values(query_start_loc, q.shape[0])
    return torch.ops.tqops.gated_delta_rule(q, k, v, g, beta, state, query_start_loc,
                                            None if scale is None else float(scale), use_qk_l2norm)


# ---- causal_conv1d ---------------------------------------------------------------------------------------------------

def _check_conv_state(x, conv_state, query_start_loc, width=None) -> None:
    """x and conv_state ``[batch, C, W - 1]`` (W from the weight where given, else any W >= 2)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("conv_state", conv_state, dtypes=(x.dtype,), ndim=3)
    batch, c = conv_state.shape[0], x.shape[1]
    w1 = conv_state.shape[2] if width is None else width - 1
    if conv_state.shape[1] != c or conv_state.shape[2] != w1 or w1 < 1:
        raise ValueError(f"conv_state has shape {tuple(conv_state.shape)}; expected [batch, C, W - 1] = "
                         f"[{batch}, {c}, {w1 if w1 >= 1 else 'W - 1 >= 1'}]")
    _check_device("conv_state", conv_state, x.device, "x")
    _check_query_start_loc(query_start_loc, batch, x.device, "conv_state")


def check_causal_conv1d_args(x, weight, conv_state, query_start_loc, activation) -> None:
    """Shapes, dtypes, devices and the activation (no tensor values), so the op and its fake impl both run it."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("weight", weight, dtypes=tuple(dict.fromkeys((x.dtype, torch.float32))), ndim=2)
    if weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected [C, W] = [{x.shape[1]}, W] with W >= 2 "
                         "taps")
    _check_device("weight", weight, x.device, "x")
    _check_conv_state(x, conv_state, query_start_loc, weight.shape[1])
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _token_offsets(qsl: torch.Tensor, num_tokens):
    """Each row's sequence b (clamped into [0, batch); batch >= 1), its offset in b (>= 0), and whether b covers it."""
    rows = torch.arange(num_tokens, device=qsl.device)
    batch = qsl.shape[0] - 1
    seq = torch.searchsorted(qsl[1:], rows, right=True)  # how many sequences end at or before the row
    covered = (rows >= qsl[0]) & (seq < batch)
    seq = seq.clamp(max=batch - 1)
    return seq, (rows - qsl[seq]).clamp(min=0), covered


def _timeline(x: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """``cat(every conv state, x)`` ``[batch * (W - 1) + n, C]``, the rows that ``_rows`` addresses."""
    batch, c, w1 = conv_state.shape
    return torch.cat((conv_state.transpose(1, 2).reshape(batch * w1, c), x))


def _rows(step, seq, start, w1: int, batch: int):
    """The timeline row of step ``step`` of sequence ``seq`` (starting at token ``start``): steps 0 .. W - 2 are its
    conv state's inputs, step W - 1 + j its token j. Broadcasts."""
    return torch.where(step < w1, seq * w1 + step, batch * w1 + start + step - w1)


def _conv_state_at(timeline, qsl, ends, w1: int):
    """Each sequence's conv state ``[batch, C, W - 1]`` after its tokens ``[qsl[b], ends[b])``: its last W - 1 steps."""
    batch, starts = qsl.shape[0] - 1, qsl[:-1, None]
    steps = ends[:, None] - starts + torch.arange(w1, device=qsl.device)
    seqs = torch.arange(batch, device=qsl.device)[:, None]
    return timeline[_rows(steps, seqs, starts, w1, batch)].transpose(1, 2).contiguous()


def causal_conv1d_torch(x, weight, conv_state, query_start_loc, activation):
    """The op on every device: each token's W inputs gathered by index arithmetic from query_start_loc (no loop over
    tokens, no host sync), the taps summed in fp32, the output cast once."""
    n, c = x.shape
    batch, _, w1 = conv_state.shape
    if batch == 0:
        return x.new_zeros(n, c), conv_state.clone(memory_format=torch.contiguous_format)
    qsl = _bounds(query_start_loc, n)
    timeline = _timeline(x, conv_state)
    seq, offset, covered = _token_offsets(qsl, n)
    start, w = qsl[seq], weight.float()
    acc = torch.zeros(n, c, device=x.device)
    for tap in range(w1 + 1):  # tap i of token j reads step j + i of its sequence
        acc = acc + timeline[_rows(offset + tap, seq, start, w1, batch)].float() * w[:, tap]
    if activation == "silu":
        acc = F.silu(acc)
    return torch.where(covered[:, None], acc, 0).to(x.dtype), _conv_state_at(timeline, qsl, qsl[1:], w1)


@torch.library.custom_op("tqops::causal_conv1d", mutates_args=())
def _causal_conv1d_op(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                      activation: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    check_causal_conv1d_args(x, weight, conv_state, query_start_loc, activation)
    return causal_conv1d_rows(x, weight, conv_state, query_start_loc, activation=activation)


@_causal_conv1d_op.register_fake
def _(x, weight, conv_state, query_start_loc, activation):
    check_causal_conv1d_args(x, weight, conv_state, query_start_loc, activation)
    return x.new_empty(x.shape), conv_state.new_empty(conv_state.shape)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor, *,
                  activation: Optional[str] = "silu"):
    """Causal depthwise conv over packed sequences, continuing each from its conv state.

    x ``[num_tokens, C]`` (bf16/fp16/fp32), weight ``[C, W]`` (W >= 2 taps; x's dtype or fp32), conv_state
    ``[batch, C, W - 1]`` in x's dtype (the W - 1 inputs before each sequence; zeros for a new one; not mutated),
    query_start_loc ``[batch + 1]``. ``y_t = act(sum_i weight[:, i] * x_{t - W + 1 + i})`` in fp32, ``activation``
    "silu" or None. Returns (y ``[num_tokens, C]`` in x's dtype, the new conv state ``[batch, C, W - 1]``: the last
    W - 1 inputs of ``cat(conv_state[b], x of sequence b)``).
    """
    check_causal_conv1d_args(x, weight, conv_state, query_start_loc, activation)
    check_query_start_loc_values(query_start_loc, x.shape[0])
    return torch.ops.tqops.causal_conv1d(x, weight, conv_state, query_start_loc, activation)


@functools.cache
def _triton_module(name: str):
    """``tqops.deltanet.<name>`` (a Triton kernel module), or None where Triton is missing: the torch path runs."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None


def causal_conv1d_rows(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, query_start_loc: torch.Tensor,
                       *, state_indices: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None,
                       splits: Optional[tuple[int, int]] = None, activation: Optional[str] = "silu",
                       state_out: str = "new"):
    """``causal_conv1d`` for a layer's step, in one kernel on CUDA: sequence b starts from pool row
    ``state_indices[b]`` of ``conv_pool`` ``[R, C, W - 1]`` (negative: the spare last row; row b without indices),
    the new state is the one after its first ``keep[b]`` tokens (``conv_state_after``; all without ``keep``), and
    y comes split by channel at ``splits`` into contiguous parts. Returns (y or its parts, new state ``[batch, C,
    W - 1]``); with ``state_out="in_place"`` the new states are written over the sequences' pool rows instead and
    None comes back, with ``"none"`` they are not made. Called inside the ops (no checks of its own: theirs are
    done)."""
    n = x.shape[0]
    triton_conv = _triton_module("triton_conv") if x.is_cuda else None
    if triton_conv is not None:  # the kernel bounds query_start_loc itself
        return triton_conv.conv_varlen(x, weight, conv_pool, query_start_loc, state_indices=state_indices, keep=keep,
                                       splits=splits, silu=activation == "silu", state_out=state_out)
    qsl = _bounds(query_start_loc, n)
    state, rows = conv_pool, None
    if state_indices is not None:
        rows = torch.where(state_indices < 0, conv_pool.shape[0] - 1, state_indices).long()
        state = conv_pool[rows]
    y, new_state = causal_conv1d_torch(x, weight, state, qsl, activation)
    if keep is not None:
        new_state = conv_state_after(x, state, qsl, keep)
    if state_out == "in_place":
        conv_pool.index_copy_(0, rows, new_state.to(conv_pool.dtype))
    if state_out != "new":
        new_state = None
    if splits is None:
        return y, new_state
    s0, s1 = splits
    return (y[:, :s0].contiguous(), y[:, s0:s1].contiguous(), y[:, s1:].contiguous()), new_state


def gated_delta_rule_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                          A_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor, state_indices: torch.Tensor,
                          query_start_loc: torch.Tensor, *, keep: Optional[torch.Tensor] = None,
                          write_state: bool = True, output: bool = True) -> Optional[torch.Tensor]:
    """The delta rule of a Gated DeltaNet layer's step over states kept in ``pool`` ``[R, Hv, dk, dv]`` fp32:
    q, k ``[n, Hk, dk]``, v ``[n, Hv, dv]``, the raw gate projections a, b ``[n, Hv]`` (g = -exp(A_log) *
    softplus(a + dt_bias), beta = sigmoid(b), as transformers' Qwen3.5 computes them), sequence b from pool row
    ``state_indices[b]`` (negative: the spare last row) over its first ``keep[b]`` tokens (all without ``keep``),
    leaving its state in that row with ``write_state``. Returns o ``[n, Hv, dv]`` (0 past a kept prefix and on
    rows no sequence covers), or None without ``output``.

    On CUDA, decode- and verify-sized steps (and every step inside a graph region) run one Triton launch that reads
    and writes the pool rows in place with the gates fused; longer steps gather the rows and run FLA's chunked
    kernel; the CPU runs the torch reference. Called inside the layer op (no checks of its own)."""
    n, batch = q.shape[0], state_indices.shape[0]
    kernel = _triton_module("triton_recurrent") if q.is_cuda else None
    if kernel is not None and (in_graph_region() or n <= FUSED_RECURRENT_MAX_MEAN_TOKENS * max(batch, 1)):
        return kernel.recurrent_rows(q, k, v, a, b, A_log, dt_bias, pool, state_indices, query_start_loc, keep=keep,
                                     write_state=write_state, output=output)
    qsl = _bounds(query_start_loc, n)
    rows = torch.where(state_indices < 0, pool.shape[0] - 1, state_indices).long()
    beta = b.sigmoid().float()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    if keep is not None:
        kept = keep_mask(qsl, keep, n)[:, None]
        g, beta = g * kept, beta * kept
    o, final = torch.ops.tqops.gated_delta_rule(q, k, v, g, beta, pool[rows], qsl, None, True)
    if write_state:
        pool.index_copy_(0, rows, final)
    if not output:
        return None
    return o if keep is None else torch.where(kept[:, :, None], o, 0)


# ---- rollback after a verify pass ------------------------------------------------------------------------------------

def _check_keep(keep, query_start_loc) -> None:
    check_tensor("keep", keep, dtypes=INDEX_DTYPES, ndim=1)
    _check_device("keep", keep, query_start_loc.device, "query_start_loc")
    check_same_size(keep.shape[0] == query_start_loc.shape[0] - 1,
                    f"keep has {keep.shape[0]} entries; expected one per sequence ({query_start_loc.shape[0] - 1})")


def keep_mask(query_start_loc: torch.Tensor, keep: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[num_tokens]`` bool: token i of sequence b is kept iff its offset in b is below ``keep[b]`` ``[batch]``
    (int32/int64; the accepted tokens of a verify block). Pure torch, no host sync outside eager checks.

    The recurrent state after only the kept tokens is ``gated_delta_rule(q, k, v, g * m, beta * m, state,
    query_start_loc)[1]`` with ``m = keep_mask(...)[:, None]``: a masked token (g = beta = 0) is an identity.
    """
    check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, ndim=1)
    _check_keep(keep, query_start_loc)
    check_query_start_loc_values(query_start_loc, num_tokens)
    if query_start_loc.shape[0] == 1:
        return torch.zeros(num_tokens, dtype=torch.bool, device=keep.device)
    seq, offset, covered = _token_offsets(_bounds(query_start_loc, num_tokens), num_tokens)
    return covered & (offset < keep.long()[seq])


def conv_state_after(x: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                     keep: torch.Tensor) -> torch.Tensor:
    """The conv state ``[batch, C, W - 1]`` after only the first ``keep[b]`` tokens (clamped into [0, len]) of each
    sequence of the block ``x`` ``[num_tokens, C]`` that ``causal_conv1d`` ran from ``conv_state``. Pure torch."""
    _check_conv_state(x, conv_state, query_start_loc)
    _check_keep(keep, query_start_loc)
    check_query_start_loc_values(query_start_loc, x.shape[0])
    if conv_state.shape[0] == 0:
        return conv_state.clone(memory_format=torch.contiguous_format)
    qsl = _bounds(query_start_loc, x.shape[0])
    starts = qsl[:-1]
    ends = starts + torch.minimum(keep.long().clamp(min=0), qsl[1:] - starts)
    return _conv_state_at(_timeline(x, conv_state), qsl, ends, conv_state.shape[2])
