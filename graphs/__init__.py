"""Forward context, per-group metadata, the Attention and Gated DeltaNet state layers, DFlash injection, compile."""
from .compile import CompileReport, compile_model, mark_token_dim_dynamic
from .context import (FULL_ATTENTION_GROUP, KV_CACHE_GROUPS, SLIDING_WINDOW_GROUP, ForwardContext, get_forward_context,
                      set_forward_context)
from .injection import context_positions, context_states
from .layer import Attention
from .linear_attention import GatedDeltaNetState, run_block
from .metadata import AttentionMetadata, StateMetadata, build_metadata, slots_for_positions

__all__ = [
    "FULL_ATTENTION_GROUP", "KV_CACHE_GROUPS", "SLIDING_WINDOW_GROUP", "Attention", "AttentionMetadata",
    "CompileReport", "ForwardContext", "GatedDeltaNetState", "StateMetadata", "build_metadata",
    "compile_model", "context_positions", "context_states",
    "get_forward_context", "mark_token_dim_dynamic", "run_block", "set_forward_context", "slots_for_positions",
]
