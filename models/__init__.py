"""Qwen3 and Qwen3.5 (hybrid) targets, DFlash drafter, checkpoint loading and the speculative decoding loop."""
from .dflash import DFlashDrafter
from .generate import GenerateResult, generate
from .proposers import OracleProposer
from .qwen3 import Qwen3Config, Qwen3ForCausalLM
from .qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
from .sampling import rejection_sample

__all__ = ["DFlashDrafter", "GenerateResult", "OracleProposer", "Qwen3Config", "Qwen3ForCausalLM", "Qwen3_5Config",
           "Qwen3_5ForCausalLM", "generate", "rejection_sample"]
