"""How an adaptive clipping rule shares the noise multiplier σ with the gradient.

A rule that looks at the per-example norms releases a noisy statistic every step; paying for it
out of σ as σ_T = (σ⁻² − σ_release⁻²)^(−1/2) (paper 001, Theorem 2, eq. 5) keeps the trial's
cost at DP-SGD's with σ. The planner shows σ_T; the engine adds it to the gradient.
"""

from __future__ import annotations

from core.accounting import split_noise
from core.config import NOISE, MethodConfig


def release_noise(method: MethodConfig, expected_batch_size: int) -> float | None:
    """Noise multiplier of the rule's per-step release (None: nothing released)."""
    adaptive = method.adaptive
    if adaptive is None or adaptive.rule == "du":
        return None
    if adaptive.rule == "andrew":
        return 2 * (adaptive.count_noise or expected_batch_size / 20)
    return adaptive.histogram_noise


def gradient_noise(method: MethodConfig, expected_batch_size: int, sigma: float) -> float:
    """σ_T left for the gradient once the rule's release takes its share of σ (paper 001,
    Theorem 2), at most ``NOISE``'s ceiling; errors name the config field that sets the
    release's noise."""
    release = release_noise(method, expected_batch_size)
    if release is None:
        return sigma
    field = (
        "method.adaptive.count_noise"
        if method.adaptive.rule == "andrew"  # type: ignore[union-attr]
        else "method.adaptive.histogram_noise"
    )
    try:
        grad = split_noise(sigma, release)
    except ValueError as err:
        raise ValueError(f"{field}: {err}") from err
    if grad > NOISE[1]:  # a release noise just above σ leaves σ_T unbounded (invariant 12)
        raise ValueError(
            f"{field}: {release:g} is so close to the noise multiplier {sigma:.4g} that the "
            f"gradient's σ_T = {grad:.4g} exceeds {NOISE[1]:g}"
        )
    return grad
