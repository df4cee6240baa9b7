"""Clipping-threshold rules: fixed, DC-SGD-P / DC-SGD-E (paper 001) and its baselines.

Every rule exposes the threshold C_t used to clip step t and ``update`` which, after step t,
sets C_{t+1} from that step's per-example gradient norms (paper 001 §III-A: the new threshold
is applied from the next step, so the step's gradients and its histogram are released
together, which is what Theorem 2 assumes). A rule that looks at the norms releases a noisy
statistic each step; its noise multiplier ``release_noise`` is split from the total σ with
σ_T = (σ⁻² − release_noise⁻²)^(−1/2) (paper 001, Theorem 2, eq. 5), so the trial costs exactly
DP-SGD with σ. Everything after the noisy release is post-processing. Under group-wise
clipping a rule sees each example's whole-gradient norm and sets the total threshold C_t; each
of the M groups is then clipped at C_t/√M.

Every C_t a rule sets is clamped into ``core.config.THRESHOLD`` (and a histogram's range into
``RANGE``), post-processing too: left alone, DC-SGD-P's noisy percentile can shrink C by up
to b× a step, step after step, at a small B, and Andrew et al.'s and Du et al.'s geometric
updates have no floor, while the engine needs C_t/B where float32 holds the noisy sum's scale
(docs/design.md, invariant 12).

The norms arrive on the model's device. A rule that looks at them takes one thing to the host
a step, after the optimizer step (``workers.dp.engine.PrivateStep.step``): the norms for a
histogram, the count of unclipped examples for Andrew et al.'s rule; float64 arithmetic happens
there, on the host, never on the device. A fixed or data-independent rule takes nothing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from core.config import THRESHOLD, MethodConfig
from workers.dp.randomness import SecureStream

#: Safeguard on Algorithm 4's "repeat while the minimiser is a boundary candidate" loop (the
#: paper states no bound); see :func:`error_threshold` for the other stopping rule.
MAX_SEARCH_ROUNDS = 64
#: a histogram's range R: DC-SGD-P's is 2·C_t
RANGE = (THRESHOLD[0], 2 * THRESHOLD[1])


def clamp(value: float, bounds: tuple[float, float]) -> float:
    """``value`` in [low, high] (NaN: low)."""
    low, high = bounds
    return low if not value >= low else min(value, high)


class ThresholdRule:
    """A fixed threshold C (plain DP-SGD)."""

    release_noise: float | None = None

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def update(self, norms: Tensor, step: int) -> None:
        """See the module docstring; ``norms`` are the logical batch's per-example norms."""


def noisy_histogram(
    norms: Tensor, range_: float, bins: int, noise: float, stream: SecureStream
) -> Tensor:
    """Paper 001, Algorithm 2: counts over ``bins`` equal bins of [0, range_], norms beyond the
    range in the last bin, plus N(0, noise²) per bin (sensitivity 1: one example, one count).
    Non-finite norms (a diverged model) count as beyond the range."""
    finite = norms.detach().cpu().double().nan_to_num(nan=math.inf)
    index = (finite * bins / range_).floor().clamp(max=bins - 1).long()
    counts = torch.bincount(index, minlength=bins).double()
    return counts + noise * stream.normal(bins, dtype=torch.float64)


def bin_midpoints(range_: float, bins: int) -> Tensor:
    return (torch.arange(bins, dtype=torch.float64) + 0.5) * (range_ / bins)


def percentile_threshold(hist: Tensor, range_: float, percentile: float) -> float:
    """Paper 001, Algorithm 3 lines 1–7: the midpoint of the first bin at which the running
    count reaches p·S′ (S′ the noisy total); the last bin's midpoint if none does."""
    reached = (hist.cumsum(0) >= percentile * hist.sum()).nonzero()
    k = int(reached[0]) if len(reached) else len(hist) - 1
    return float(bin_midpoints(range_, len(hist))[k])


def expected_squared_error(
    candidates: Tensor, hist: Tensor, range_: float, variance_coef: float
) -> Tensor:
    """Paper 001, eq. 4 with norms estimated by bin midpoints:
    E(C) = σ_T²C²d/B² + (1/S′) Σ_k H̃[k]·max(mid_k − C, 0)², with ``variance_coef`` = σ_T²d/B²."""
    mids = bin_midpoints(range_, len(hist))
    bias = (hist * (mids[None, :] - candidates[:, None]).clamp(min=0).pow(2)).sum(1) / hist.sum()
    return variance_coef * candidates.pow(2) + bias


def error_threshold(hist: Tensor, range_: float, threshold: float, variance_coef: float) -> float:
    """Paper 001, Algorithm 4 lines 2–14: minimise eq. 4 over {0.1C, 0.2C, …, 2C}; while the
    minimiser is 0.1C or 2C, recentre on it and search again.

    We also stop once the centre falls below the first bin's midpoint, which the histogram
    cannot resolve: with negative noisy counts eq. 4 can increase from C = 0 and the literal
    search would shrink C tenfold per round without end. (Upwards it always ends: beyond the
    last midpoint the bias term is 0 and eq. 4 increases.) With non-negative counts this
    changes the result by less than the histogram's resolution."""
    c, lowest = threshold, range_ / (2 * len(hist))
    for _ in range(MAX_SEARCH_ROUNDS):
        candidates = c * torch.arange(1, 21, dtype=torch.float64) / 10
        best = int(expected_squared_error(candidates, hist, range_, variance_coef).argmin())
        c = float(candidates[best])
        if 0 < best < len(candidates) - 1 or c < lowest:
            break
    return c


def cautious_range(hist: Tensor, range_: float) -> float:
    """Paper 001, Algorithm 4 lines 15–20: double R when the overflow bin holds half the noisy
    count, halve it when the right half of the bins holds at most S′/b."""
    total, bins = float(hist.sum()), len(hist)
    if hist[-1] >= 0.5 * total:
        return 2 * range_
    if hist[bins // 2 :].sum() <= total / bins:
        return range_ / 2
    return range_


class PercentileRule(ThresholdRule):
    """DC-SGD-P (paper 001, Algorithms 1–3): C_{t+1} = noisy p-th percentile, R_{t+1} = 2C_{t+1}."""

    def __init__(
        self,
        threshold: float,
        *,
        percentile: float,
        bins: int,
        histogram_noise: float,
        initial_range: float,
        stream: SecureStream,
    ) -> None:
        super().__init__(threshold)
        self.percentile, self.bins, self.range = percentile, bins, initial_range
        self.release_noise, self.stream = histogram_noise, stream

    def update(self, norms: Tensor, step: int) -> None:
        hist = noisy_histogram(norms, self.range, self.bins, self.release_noise, self.stream)
        self.threshold = clamp(percentile_threshold(hist, self.range, self.percentile), THRESHOLD)
        self.range = 2 * self.threshold


class ErrorRule(ThresholdRule):
    """DC-SGD-E (paper 001, Algorithms 1, 2, 4): C_{t+1} minimises the estimated expected squared
    error of eq. 4; the histogram range follows the "cautious" update."""

    def __init__(
        self,
        threshold: float,
        *,
        bins: int,
        histogram_noise: float,
        initial_range: float,
        variance_coef: float,
        stream: SecureStream,
    ) -> None:
        super().__init__(threshold)
        self.bins, self.range, self.variance_coef = bins, initial_range, variance_coef
        self.release_noise, self.stream = histogram_noise, stream

    def update(self, norms: Tensor, step: int) -> None:
        hist = noisy_histogram(norms, self.range, self.bins, self.release_noise, self.stream)
        if hist.sum() <= 0:  # the noisy count carries no usable information; keep C and R
            return
        found = error_threshold(hist, self.range, self.threshold, self.variance_coef)
        self.threshold = clamp(found, THRESHOLD)
        self.range = clamp(cautious_range(hist, self.range), RANGE)


class QuantileRule(ThresholdRule):
    """Andrew et al. (NeurIPS 2021), the baseline of paper 001: geometric update
    C ← C·exp(−η_C(b̄ − p)) towards the p-quantile, b̄ the noisy fraction of unclipped examples.

    The released count is Σ_i (1[‖g_i‖ ≤ C] − ½) + N(0, σ_b²): centring makes its sensitivity
    ½, i.e. noise multiplier 2σ_b (their Theorem 1); b̄ = that/B + ½ with the public expected
    batch size B, since the realized Poisson batch size is itself private.
    """

    def __init__(
        self,
        threshold: float,
        *,
        target: float,
        learning_rate: float,
        count_noise: float,
        expected_batch_size: int,
        stream: SecureStream,
    ) -> None:
        super().__init__(threshold)
        self.target, self.learning_rate, self.count_noise = target, learning_rate, count_noise
        self.expected_batch_size, self.stream = expected_batch_size, stream
        self.release_noise = 2 * count_noise

    def update(self, norms: Tensor, step: int) -> None:
        centred = int((norms <= self.threshold).sum()) - 0.5 * norms.numel()
        noisy = centred + self.count_noise * float(self.stream.normal(1, dtype=torch.float64))
        unclipped = noisy / self.expected_batch_size + 0.5
        # an exponent beyond ±ln(high/low) lands on a bound anyway; limited, exp cannot overflow
        span = math.log(THRESHOLD[1] / THRESHOLD[0])
        exponent = clamp(-self.learning_rate * (unclipped - self.target), (-span, span))
        self.threshold = clamp(self.threshold * math.exp(exponent), THRESHOLD)


class DecayRule(ThresholdRule):
    """Du et al. (2021), the baseline of paper 001: C_t = C₀·ρ_C^(t/T), data-independent."""

    def __init__(self, threshold: float, *, decay: float, total_steps: int) -> None:
        super().__init__(threshold)
        self.initial, self.decay, self.total_steps = threshold, decay, total_steps

    def update(self, norms: Tensor, step: int) -> None:
        self.threshold = clamp(
            self.initial * self.decay ** ((step + 1) / self.total_steps), THRESHOLD
        )


def build_rule(
    method: MethodConfig,
    *,
    expected_batch_size: int,
    steps: int,
    grad_noise: float,
    num_params: int,
    stream: SecureStream,
) -> ThresholdRule:
    """The rule of ``method.adaptive`` (paper defaults: C₀ = ``method.threshold`` = 1, σ_H = 5,
    b = 20, R₀ = 1 for DC-SGD-P and R₀ = b for DC-SGD-E, σ_b = B/20 for Andrew et al.)."""
    a, c0 = method.adaptive, method.threshold
    if a is None:
        return ThresholdRule(c0)
    if a.rule == "dcsgd_p":
        return PercentileRule(
            c0,
            percentile=a.percentile,
            bins=a.bins,
            histogram_noise=a.histogram_noise,
            initial_range=a.initial_range or 1.0,
            stream=stream,
        )
    if a.rule == "dcsgd_e":
        return ErrorRule(
            c0,
            bins=a.bins,
            histogram_noise=a.histogram_noise,
            initial_range=a.initial_range or float(a.bins),
            variance_coef=grad_noise**2 * num_params / expected_batch_size**2,
            stream=stream,
        )
    if a.rule == "andrew":
        return QuantileRule(
            c0,
            target=a.percentile,
            learning_rate=a.learning_rate,
            count_noise=a.count_noise or expected_batch_size / 20,
            expected_batch_size=expected_batch_size,
            stream=stream,
        )
    return DecayRule(c0, decay=a.decay, total_steps=steps)
