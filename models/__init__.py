"""Qwen3 target, DFlash drafter, checkpoint loading and the speculative decoding loop."""
from .dflash import DFlashDrafter
from .generate import GenerateResult, generate
from .proposers import OracleProposer
from .qwen3 import Qwen3Config, Qwen3ForCausalLM
from .sampling import rejection_sample

__all__ = ["DFlashDrafter", "GenerateResult", "OracleProposer", "Qwen3Config", "Qwen3ForCausalLM", "generate",
           "rejection_sample"]
