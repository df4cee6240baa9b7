"""Canaries of a one-run audit: which are included, and what each one is.

Every canary is included independently with probability 1/2 (the fair coins Steinke, Nasr and
Jagielski's bound rests on). Two kinds:

- *input* canaries (black-box): extra training examples, out of distribution (sparse inputs,
  :func:`input_canaries`) with uniformly random labels, so that nothing in the real data explains
  the label and only training on the canary itself lowers its loss;
- *gradient* canaries (white-box): a canary whose per-example gradient is a fixed random
  direction of parameter space with the norm of the clip bound, in every clipping group
  (:class:`GradientCanaries`, added to the clipped sum by ``workers.audit.clipper``).

Canary designs are the auditor's, not private, but are drawn from a :class:`SecureStream` like
every other draw of a run (there is no seeded mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from workers.data import Dataset
from workers.dp.clipping import CoefFn, clip_factors, group_thresholds
from workers.dp.randomness import SecureStream

#: How many input coordinates a black-box canary sets (the rest are zero).
LIT_COORDINATES = 3
#: Most elements (canaries × parameters) the white-box directions may hold: 1 GiB of float32.
MAX_DIRECTION_ELEMENTS = 1 << 28


def coin_flips(count: int, stream: SecureStream) -> Tensor:
    """Which of ``count`` canaries are included: independent fair coins, bool [count]."""
    return stream.bernoulli(count, 0.5)


def input_canaries(data: Dataset, count: int, stream: SecureStream) -> tuple[Tensor, Tensor]:
    """``count`` out-of-distribution examples with uniformly random labels: each input is zero
    except :data:`LIT_COORDINATES` random coordinates set to the largest absolute training value.

    Sparse canaries are far apart from each other and from the data, so each one's label can
    only be learnt from the canary itself: the audit's lower bounds come out tighter than with
    dense uniform noise inputs."""
    size = math.prod(data.input_shape)
    peak = float(data.x.abs().max())
    x = torch.zeros(count, size)
    for row in x:
        row[[stream.integers(size) for _ in range(LIT_COORDINATES)]] = peak
    y = torch.tensor([stream.integers(data.num_classes) for _ in range(count)], dtype=torch.long)
    return x.view(count, *data.input_shape), y


@dataclass(frozen=True)
class GradientCanaries:
    """m random unit directions in the space of the trainable parameters (flattened in
    ``named_parameters`` order, the order of the engine's noise draw).

    Each direction has norm 1/√M restricted to each of the M clipping groups, so the canary
    gradient C·u_i has norm C/√M = R_m in every group: exactly the per-group bound of group-wise
    clipping (paper 002, eq. 4), the largest contribution one example may make, R in all. Random
    directions in high dimension are nearly orthogonal: under all-layer clipping another canary's
    contribution projects onto u_i with about C/√P, small next to the noise σC. Not so in a small
    group (a bias under param-wise clipping): there every other sampled canary projects onto u_i
    with about C/(M·√P_g), and a few of them outweigh a tenfold reduced noise; the white-box
    score therefore reads each group apart (:meth:`projections`, :meth:`null_variances`).
    """

    directions: Tensor  # [m, P], float32
    column_groups: Tensor  # [P], the clipping group of every flattened parameter
    num_groups: int

    @classmethod
    def draw(
        cls, count: int, column_groups: Tensor, num_groups: int, stream: SecureStream
    ) -> GradientCanaries:
        columns = len(column_groups)
        if count * columns > MAX_DIRECTION_ELEMENTS:
            raise ValueError(
                f"canaries: {count} white-box canaries × {columns} parameters "
                "do not fit in memory; use fewer canaries or a smaller model"
            )
        u = stream.normal((count, columns)).to(column_groups.device)
        group_sq = torch.zeros(count, num_groups, device=u.device).index_add_(
            1, column_groups, u.square()
        )
        u /= (group_sq * num_groups).sqrt()[:, column_groups]
        return cls(u, column_groups, num_groups)

    def clipped_factors(self, coef_fn: CoefFn, threshold: float) -> Tensor:
        """The engine's clip factor of a canary gradient in each group, [M], float64: its
        per-group norm is R_m, so Abadi and AUTO-V keep it whole and AUTO-S scales it by
        R_m/(R_m + γ)."""
        norms = torch.full(
            (1, self.num_groups), group_thresholds(threshold, self.num_groups), dtype=torch.float64
        )
        return clip_factors(coef_fn, norms)[0]

    def contributions(self, ids: Tensor, factors: Tensor, threshold: float) -> Tensor:
        """Σ_i c_g(i)·C·u_i over the canaries ``ids``: their clipped sum, flattened [P]."""
        return (
            self.directions[ids].sum(0)
            * (factors * threshold).to(self.directions)[self.column_groups]
        )

    def projections(self, flat: Tensor) -> Tensor:
        """⟨flat_g, u_{i,g}⟩ for every canary i and group g: [m, M], float64."""
        out = torch.zeros(len(self.directions), self.num_groups, dtype=torch.float64)
        for group, start, end in self._runs:
            part = self.directions[:, start:end] @ flat[start:end].to(self.directions)
            out[:, group] += part.double().cpu()
        return out

    def null_variances(self, flat: Tensor) -> Tensor:
        """‖flat_g‖²/(M·P_g) [M], float64: the variance of ⟨flat_g, u_{i,g}⟩ over a direction
        u_{i,g} of norm 1/√M drawn uniformly in the group's P_g dimensions, independently of
        ``flat`` (E[⟨a, u⟩²] = ‖a‖²‖u‖²/P_g for an isotropic u)."""
        sq = torch.zeros(self.num_groups, dtype=torch.float64, device=flat.device)
        sq.index_add_(0, self.column_groups, flat.double().square())
        return (sq / (self._sizes * self.num_groups)).cpu()

    def shifts(self, factors: Tensor, threshold: float) -> Tensor:
        """⟨c_g·C·u_{i,g}, u_{i,g}⟩ = C·c_g/M [M]: how far one clipped copy of canary i moves
        its projection in each group (each group holds 1/M of ‖u_i‖² = 1)."""
        return threshold * factors.double().cpu() / self.num_groups

    @cached_property
    def _sizes(self) -> Tensor:
        """P_g: how many parameters each group holds, [M]."""
        return torch.bincount(self.column_groups, minlength=self.num_groups)

    @cached_property
    def _runs(self) -> list[tuple[int, int, int]]:
        """(group, start, end) of every run of consecutive columns in one group: a parameter
        tensor never straddles two, so there are at most as many runs as tensors."""
        groups, counts = torch.unique_consecutive(self.column_groups, return_counts=True)
        ends = counts.cumsum(0).tolist()
        return [
            (g, end - n, end)
            for g, n, end in zip(groups.tolist(), counts.tolist(), ends, strict=True)
        ]
