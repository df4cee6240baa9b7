"""White-box canaries enter the engine through its clipper seam.

:class:`CanaryClipper` wraps the clipper a trial uses (``workers.dp.engine.Clipper``). The
audited data set holds one placeholder row per included canary whose target is −1 − (canary id)
— never a label, since every label is ≥ 0
(``workers.data.check``) — so canaries are Poisson-sampled with the real examples, by the same
draw, and may land in any micro-batch. For each such row the wrapper adds the canary's gradient
C·u_i, clipped by the engine's own clip function ``coef_fn``, to the clipped sum, and reports its
per-group norms with the real examples' norms (adaptive threshold rules see canaries as the
examples they stand for). Real rows go to the wrapped clipper unchanged.

It also keeps the step's clipped sum S_t of the *real* examples, for the white-box score
(``workers.audit.scores``): an adversary who knows every other record and which of them were
sampled — within DP's threat model, since their sampling is independent of the canaries — can
subtract their contribution from the released noisy gradient g̃_t = (S_t + canaries + σ_T·C_t·z)/B.
The engine's clip factors carry a scale of its own (the sums it adds into its buffer are in the
units it scales afterwards); the wrapper takes it out, the ratio of the engine's clip factor of a
canary to the unscaled one, so S_t is in the mechanism's units whatever the engine's are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from workers.audit.canaries import GradientCanaries
from workers.dp import Clipper
from workers.dp.clipping import CoefFn, group_thresholds
from workers.dp.grads import LossFn


class CanaryClipper:
    """``inner`` plus the gradient canaries of the rows with a negative target."""

    def __init__(
        self,
        inner: Clipper,
        canaries: GradientCanaries,
        params: Mapping[str, Tensor],
        threshold: Callable[[], float],
        unit_coef: Callable[[float], CoefFn],
    ) -> None:
        """``threshold`` gives the engine's C_t, ``unit_coef`` its clip function at a threshold
        without the engine's scale (``coefficient_fn`` with scale 1)."""
        self.inner, self.canaries = inner, canaries
        self.threshold, self.unit_coef = threshold, unit_coef
        self.shapes = {name: p.shape for name, p in params.items()}
        self.real_sum = torch.zeros(len(canaries.column_groups), device=canaries.directions.device)

    def __call__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: Tensor,
        targets: Tensor,
        groups: list[list[str]],
        coef_fn: CoefFn,
        out: Mapping[str, Tensor] | None = None,
    ) -> tuple[Tensor, Mapping[str, Tensor]]:
        is_canary = targets < 0
        norms, sums = self._real(
            model, loss_fn, inputs[~is_canary], targets[~is_canary], groups, coef_fn
        )
        threshold = self.threshold()
        factors = self.canaries.clipped_factors(coef_fn, threshold)
        engine_scale = float(factors[0] / self.unit_factors(threshold)[0])
        self.real_sum += self._flat(sums) / engine_scale
        ids = -1 - targets[is_canary]
        if len(ids):
            added = self._unflat(self.canaries.contributions(ids, factors, threshold))
            sums = {name: s + added[name] for name, s in sums.items()}
            canary_norms = torch.full(
                (len(ids), len(groups)),
                group_thresholds(threshold, len(groups)),
                dtype=norms.dtype,
                device=norms.device,
            )
            norms = torch.cat([norms, canary_norms])
        if out is None:
            return norms, sums
        for name, s in sums.items():
            out[name].add_(s)
        return norms, out

    def unit_factors(self, threshold: float) -> Tensor:
        """c_g [M]: the clip factor of a canary in each group, without the engine's scale."""
        return self.canaries.clipped_factors(self.unit_coef(threshold), threshold)

    def take_real_sum(self) -> Tensor:
        """The real examples' clipped sum S_t since the last call, flattened [P], in the
        mechanism's units (Σ_i c_i·g_i, not divided by B); resets it."""
        taken, self.real_sum = self.real_sum, torch.zeros_like(self.real_sum)
        return taken

    def _real(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: Tensor,
        targets: Tensor,
        groups: list[list[str]],
        coef_fn: CoefFn,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        if len(targets):
            norms, sums = self.inner(model, loss_fn, inputs, targets, groups, coef_fn)
            return norms, {name: s.detach() for name, s in sums.items()}
        device = self.real_sum.device
        return (
            torch.zeros(0, len(groups), device=device),  # float32, as the clippers' norms
            {name: torch.zeros(shape, device=device) for name, shape in self.shapes.items()},
        )

    def _flat(self, sums: dict[str, Tensor]) -> Tensor:
        return torch.cat([sums[name].flatten() for name in self.shapes]).to(self.real_sum)

    def _unflat(self, flat: Tensor) -> dict[str, Tensor]:
        sizes = [shape.numel() for shape in self.shapes.values()]
        return {
            name: chunk.view(shape)
            for (name, shape), chunk in zip(self.shapes.items(), flat.split(sizes), strict=True)
        }
