"""The audited training run: one trial's engine, with canaries, scored and turned into a bound.

:func:`run_audit` trains once exactly as :func:`workers.trial.run_trial` would — the same
privacy plan (``plan_privacy``), model, clipper, threshold rule, optimizer, Poisson sampling and
secure noise streams (``workers.trial.build_engine``) — on the real training data plus the included
canaries, then scores every canary, guesses, and computes the lower bound of
``core.accounting.audit``.

Canaries count toward N. q = B/N and T are planned for N = (real examples) + m, as if all m
canaries were in; the excluded half is never sampled (rate 0 ≤ q), like a trial's private
hold-out, so every example and every included canary is sampled at exactly the planned q for the
planned T steps, and the claimed ε is what :meth:`Privacy.epsilon` charges for that plan. With
a private validation split the claim also covers the score's release, which the audit does not
observe (it trains on every real example and releases no score).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from core.accounting.audit import correct_guesses, epsilon_lower_bound
from core.config import TrialConfig
from workers.audit.canaries import GradientCanaries, coin_flips, input_canaries
from workers.audit.clipper import CanaryClipper
from workers.audit.noise import ScaledNoise
from workers.audit.scores import LikelihoodRatio, canary_losses
from workers.data import Dataset, load_dataset
from workers.dp import PrivateStep, coefficient_fn
from workers.dp.randomness import SecureStream, TrialRandomness
from workers.dp.sampling import micro_batches, poisson_batches
from workers.models import build_model
from workers.trial import Privacy, build_engine, plan_privacy, resolve_device

CanaryKind = Literal["white", "black"]
StepCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class AuditResult:
    kind: CanaryKind
    canaries: int  # m
    guesses: int  # k = r: ⌈k/2⌉ "in" guesses, ⌊k/2⌋ "out"
    correct: int  # v
    included: int  # how many canaries the coins put in
    claimed_epsilon: float  # what the plan charges, at delta
    lower_bound: float  # (ε, δ)-DP is refuted for every ε below it, at `confidence`
    delta: float
    confidence: float
    noise_scale: float  # 1 unless a fault was injected
    sample_rate: float
    steps: int
    noise_multiplier: float
    dataset: str
    model: str
    wall_time_s: float
    device: str

    @property
    def ratio(self) -> float:
        """lower bound / claimed ε: how tight the audit is (above 1: the claim is refuted)."""
        return self.lower_bound / self.claimed_epsilon

    @property
    def refuted(self) -> bool:
        return self.lower_bound > self.claimed_epsilon

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "refuted": self.refuted}


def run_audit(
    cfg: TrialConfig,
    *,
    canaries: int = 1000,
    guesses: int = 200,
    kind: CanaryKind = "white",
    noise_scale: float = 1.0,
    confidence: float = 0.95,
    on_step: StepCallback | None = None,
) -> AuditResult:
    """Train ``cfg`` once with ``canaries`` coin-flip canaries of ``kind`` and bound its ε from
    below at ``confidence``; ``noise_scale`` ≠ 1 injects a fault (gradient noise × scale)."""
    if kind not in ("white", "black"):
        raise ValueError(f"kind: must be 'white' or 'black', got {kind!r}")
    if not 0 < guesses <= canaries:
        raise ValueError(f"guesses: must be in [1, canaries = {canaries}], got {guesses}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    started = time.perf_counter()
    device = resolve_device(cfg.device)
    data = load_dataset(cfg.dataset)
    privacy = plan_privacy(cfg, data.size + canaries)
    randomness = TrialRandomness()
    randomness.gradient = ScaledNoise(noise_scale)
    design = SecureStream()  # the canaries and their coins: the auditor's own stream
    included = coin_flips(canaries, design)
    randomness.seed_torch(device)
    model = build_model(cfg.model, data.input_shape, data.num_classes).to(device)
    engine = build_engine(cfg, model, privacy, randomness)

    inserted = (
        _white_box(engine, privacy, data, included, design)
        if kind == "white"
        else _black_box(engine, data, included, design)
    )
    x = torch.cat([data.x, inserted.x]).to(device)
    y = torch.cat([data.y, inserted.y]).to(device)
    _train(engine, x, y, privacy, cfg.physical_batch_size, randomness.sampling, on_step)

    correct = correct_guesses(inserted.scores().numpy(), included.numpy(), guesses)
    claimed, _ = privacy.epsilon(cfg.delta)
    return AuditResult(
        kind=kind,
        canaries=canaries,
        guesses=guesses,
        correct=correct,
        included=int(included.sum()),
        claimed_epsilon=claimed,
        lower_bound=epsilon_lower_bound(canaries, guesses, correct, cfg.delta, confidence),
        delta=cfg.delta,
        confidence=confidence,
        noise_scale=noise_scale,
        sample_rate=privacy.sample_rate,
        steps=privacy.steps,
        noise_multiplier=privacy.noise_multiplier,
        dataset=data.name,
        model=cfg.model.name,
        wall_time_s=time.perf_counter() - started,
        device=str(device),
    )


@dataclass(frozen=True)
class _Inserted:
    """The rows the included canaries add to the training data, and how to score all m."""

    x: Tensor
    y: Tensor
    scores: Callable[[], Tensor]


def _white_box(
    engine: PrivateStep, privacy: Privacy, data: Dataset, included: Tensor, stream: SecureStream
) -> _Inserted:
    """Gradient canaries: the engine's clipper is wrapped (``CanaryClipper``) and the included
    canaries are placeholder rows with target −1 − id."""
    group_of = {name: g for g, group in enumerate(engine.groups) for name in group}
    device = next(iter(engine.params.values())).device
    column_groups = torch.cat(
        [
            torch.full((p.numel(),), group_of[name], device=device)
            for name, p in engine.params.items()
        ]
    )
    canaries = GradientCanaries.draw(len(included), column_groups, len(engine.groups), stream)
    clipper = CanaryClipper(
        engine.clipper,
        canaries,
        engine.params,
        threshold=lambda: engine.rule.threshold,
        unit_coef=lambda c: coefficient_fn(engine.clipping, c, len(engine.groups), engine.gamma),
    )
    engine.clipper = clipper
    ratio = LikelihoodRatio(engine, clipper, canaries, privacy.sample_rate)
    ids = included.nonzero().squeeze(1)
    return _Inserted(torch.zeros(len(ids), *data.input_shape), -1 - ids, lambda: ratio.scores)


def _black_box(
    engine: PrivateStep, data: Dataset, included: Tensor, stream: SecureStream
) -> _Inserted:
    """Input canaries: the included ones are training examples; all are scored by the drop of
    their loss during training."""
    x, y = input_canaries(data, len(included), stream)
    device = next(iter(engine.params.values())).device
    x_scored, y_scored = x.to(device), y.to(device)
    before = canary_losses(engine.model, x_scored, y_scored)
    return _Inserted(
        x[included], y[included], lambda: before - canary_losses(engine.model, x_scored, y_scored)
    )


def _train(
    engine: PrivateStep,
    x: Tensor,
    y: Tensor,
    privacy: Privacy,
    physical_batch_size: int,
    stream: SecureStream,
    on_step: StepCallback | None,
) -> None:
    """The trial's training loop: Poisson batches of the audited data, one engine step each."""
    for t, indices in enumerate(
        poisson_batches(len(y), privacy.sample_rate, privacy.steps, stream)
    ):
        chunks = [(x[i], y[i]) for i in micro_batches(indices.to(x.device), physical_batch_size)]
        engine.step(chunks, t)
        if on_step:
            on_step(t + 1, privacy.steps)
