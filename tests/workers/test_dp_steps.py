"""The step's fixed costs (issue 15): one flat gradient buffer, noise drawn straight into it."""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from torch import nn

from workers.dp.randomness import SecureStream
from workers.gaussian import CHUNK


def test_normal_fills_a_buffer_in_place_across_chunks_and_odd_sizes() -> None:
    buffer = torch.full((2 * CHUNK + 3,), float("nan"))
    got = SecureStream().normal(len(buffer), out=buffer)
    assert got is buffer and bool(buffer.isfinite().all())
    assert stats.kstest(buffer.double().numpy(), "norm").pvalue > 1e-4
    wide = SecureStream().normal((3, 5), out=torch.empty(3, 5, dtype=torch.float64))
    assert wide.dtype == torch.float64 and bool(wide.isfinite().all())
    with pytest.raises(ValueError, match="out"):
        SecureStream().normal(4, out=torch.empty(5))
    with pytest.raises(ValueError, match="out"):
        SecureStream().normal((2, 2), out=torch.empty(2, 2).mT)


class Mixed(nn.Module):
    """A float32 layer and a float64 gain: the buffer takes the widest dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.gain = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.gain).float()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_gradients_are_views_of_one_buffer_and_noise_has_std_sigma_r_over_b(make_step) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    sigma, r, b = 1.5, 0.5, 8
    step = make_step(model, noise=sigma, threshold=r, expected=b, style="all_layer")
    for _ in range(2):  # the buffer is reused: the second step is not the first's leftovers
        step.private_gradient([(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long))])
        grads = [p.grad for p in model.parameters()]
        storage = step.flat.untyped_storage().data_ptr()
        assert all(g is not None and g.untyped_storage().data_ptr() == storage for g in grads)
        flat = torch.cat([g.flatten() for g in grads if g is not None])
        assert float(flat.std()) == pytest.approx(sigma * r / b, rel=0.03)

    mixed = Mixed()
    step = make_step(mixed, noise=1.0, threshold=1.0, expected=4, style="all_layer", lr=0.1)
    step.step([(torch.randn(4, 4), torch.randint(0, 3, (4,)))], 0)
    assert step.flat.dtype == torch.float64
    assert mixed.fc.weight.dtype == torch.float32 and mixed.gain.dtype == torch.float64
