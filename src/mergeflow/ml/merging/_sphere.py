"""When two directions are (nearly) parallel or opposite for the spherical methods (SLERP, NuSLERP, Karcher,
Multi-SLERP): sin^2 = 1 - cos^2 at most a floor set by the compute dtype's precision.

At those angles the spherical formulas divide by sin(Omega) ~ 0: two opposite task vectors of unequal norm (0.01 and
-0.02) merged to 9.3e4 in float32, where the linear limit is 0.001, and float32 reaches sin(acos(-1)) = -8.7e-8, not 0.
A test on the angle, or on |sin| against a fixed 1e-8, misses that in one dtype or the other; 1 - cos^2 against a
floor of the dtype's own rounding (64 ulps of 1; never below 1e-8, |sin| = 1e-4, the old parallel cut) does not.
The methods then fall back to their linear limit, as mergekit's do (|cos| above 0.9995).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def sin2_floor(dtype: torch.dtype) -> float:
    """The largest sin^2 of an angle treated as 0 or pi in ``dtype`` (7.6e-6 in float32, 1e-8 in float64)."""
    import torch

    return max(1e-8, 64 * torch.finfo(dtype).eps)


def degenerate(cos: torch.Tensor) -> torch.Tensor:
    """Where the angle whose cosine is ``cos`` is (nearly) 0 or pi: 1 - cos^2 <= sin2_floor, in cos's dtype."""
    return 1 - cos * cos <= sin2_floor(cos.dtype)
