"""Lloyd-Max codebook of the standard Gaussian, computed deterministically (no scipy, no network)."""
from __future__ import annotations

import functools
import math

import torch


def _pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


@functools.lru_cache(maxsize=None)
def _lloyd_max_f64(bits: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    levels = 1 << bits
    # Start from uniform quantiles, then alternate centroid / midpoint updates until they settle.
    centroids = [-3.0 + 6.0 * (i + 0.5) / levels for i in range(levels)]
    for _ in range(10_000):
        bounds = [-math.inf] + [(a + b) / 2 for a, b in zip(centroids, centroids[1:])] + [math.inf]
        new = []
        for lo, hi in zip(bounds, bounds[1:]):
            mass = _cdf(hi) - _cdf(lo)
            new.append((_pdf(lo) - _pdf(hi)) / mass)
        delta = max(abs(a - b) for a, b in zip(new, centroids))
        centroids = new
        if delta < 1e-13:
            break
    bounds = [(a + b) / 2 for a, b in zip(centroids, centroids[1:])]
    return tuple(centroids), tuple(bounds)


def lloyd_max(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Centroids ``[2**bits]`` and decision boundaries ``[2**bits - 1]`` (float32) of N(0, 1).

    For a rotated unit vector in dimension d each coordinate is ~N(0, 1/d): quantize ``sqrt(d) * y``
    with these, i.e. the codebook of N(0, 1/d) is this one divided by sqrt(d).
    """
    if bits not in (1, 2, 3, 4):
        raise ValueError(f"bits must be 1..4, got {bits}")
    c, b = _lloyd_max_f64(bits)
    return torch.tensor(c, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)


def gaussian_distortion(bits: int) -> float:
    """Expected squared error of the codebook on N(0, 1): the per-coordinate MSE of a unit vector times d."""
    c, b = _lloyd_max_f64(bits)
    bounds = [-math.inf, *b, math.inf]
    # E[(x - c_i)^2 | bucket i] * P(bucket i) summed, in closed form for the Gaussian.
    total = 0.0
    for ci, lo, hi in zip(c, bounds, bounds[1:]):
        mass = _cdf(hi) - _cdf(lo)
        lo_pdf = 0.0 if math.isinf(lo) else lo * _pdf(lo)
        hi_pdf = 0.0 if math.isinf(hi) else hi * _pdf(hi)
        second = mass + lo_pdf - hi_pdf  # E[x^2 ; bucket]
        first = _pdf(lo) - _pdf(hi)  # E[x ; bucket]
        total += second - 2 * ci * first + ci * ci * mass
    return total
