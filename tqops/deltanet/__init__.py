"""Gated DeltaNet ops (Qwen3.5's linear attention): the gated delta rule, the causal conv, and their rollback."""
from .ops import (causal_conv1d, causal_conv1d_rows, conv_state_after, gated_delta_rule, gated_delta_rule_rows,
                  keep_mask)

__all__ = ["causal_conv1d", "causal_conv1d_rows", "conv_state_after", "gated_delta_rule", "gated_delta_rule_rows",
           "keep_mask"]
