"""Evaluation and the private selection score.

docs/design.md, invariant 4 and 5: metrics computed on private data are operator-only; the score
used to select a trial comes from a public split, or from the private one through the Gaussian
mechanism below, whose RDP (``gaussian_rdp(noise)``) is part of the trial's cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.dp.randomness import SecureStream


@dataclass(frozen=True)
class Evaluation:
    loss: float | None  # mean cross-entropy; None where some example's logits are not finite
    correct: int
    total: int
    predictions: Tensor  # -1 where an example's logits are not finite

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.total, 1)


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1024) -> Evaluation:
    """Loss, predictions and correct count of ``model`` on ``(x, y)``, total over the data
    (docs/design.md, invariant 13): a registered record may hold a feature of 3e38, which can
    drive a logit beyond float32's range or to NaN. Such an example predicts no class (-1,
    counted wrong), so the count stays a count of examples (the sensitivity-1 statistic of
    :func:`noisy_accuracy`); the loss is summed in float64 from float64 logits, where every
    finite float32 logit gives a finite term, and is None (JSON null) when an example's logits
    are not finite: never NaN or ±inf, which no report could carry."""
    model.eval()
    loss, predictions = 0.0, []
    for start in range(0, len(y), batch_size):
        out = model(x[start : start + batch_size]).double()
        loss += float(F.cross_entropy(out, y[start : start + batch_size], reduction="sum"))
        predictions.append(out.argmax(1).where(out.isfinite().all(1), -1))
    model.train()
    pred = torch.cat(predictions) if predictions else y.new_zeros(0)
    mean = loss / max(len(y), 1) if math.isfinite(loss) else None
    return Evaluation(mean, int((pred == y).sum()), len(y), pred)


def noisy_accuracy(
    correct: int, expected_total: float, noise: float, stream: SecureStream
) -> float:
    """(correct + N(0, noise²)) / expected_total: the number of correct predictions has
    sensitivity 1 under adding/removing (or replacing) one validation example, so this
    release is the Gaussian mechanism with noise multiplier ``noise``. The divisor is the
    split's *expected* size f·N (public, like B in DP-SGD), never its realized size, which
    the independent hold-out makes private."""
    return (correct + noise * float(stream.normal(1, dtype=torch.float64))) / expected_total


def group_accuracy(predictions: Tensor, y: Tensor, class_group: Tensor) -> dict[int, float]:
    """Accuracy per label-frequency group (paper 004's metric)."""
    groups = class_group.to(y.device)[y]
    hits = (predictions == y).double()
    return {int(g): float(hits[groups == g].mean()) for g in groups.unique()}
