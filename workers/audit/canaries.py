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
    only be learnt from the canary itself. On digits (m = 1000, ε = 8) they gave bounds of
    0.2–0.5 where dense uniform noise inputs gave about 0.15."""
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
    clipping (paper 002, eq. 4), the largest contribution one example may make. Random directions
    in high dimension are nearly orthogonal: under all-layer clipping another canary's
    contribution projects onto u_i with about C/√P, small next to the noise σC (more where a
    clipping group is small, e.g. a bias under param-wise clipping: C/(M·√P_g) from group g).
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
        """⟨flat, u_i⟩ for every canary, [m]."""
        return self.directions @ flat

    def shift(self, factors: Tensor, threshold: float) -> float:
        """⟨c·C·u_i, u_i⟩ = C·mean_g c_g: how far one clipped copy of canary i moves the
        projection onto u_i (each group holds 1/M of ‖u_i‖² = 1)."""
        return threshold * float(factors.mean())
