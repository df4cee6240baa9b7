"""Invariant 12 (docs/design.md): sane numbers; issue 39, findings 1 and 12.

The attack: with ``method.threshold`` = 64·1.15e-45 and B = 64 the engine drew its noise at
std σ·C/B, which rounds to 0 in float32, while a planted record's clipped contribution still
rounded to a subnormal, and Adam (β₁ = 0, eps = 1e-45) turned it into a full step. Now the
configuration refuses such numbers, the engine forms g̃ = (C/B)·(Σᵢ c̃ᵢgᵢ + σ_T·z) with
‖c̃ᵢgᵢ‖ ≤ 1 (noise at std σ_T whatever C; one scaling after the noise), and adaptive rules
clamp every C_t into the threshold range.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from torch import Tensor, nn

from core.accounting import calibrate_noise
from core.accounting.calibration import SIGMA_MAX, SIGMA_MIN
from core.config import (
    ADAM_EPS,
    AUTO_S_GAMMA,
    FLOAT32_MAX,
    FLOAT32_TINY,
    GAMMA_PRIME,
    LEARNING_RATE,
    MAX_BATCH,
    NOISE,
    NOISE_FLOOR,
    THRESHOLD,
    THRESHOLD_RATE,
    WEIGHT_DECAY,
    AdaptiveConfig,
    MethodConfig,
    ModelConfig,
    OptimizerConfig,
    TrialConfig,
    ValidationConfig,
)
from workers.dp import PrivateStep, get_clipper, per_sample_grads, resolve_groups
from workers.dp.adaptive import ThresholdRule, build_rule
from workers.dp.optim import SGD
from workers.dp.randomness import SecureStream
from workers.models import build_model

LOSS = nn.CrossEntropyLoss(reduction="none")
#: the attack's threshold: σ·C/B = 1.15e-45 at B = 64, σ = 1
ATTACK_THRESHOLD = 64 * 1.15e-45


class Recording(SecureStream):
    """Test double: a secure stream that keeps each Gaussian draw and the std it was asked
    for (the noise as it went into the gradient buffer, before any scaling)."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[tuple[float, Tensor]] = []

    def normal(self, shape: Any, **kwargs: Any) -> Tensor:
        out = super().normal(shape, **kwargs)
        self.draws.append((kwargs.get("scale", 1.0), out.detach().clone()))
        return out


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(name="mlp", options={"hidden": 64}), (6,), 3)


def batch(n: int = 6, seed: int = 1) -> tuple[Tensor, Tensor]:
    """``n`` examples; the first is a planted record with large features (its gradient is
    clipped at any admitted threshold below its norm)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    x[0] *= 1e3
    return x, y


def engine(
    model: nn.Module,
    threshold: float,
    expected: int,
    sigma: float,
    stream: SecureStream,
    *,
    clipper: str = "general",
    style: str = "layer_wise",
) -> PrivateStep:
    return PrivateStep(
        model,
        LOSS,
        resolve_groups(model, style),
        get_clipper(clipper),  # type: ignore[arg-type]
        clipping="abadi",
        gamma=0.01,
        rule=ThresholdRule(threshold),
        grad_noise=sigma,
        expected_batch_size=expected,
        optimizer=SGD(model.parameters(), lr=0.0),
        noise=stream,
    )


def gradient(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# --- (a) the attack --------------------------------------------------------------------------


def test_the_attacks_threshold_is_refused():
    for build in (
        lambda: MethodConfig(threshold=ATTACK_THRESHOLD),
        lambda: OptimizerConfig(name="adam", betas=(0.0, 0.999), eps=1e-45),
        lambda: OptimizerConfig(lr=3.5e38),  # overflows float32: every trial failed
    ):
        with pytest.raises(ValidationError):
            build()


def planted_record() -> tuple[Tensor, Tensor]:
    """A record whose clipped gradient is ±1 in two coordinates of a zeroed Linear(64, 2)."""
    x = torch.zeros(1, 64)
    x[0, 0] = 2.0
    return x, torch.tensor([0])


def test_a_tiny_threshold_leaves_no_contribution_without_its_noise():
    """Below the admitted range (the engine itself is not the check): at C = 64·1.2e-45,
    B = 64, σ = ½, the old engine drew its noise at std σ·C/B = 6e-46, which rounds to 0 in
    float32, so every noise value was exactly 0 while the planted record's contribution was
    ±1.4e-45: without the record g̃ was exactly 0, with it two coordinates were not. Now the
    noise is drawn at σ_T, a normal float32 Gaussian under every contribution, and the scale
    applies to the noisy sum: without the record g̃ = fl(C/B·σz) is nonzero wherever |z| > 1."""
    threshold, expected, sigma = 64 * 1.2e-45, 64, 0.5
    grads, draws = {}, {}
    for planted in (False, True):
        model, stream = nn.Linear(64, 2), Recording()
        nn.init.zeros_(model.weight)
        nn.init.zeros_(model.bias)
        step = engine(model, threshold, expected, sigma, stream, style="all_layer")
        step.private_gradient([planted_record()] if planted else [])
        grads[planted], [draws[planted]] = gradient(model), stream.draws
    assert bool(grads[True].isfinite().all())
    assert float((grads[False] != 0).double().mean()) > 0.1  # P[|z| > 1] = 0.32; it was 0
    for scale, noise in draws.values():
        assert scale == sigma
        assert bool((noise.abs() >= FLOAT32_TINY).all())  # under every contribution
        assert float(noise.std()) == pytest.approx(sigma, rel=0.35)


def reference(
    model: nn.Module, x: Tensor, y: Tensor, groups: list[list[str]], threshold: float
) -> dict[str, Tensor]:
    """Σᵢ c̃ᵢgᵢ in float64, clipped by hand: c̃ = min(1, (C/√M)/‖gᵢ‖_m)/C per group."""
    grads = {n: g.double() for n, g in per_sample_grads(model, LOSS, x, y).items()}
    r = threshold / math.sqrt(len(groups))
    sums = {}
    for group in groups:
        norms = torch.stack([grads[n].flatten(1).pow(2).sum(1) for n in group]).sum(0).sqrt()
        factor = (r / norms).clamp(max=1.0) / threshold
        for n in group:
            sums[n] = (factor.view(-1, *[1] * (grads[n].dim() - 1)) * grads[n]).sum(0)
    return sums


EXTREMES = [  # (C, B, σ_T): the smallest noise in g̃, the largest, and an ordinary one
    (THRESHOLD[0], MAX_BATCH, NOISE[0]),
    (THRESHOLD[1], 1, NOISE[1]),
    (1.0, 64, 1.3),
]


@pytest.mark.parametrize(("threshold", "expected", "sigma"), EXTREMES)
@pytest.mark.parametrize("clipper", ["general", "fast"])
@pytest.mark.parametrize("style", ["all_layer", "layer_wise"])
def test_noise_is_sigma_t_and_the_gradient_is_the_scaled_noisy_sum(
    threshold, expected, sigma, clipper, style
):
    """The noise goes into the buffer at std σ_T, every value a normal float32 number, and
    g̃ = (C/B)·(S + σ_T·z), S = Σᵢ c̃ᵢgᵢ computed independently in float64."""
    model, stream = mlp(), Recording()
    step = engine(model, threshold, expected, sigma, stream, clipper=clipper, style=style)
    x, y = batch()
    step.private_gradient([(x[:4], y[:4]), (x[4:], y[4:])])
    [(scale, noise)] = stream.draws
    assert scale == sigma
    assert bool((noise.abs() >= FLOAT32_TINY).all())
    assert float(noise.std()) == pytest.approx(sigma, rel=0.15)
    sums = reference(model, x, y, step.groups, threshold)
    summed = torch.cat([sums[n].flatten() for n in step.params])
    want = (summed + noise.double()) * (threshold / expected)
    got = gradient(model).double()
    tolerance = 1e-5 * threshold / expected * max(1.0, sigma)
    # the clipper's factors come from float32 norm bounds, up to 1.2e-4 above the exact norms
    # (``workers.dp.bounds``): an error relative to the clipped sum, not to g̃, in which the
    # noise may cancel the sum
    allowed = 2e-4 * (summed.abs() * (threshold / expected) + want.abs()) + tolerance
    worst = ((got - want).abs() - allowed).max()
    assert float(worst) <= 0, float(worst)
    assert bool((got.abs() >= FLOAT32_TINY).all()) and bool(got.isfinite().all())


# --- (b) properties over the admitted ranges -------------------------------------------------


def test_the_ranges_keep_noise_and_contributions_normal_float32():
    """Contributions have norm ≤ 1 and the noise std σ_T ∈ NOISE before the scale; after it,
    σ_T·C/B lies far inside float32's normal range for every admitted (σ_T, C, B), with room
    for ten standard deviations and a batch of contributions."""
    smallest = NOISE[0] * THRESHOLD[0] / MAX_BATCH
    largest = NOISE[1] * THRESHOLD[1] / 1
    assert NOISE[0] > FLOAT32_TINY * 1e20 and smallest > FLOAT32_TINY * 1e20
    assert 10 * (largest + MAX_BATCH * THRESHOLD[1]) < FLOAT32_MAX / 1e20
    assert LEARNING_RATE[1] * 10 * largest < FLOAT32_MAX / 1e10


def test_the_largest_target_epsilon_plans_noise_above_the_floor():
    """ε = 100 (the spec's largest) at q = 1, one step and δ near 1 still needs σ ≈ 0.07:
    the planner never plans below NOISE's floor, which is calibration's own."""
    assert NOISE[0] <= SIGMA_MIN and NOISE[1] >= SIGMA_MAX
    for delta in (1e-5, 0.5, 0.99):
        assert calibrate_noise(1.0, 1, 100.0, delta) > 5 * NOISE[0]


def logs(bounds: tuple[float, float]) -> st.SearchStrategy[float]:
    """Floats in [low, high], spread over the orders of magnitude, ends included."""
    low, high = bounds
    if low == 0:
        return st.sampled_from([0.0, high]) | st.floats(1e-300, high)
    spread = st.floats(math.log(low), math.log(high)).map(math.exp)
    return st.sampled_from([low, high]) | spread.filter(lambda v: low <= v <= high)


def outside(bounds: tuple[float, float]) -> st.SearchStrategy[float]:
    low, high = bounds
    below = st.floats(max_value=low, exclude_max=True)
    above = st.floats(min_value=high, exclude_min=True)
    return below | above | st.sampled_from([math.nan, low / 2 if low else -1e-300, high * 2])


ADAPTIVE = {"rule": "dcsgd_p"}
#: (model, fixed fields, bounded field, range); ranges are closed
BOUNDED: list[tuple[type[BaseModel], dict[str, Any], str, tuple[float, float]]] = [
    (MethodConfig, {}, "threshold", THRESHOLD),
    (MethodConfig, {}, "gamma", AUTO_S_GAMMA),
    (OptimizerConfig, {}, "lr", LEARNING_RATE),
    (OptimizerConfig, {}, "eps", ADAM_EPS),
    (OptimizerConfig, {}, "gamma_prime", GAMMA_PRIME),
    (OptimizerConfig, {}, "noise_floor", NOISE_FLOOR),
    (OptimizerConfig, {}, "weight_decay", WEIGHT_DECAY),
    (ValidationConfig, {}, "noise", NOISE),
    (AdaptiveConfig, ADAPTIVE, "histogram_noise", NOISE),
    (AdaptiveConfig, ADAPTIVE, "count_noise", NOISE),
    (AdaptiveConfig, ADAPTIVE, "initial_range", THRESHOLD),
    (AdaptiveConfig, ADAPTIVE, "learning_rate", THRESHOLD_RATE),
]
TRIAL = {"dataset": {"source": "builtin:digits"}, "model": {"name": "mlp"}}


def refused(model: type[BaseModel], data: dict[str, Any], field: str) -> bool:
    try:
        model.model_validate(data)
    except ValidationError as error:
        assert error.errors()[0]["loc"][0] == field, error
        return True
    return False


@pytest.mark.parametrize(("model", "fixed", "field", "bounds"), BOUNDED)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bounded_fields_admit_their_range_and_nothing_else(model, fixed, field, bounds, data):
    inside = data.draw(logs(bounds))
    assert getattr(model.model_validate(fixed | {field: inside}), field) == inside
    assert refused(model, fixed | {field: data.draw(outside(bounds))}, field)
    assert refused(model, fixed | {field: data.draw(st.sampled_from([True, False]))}, field)
    assert refused(model, fixed | {field: str(inside)}, field)


@settings(max_examples=60, deadline=None)
@given(
    inside=st.floats(0, 1, exclude_max=True),
    other=st.floats(0, 1, exclude_max=True),
    bad=st.floats(min_value=1) | st.floats(max_value=0, exclude_max=True),
)
def test_coefficients_are_in_zero_one(inside, other, bad):
    """Momentum and Adam's β₁, β₂ lie in [0, 1); betas come as a JSON list or a tuple, their
    items strict."""
    cfg = OptimizerConfig.model_validate({"momentum": inside, "betas": [inside, other]})
    assert (cfg.momentum, cfg.betas) == (inside, (inside, other))
    assert refused(OptimizerConfig, {"momentum": bad}, "momentum")
    assert refused(OptimizerConfig, {"betas": [inside, bad]}, "betas")
    assert refused(OptimizerConfig, {"betas": [True, other]}, "betas")
    assert refused(OptimizerConfig, {"betas": [str(inside), other]}, "betas")


@settings(max_examples=60, deadline=None)
@given(sigma=logs(NOISE), bad=outside(NOISE), size=st.integers(1, MAX_BATCH))
def test_trial_config_bounds_sigma_and_b_and_reads_no_strings(sigma, bad, size):
    """What the trial validates before it reads data: σ, B, and strict types throughout."""
    cfg = TrialConfig.model_validate(TRIAL | {"noise_multiplier": sigma, "batch_size": size})
    assert (cfg.noise_multiplier, cfg.batch_size) == (sigma, size)
    assert refused(TrialConfig, TRIAL | {"noise_multiplier": bad}, "noise_multiplier")
    assert refused(
        TrialConfig, TRIAL | {"noise_multiplier": 1, "batch_size": MAX_BATCH + 1}, "batch_size"
    )
    for field, value in [("batch_size", "64"), ("batch_size", True), ("epochs", "1")]:
        assert refused(TrialConfig, TRIAL | {"noise_multiplier": 1, field: value}, field)
    assert TrialConfig.model_validate_json(
        '{"dataset": {"source": "builtin:digits"}, "model": {"name": "mlp"}, '
        '"noise_multiplier": 1, "optimizer": {"betas": [0.5, 0.9]}}'
    ).optimizer.betas == (0.5, 0.9)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    threshold=logs(THRESHOLD),
    expected=st.integers(1, MAX_BATCH),
    sigma=logs(NOISE),
    planted=st.sampled_from([0.0, 1e-40, 1e30, 3e38]),
)
def test_every_admitted_setting_gives_a_finite_noisy_normal_gradient(
    threshold, expected, sigma, planted
):
    """Over the admitted (C, B, σ_T) and a planted record of subnormal to huge features, the
    noise enters at σ_T and every coordinate of g̃ is a finite, normal float32 number: the
    noise never vanishes, whatever the record."""
    model, stream = mlp(), Recording()
    step = engine(model, threshold, expected, sigma, stream, clipper="fast")
    x, y = batch(n=3)
    x[0] = planted
    step.private_gradient([(x, y)])
    [(scale, _)] = stream.draws
    assert scale == sigma
    got = gradient(model)
    assert bool(got.isfinite().all()) and bool((got.abs() >= FLOAT32_TINY).all())


# --- adaptive thresholds ---------------------------------------------------------------------


def norms_of(kind: str, n: int, stream: torch.Generator) -> Tensor:
    base = torch.rand(n, generator=stream, dtype=torch.float64)
    return {
        "ordinary": base * 3,
        "tiny": base * 1e-30,
        "huge": base * 1e30,
        "zero": torch.zeros(n, dtype=torch.float64),
        "mixed": torch.where(base < 0.5, base * 1e-30, base * 1e30),
    }[kind]


def rule_of(name: str, expected: int, release: float, steps: int = 200):
    extra = {"count_noise": release} if name == "andrew" else {"histogram_noise": release}
    method = MethodConfig(adaptive=AdaptiveConfig(rule=name, **extra))
    return build_rule(
        method,
        expected_batch_size=expected,
        steps=steps,
        grad_noise=1.0,
        num_params=1000,
        stream=SecureStream(),
    )


def test_dcsgd_p_at_b16_with_the_default_sigma_h_stays_above_the_floor():
    """Finding 1's second route: DC-SGD-P at B = 16 with σ_H = 5 (the default) sank to 1e-143
    on its own: noisy histograms of 16 counts put the percentile in the first bin, C/b a step
    whenever it did. Now every C_t is clamped into the threshold range."""
    rule = rule_of("dcsgd_p", 16, AdaptiveConfig(rule="dcsgd_p").histogram_noise)
    gen = torch.Generator().manual_seed(0)
    seen = []
    for t in range(100):
        size = int(torch.poisson(torch.tensor(16.0), generator=gen))
        rule.update(norms_of("ordinary", size, gen), t)
        seen.append(rule.threshold)
    assert THRESHOLD[0] <= min(seen) and max(seen) <= THRESHOLD[1]
    assert min(seen) == THRESHOLD[0]  # the rule does reach the floor: the clamp is what holds


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["dcsgd_p", "dcsgd_e", "andrew", "du"]),
    expected=st.integers(1, 4096),
    release=logs(NOISE),
    kind=st.sampled_from(["ordinary", "tiny", "huge", "zero", "mixed"]),
    seed=st.integers(0, 2**31),
)
def test_every_threshold_a_rule_sets_is_in_range(name, expected, release, kind, seed):
    """Over the rules, batch sizes and release noises, with norms of any size: every C_t stays
    in the threshold range for many steps (and Andrew et al.'s update never overflows)."""
    rule = rule_of(name, expected, release, steps=100)
    gen = torch.Generator().manual_seed(seed)
    for t in range(100):
        rule.update(norms_of(kind, min(expected, 64), gen), t)
        assert THRESHOLD[0] <= rule.threshold <= THRESHOLD[1], (t, rule.threshold)
