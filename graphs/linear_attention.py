"""Gated DeltaNet state layer: per-row conv and recurrent states, and the stash that makes a verify block revocable."""
from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import nn

from tqops.checks import check_device, in_graph_region
from tqops.deltanet import causal_conv1d_rows, gated_delta_rule_rows

from .context import get_forward_context
from .metadata import StateMetadata


class GatedDeltaNetState(nn.Module):
    """The recurrent part of one Gated DeltaNet layer: ``forward(mixed_qkv, a, b, conv_weight, A_log, dt_bias)`` ->
    ``[n, Hv, dv]``.

    ``mixed_qkv`` ``[n, 2 * Hk * dk + Hv * dv]`` is ``in_proj_qkv``'s output (before the causal conv), ``a``/``b``
    ``[n, Hv]`` the gate projections, ``conv_weight`` ``[C, W]``, ``A_log``/``dt_bias`` ``[Hv]`` the layer's
    parameters (the model owns them, under transformers' names); the output is the delta rule's, before the gated
    norm. The layer owns its states
    as non-persistent buffers, kept in place when their geometry is unchanged (captured graphs point at them):
    ``conv_state [rows + 1, C, W - 1]`` in the model's dtype, ``recurrent_state [rows + 1, Hv, dk, dv]`` float32, and
    the stash of the last verify block's inputs ``[rows + 1, stash_len, C + 2 * Hv]``; row ``rows`` is the spare row of
    padded sequences. Speculative rollback replays the accepted prefix of the stashed block from the committed state
    with the rejected tokens masked to identities (g = 0, beta = 0), so no per-position state is ever kept.
    """

    def __init__(self, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int, *,
                 name: str):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"layer {name!r}: linear_num_value_heads={num_v_heads} must be a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        self.name = name
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = (num_k_heads, num_v_heads, head_k_dim,
                                                                                head_v_dim)
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        for name_ in ("conv_state", "recurrent_state", "stash"):
            self.register_buffer(name_, torch.zeros(0), persistent=False)

    @property
    def rows(self) -> int:
        """Real rows of the state pools (0 before ``allocate_state``)."""
        return max(self.recurrent_state.shape[0] - 1, 0) if self.recurrent_state.dim() == 4 else 0

    @property
    def stash_len(self) -> int:
        return self.stash.shape[1] if self.stash.dim() == 3 else 0

    def allocate_state(self, rows: int, stash_len: int, device=None, dtype: Optional[torch.dtype] = None) -> None:
        """State pools for ``rows`` sequences and a stash of ``stash_len`` tokens (the verify block), zeroed; pools of
        the same geometry are kept in place and zeroed."""
        for arg, val in (("rows", rows), ("stash_len", stash_len)):
            if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
                raise ValueError(f"layer {self.name!r}: {arg} must be an int >= 1, got {val!r}")
        device = check_device(f"layer {self.name!r}: device", device) if device is not None else \
            self.recurrent_state.device
        dtype = dtype or torch.get_default_dtype()
        shapes = {"conv_state": ((rows + 1, self.conv_dim, self.conv_kernel - 1), dtype),
                  "recurrent_state": ((rows + 1, self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
                  "stash": ((rows + 1, stash_len, self.conv_dim + 2 * self.num_v_heads), dtype)}
        for name, (shape, dt) in shapes.items():
            buf = getattr(self, name)
            if tuple(buf.shape) != shape or buf.dtype != dt or buf.device != device:
                setattr(self, name, torch.zeros(shape, dtype=dt, device=device))
        self.reset_state()

    def reset_state(self) -> None:
        """Every row back to a fresh sequence's state (zeros); nothing pending."""
        self.conv_state.zero_()
        self.recurrent_state.zero_()

    def forward(self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        if self.recurrent_state.dim() != 4:
            raise RuntimeError(f"layer {self.name!r} has no state yet: call allocate_state(rows, stash_len)")
        width = self.conv_dim
        if mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != width:
            raise ValueError(f"layer {self.name!r}: mixed_qkv has shape {tuple(mixed_qkv.shape)}; expected "
                             f"[num_tokens, {width}]")
        for arg, t in (("a", a), ("b", b)):
            if t.dim() != 2 or t.shape[1] != self.num_v_heads:
                raise ValueError(f"layer {self.name!r}: {arg} has shape {tuple(t.shape)}; expected "
                                 f"[num_tokens, {self.num_v_heads}]")
        return torch.ops.tqops.layer_gated_delta_net(
            mixed_qkv, a, b, conv_weight, A_log, dt_bias, self.conv_state, self.recurrent_state,
            self.stash, self.name, self.num_k_heads, self.head_k_dim)

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, heads={self.num_k_heads}/{self.num_v_heads}, dims={self.head_k_dim}/"
                f"{self.head_v_dim}, conv_kernel={self.conv_kernel}")


def _state_metadata(layer_name: str) -> StateMetadata:
    meta = get_forward_context().state_metadata
    if meta is None:
        raise KeyError(f"linear-attention layer {layer_name!r} needs the forward context's state_metadata "
                       "(ForwardContext(..., state_metadata=StateMetadata(state_indices, query_start_loc)))")
    return meta


def _check_state_metadata(meta: StateMetadata, num_tokens: int, rows: int, stash_len: int, where: str) -> None:
    """Value checks of a step's state metadata (eager only: they read values on the host), before any write."""
    idx, qsl = meta.state_indices, meta.query_start_loc
    batch = idx.shape[0]
    if idx.dim() != 1 or qsl.shape != (batch + 1,):
        raise ValueError(f"{where}: state_indices has shape {tuple(idx.shape)} and query_start_loc "
                         f"{tuple(qsl.shape)}; expected [batch] and [batch + 1]")
    if meta.stash and num_tokens != batch * stash_len:
        raise ValueError(f"{where}: a stashed (verify) step needs {stash_len} tokens per sequence (the stash length "
                         f"of allocate_state), got {num_tokens} tokens for {batch} sequences")
    if in_graph_region():
        return
    if bool((idx >= rows).any()):
        raise IndexError(f"{where}: state_indices {idx.tolist()} reach past the {rows} rows of the state pools")
    real = idx[idx >= 0]
    if real.unique().numel() != real.numel():
        raise ValueError(f"{where}: state_indices {idx.tolist()} name one row twice; each sequence owns its row")
    if meta.pending_lens is not None:
        p = meta.pending_lens
        if p.shape != (batch,) or bool(((p < 0) | (p > stash_len)).any()):
            raise ValueError(f"{where}: pending_lens {p.tolist()} must be [batch] counts in [0, {stash_len}]")


def run_block(mixed, a, b, conv_weight, A_log, dt_bias, conv_pool, recurrent_pool, state_indices, qsl,
              num_k_heads: int, head_k_dim: int, *, keep=None, write_states: bool = True, output: bool = True):
    """The conv and the delta rule over packed sequences (``mixed`` ``[n, C]``, the gate projections ``a``, ``b``
    ``[n, Hv]``, sequences at ``qsl``) from pool rows ``state_indices`` ``[batch]``, each over its first ``keep[b]``
    tokens (all without ``keep``). With ``write_states`` both pools' rows end as the states after those tokens, in
    place; without, they stay as they were (a verify block). Returns o ``[n, Hv, dv]``, or None without ``output``."""
    key_dim = num_k_heads * head_k_dim
    (q, k, v), _ = causal_conv1d_rows(mixed, conv_weight, conv_pool, qsl, state_indices=state_indices, keep=keep,
                                      splits=(key_dim, 2 * key_dim), state_out="in_place" if write_states else "none")
    heads = (num_k_heads, head_k_dim)
    return gated_delta_rule_rows(q.unflatten(-1, heads), k.unflatten(-1, heads), v.unflatten(-1, (a.shape[1], -1)),
                                 a, b, A_log, dt_bias, recurrent_pool, state_indices, qsl, keep=keep,
                                 write_state=write_states, output=output)


@torch.library.custom_op("tqops::layer_gated_delta_net", mutates_args=("conv_state", "recurrent_state", "stash"))
def layer_gated_delta_net(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    stash: torch.Tensor,
    layer_name: str,
    num_k_heads: int,
    head_k_dim: int,
) -> torch.Tensor:
    """One Gated DeltaNet step over the forward context's sequences -> ``[n, Hv, dv]`` (see ``GatedDeltaNetState``).

    Commits the pending accepted tokens of the previous verify block first, then runs this step's tokens; a stashed
    step leaves the committed states as they are and keeps its inputs in ``stash``, any other step writes its
    sequences' states after its tokens. Every state is read from and written to its pool row in place (on CUDA a
    decode step is two launches: the conv and the delta rule)."""
    meta = _state_metadata(layer_name)
    rows = recurrent_state.shape[0] - 1
    stash_len = stash.shape[1]
    _check_state_metadata(meta, mixed_qkv.shape[0], rows, stash_len, f"layer {layer_name!r}")
    idx = meta.state_indices
    batch, width = idx.shape[0], mixed_qkv.shape[1]
    hv = a.shape[1]
    pool_rows = torch.where(idx < 0, rows, idx).long() if meta.stash or meta.pending_lens is not None else None
    if meta.pending_lens is not None:  # the committed states move on by the accepted prefix of the stashed block
        p_mixed, p_a, p_b = stash[pool_rows].flatten(0, 1).split([width, hv, hv], dim=-1)
        p_qsl = torch.arange(batch + 1, device=idx.device, dtype=torch.int32) * stash_len
        run_block(p_mixed, p_a, p_b, conv_weight, A_log, dt_bias, conv_state, recurrent_state, idx, p_qsl,
                  num_k_heads, head_k_dim, keep=meta.pending_lens, output=False)
    o = run_block(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, recurrent_state, idx,
                  meta.query_start_loc, num_k_heads, head_k_dim, write_states=not meta.stash)
    if meta.stash:  # the committed states stay; this block waits in the stash
        block = torch.cat([mixed_qkv, a.to(mixed_qkv.dtype), b.to(mixed_qkv.dtype)], dim=-1)
        stash.index_copy_(0, pool_rows, block.view(batch, stash_len, -1).to(stash.dtype))
    return o


@layer_gated_delta_net.register_fake
def _(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, recurrent_state, stash, layer_name, num_k_heads,
      head_k_dim):
    return mixed_qkv.new_empty(mixed_qkv.shape[0], a.shape[1], recurrent_state.shape[-1])
