"""Qwen3 and Qwen3.5 (hybrid) targets, DFlash and DFlash2 drafters, checkpoint loading and the speculative decoding
loop."""
from .dflash import DFlashDrafter
from .dflash2 import DFlash2Drafter, SelectedDrafts
from .generate import GenerateResult, generate
from .proposers import OracleProposer
from .qwen3 import Qwen3Config, Qwen3ForCausalLM
from .qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
from .sampling import rejection_sample

__all__ = ["DFlash2Drafter", "DFlashDrafter", "GenerateResult", "OracleProposer", "Qwen3Config", "Qwen3ForCausalLM",
           "Qwen3_5Config", "Qwen3_5ForCausalLM", "SelectedDrafts", "generate", "rejection_sample"]
