"""Quantizers shared by the reference and the kernels: Lloyd-Max codebooks and the Hadamard rotation."""
from .codebook import lloyd_max
from .rotation import rotation_matrix, rotation_signs

__all__ = ["lloyd_max", "rotation_matrix", "rotation_signs"]
