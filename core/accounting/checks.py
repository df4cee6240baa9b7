"""Argument checks shared by the accounting functions.

Every public accounting function validates its inputs up front so that a bad request fails
with a ``ValueError`` naming the argument, before any number is computed or charged.
"""

from __future__ import annotations

import math
from numbers import Integral, Real


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    return value


def sample_rate(value: object) -> float:
    q = _real("sample_rate", value)
    if not 0 < q <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {q}")
    return q


def positive(name: str, value: object) -> float:
    x = _real(name, value)
    if not 0 < x < math.inf:
        raise ValueError(f"{name} must be positive and finite, got {x}")
    return x


def probability(name: str, value: object) -> float:
    """A value in the open interval (0, 1), e.g. δ."""
    p = _real(name, value)
    if not 0 < p < 1:
        raise ValueError(f"{name} must be in (0, 1), got {p}")
    return p


def at_least(name: str, value: object, lower: float) -> float:
    x = _real(name, value)
    if not lower <= x < math.inf:
        raise ValueError(f"{name} must be a finite number >= {lower}, got {x}")
    return x


def count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)
