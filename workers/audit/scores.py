"""How confident the auditor is that each canary was included: higher score, more likely in.

White-box (:class:`LikelihoodRatio`): at every step t the engine releases the noisy gradient
g̃_t = (S_t + Σ_{sampled canaries} c·C_t·u_i + σ_T·C_t·z)/B. Subtracting the real examples'
clipped sum S_t (see ``workers.audit.clipper``) leaves the residual r_t = B·g̃_t − S_t, and its
projection onto canary i's direction in clipping group g is

    x_{t,i,g} = ⟨r_{t,g}, u_{i,g}⟩ = b_{t,i}·μ_{t,g} + (noise and the other sampled canaries),

with μ_{t,g} = C_t·c_g/M the clipped canary's shift in group g (``GradientCanaries.shifts``) and
b_{t,i} ~ Bernoulli(q) if canary i is included, 0 if not: the Poisson-subsampled Gaussian
mechanism the accountant charges for. Given r_t, an excluded canary's x_{t,i,g} has mean 0 and
variance v_{t,g} = ‖r_{t,g}‖²/(M·P_g) (``GradientCanaries.null_variances``), whatever the noise
really is: σ_T²C_t²/M in a large group of a correct build, far more in a small group that every
sampled canary crowds (a bias under param-wise clipping), far less in a large group of a build
whose noise is too small. The groups are combined by their signal over the variance they show,
the matched filter z_{t,i} = Σ_g (μ_{t,g}/v_{t,g})·x_{t,i,g}, which is about N(0, Λ_t) for an
excluded canary and N(Λ_t, Λ_t) for a sampled one, Λ_t = Σ_g μ_{t,g}²/v_{t,g}. The score is
the log-likelihood ratio of "included" against "excluded" summed over the steps,

    Σ_t log(1 − q + q·exp(z_{t,i} − Λ_t/2)),

the most powerful test of the two hypotheses for each canary (Neyman–Pearson), and it lets the
few steps that sampled the canary dominate where a plain alignment Σ_t x_{t,i} weighs every
step alike. In a correct build every group shows v ≈ σ_T²C_t²/M and this is the ratio of the
claimed mechanism. Weighing the groups by the variance they show is what lets the audit see a
reduced noise under every clipping style: with equal weights, the other canaries crowding a
param-wise bias group hid noise × 0.1 entirely (no run of 8 refuted ε = 2). The bound stays
valid whatever the score (``core.accounting.audit``): the score is computed from the released
gradients and the auditor's own knowledge, never from the coins.

Black-box: an input canary's score is how much training lowered its loss (:func:`canary_losses`
before training − after), so that a canary that is easy or hard for the initial model does not
look included or excluded.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from workers.audit.canaries import GradientCanaries
from workers.audit.clipper import CanaryClipper
from workers.dp import PrivateStep


class LikelihoodRatio:
    """Accumulates the white-box scores of every canary from the engine's private gradients
    (read by an optimizer step pre-hook, after the engine has set ``p.grad`` to g̃_t)."""

    def __init__(
        self,
        engine: PrivateStep,
        clipper: CanaryClipper,
        canaries: GradientCanaries,
        sample_rate: float,
    ) -> None:
        self.engine, self.clipper, self.canaries = engine, clipper, canaries
        self.log_q, self.log_not_q = math.log(sample_rate), math.log1p(-sample_rate)
        self.scores = torch.zeros(len(canaries.directions), dtype=torch.float64)
        engine.optimizer.register_step_pre_hook(lambda *_: self.observe())

    def observe(self) -> None:
        """Add step t's log-likelihood ratio of every canary (see the module docstring)."""
        engine = self.engine
        threshold = engine.rule.threshold  # C_t of this step: the rule updates after the step
        grad = torch.cat([p.grad.flatten() for p in engine.params.values()])  # type: ignore[union-attr]
        residual = grad * engine.expected_batch_size - self.clipper.take_real_sum()
        x = self.canaries.projections(residual)
        variance = self.canaries.null_variances(residual)
        shift = self.canaries.shifts(self.clipper.unit_factors(threshold), threshold)
        weight = torch.where(variance > 0, shift / variance, 0.0)  # r_g = 0: x_{·,g} = 0
        self.scores += torch.logaddexp(
            torch.tensor(self.log_not_q, dtype=torch.float64),
            self.log_q + x @ weight - (shift * weight).sum() / 2,
        )


@torch.no_grad()
def canary_losses(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1024) -> Tensor:
    """Cross-entropy of every input canary under ``model``, float64 on the CPU."""
    model.eval()
    losses = [
        F.cross_entropy(model(xb), yb, reduction="none").double().cpu()
        for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True)
    ]
    model.train()
    return torch.cat(losses)
