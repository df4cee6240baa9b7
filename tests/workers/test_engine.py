"""Clipping bounds, sensitivity of the noiseless sum, the noise scale, and Poisson sampling."""

import math
import time

import numpy as np
import pytest
import torch
from randomgen import AESCounter
from torch import nn

from core.config import ModelConfig
from core.entropy import Keystream, Reader
from core.sampling import num_steps, sample_rate
from workers import gaussian, noise_process
from workers.dp import PrivateStep, clipped_grad_sum, per_sample_grads, resolve_groups
from workers.dp.adaptive import ThresholdRule
from workers.dp.clipping import coefficient_fn
from workers.dp.ghost import clipped_grad_sum as fast_clipped_grad_sum
from workers.dp.optim import SGD
from workers.dp.randomness import SecureStream
from workers.dp.sampling import micro_batches, poisson_batches
from workers.models import build_model

LOSS = nn.CrossEntropyLoss(reduction="none")
FUNCTIONS = ["abadi", "auto_s", "auto_v"]
STYLES = ["all_layer", "layer_wise", "param_wise"]


def mlp(seed=0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(name="mlp", options={"hidden": 8}), (6,), 3)


def batch(n=6, scale=50.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def flat(sums):
    return torch.cat([s.flatten() for s in sums.values()])


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("style", STYLES)
def test_clipped_per_sample_gradients_respect_group_and_total_bounds(function, style):
    model, (x, _), r = mlp(), batch(), 0.3
    y = model(x).argmin(1).detach()  # the least likely class: every gradient is large
    groups = resolve_groups(model, style)
    coef = coefficient_fn(function, r, len(groups))
    for i in range(len(y)):  # clip each example alone: its sum is its clipped gradient
        norms, sums = clipped_grad_sum(model, LOSS, x[i : i + 1], y[i : i + 1], groups, coef)
        for group in groups:
            group_norm = torch.cat([sums[n].flatten() for n in group]).norm()
            assert group_norm <= r / math.sqrt(len(groups)) * (1 + 1e-5)
        assert flat(sums).norm() <= r * (1 + 1e-5)
        assert norms.max() > 2 * r  # the bound binds


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("style", STYLES)
def test_sensitivity_of_the_noiseless_sum(function, style):
    model, (x, _), r = mlp(), batch(), 0.7
    y = model(x).argmin(1).detach()
    groups = resolve_groups(model, style)
    coef = coefficient_fn(function, r, len(groups))
    full = flat(clipped_grad_sum(model, LOSS, x, y, groups, coef)[1])
    removed = flat(clipped_grad_sum(model, LOSS, x[1:], y[1:], groups, coef)[1])
    x2, y2 = x.clone(), y.clone()
    x2[0] = -3 * x[0]
    y2[0] = model(x2[:1]).argmin(1).detach()[0]
    replaced = flat(clipped_grad_sum(model, LOSS, x2, y2, groups, coef)[1])
    assert (full - removed).norm() <= r * (1 + 1e-5)
    assert (full - replaced).norm() <= 2 * r * (1 + 1e-5)
    assert (full - replaced).norm() > r / 2  # the bound is not vacuous here


class CountingStream(SecureStream):
    """A secure stream that counts its noise draws (test double: isolates the engine)."""

    def __init__(self) -> None:
        super().__init__()
        self.draws = 0

    def normal(self, shape, **kwargs):
        self.draws += 1
        return super().normal(shape, **kwargs)


def test_empty_batch_gradient_is_pure_noise_with_std_sigma_r_over_b(make_step):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="mlp", options={"hidden": 128}), (64,), 10)
    sigma, r, b = 1.3, 0.8, 16
    step = make_step(model, noise=sigma, threshold=r, expected=b)
    step.private_gradient([(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long))])
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert len(grads) > 20000
    assert abs(float(grads.mean())) < 4 * sigma * r / b / math.sqrt(len(grads))
    assert float(grads.std()) == pytest.approx(sigma * r / b, rel=0.03)
    assert step.noise_std(r) == pytest.approx(sigma * r / b)


def test_noise_is_added_once_per_logical_step_and_sum_divided_by_expected_b(make_step):
    x, y = batch(n=7, scale=3.0)
    results = []
    for physical in (1, 3, 7):
        model = mlp()
        stream = CountingStream()
        step = make_step(model, noise=0.0, threshold=0.4, expected=10, stream=stream)
        norms = step.private_gradient(
            [(x[i], y[i]) for i in micro_batches(torch.arange(7), physical)]
        )
        results.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert norms.shape == (7,)
        assert stream.draws == 1  # one noise draw per logical step, however it is split
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[0], results[2])

    model = mlp()
    step = make_step(model, noise=0.0, threshold=0.4, expected=10)
    step.private_gradient([(x, y)])
    groups = resolve_groups(model, "layer_wise")
    grads = per_sample_grads(model, LOSS, x, y)
    for group in groups:  # independent: clip each example by hand, sum, / B
        r_m = 0.4 / math.sqrt(len(groups))
        norm = torch.stack([grads[n].flatten(1).pow(2).sum(1) for n in group]).sum(0).sqrt()
        factor = torch.clamp(r_m / norm, max=1.0)
        for n in group:
            want = (factor.view(-1, *[1] * (grads[n].dim() - 1)) * grads[n]).sum(0) / 10
            torch.testing.assert_close(dict(model.named_parameters())[n].grad, want)


def test_realized_sample_rate_matches_q():
    n, q, steps = 2000, 0.03, 300
    sizes = torch.tensor([len(i) for i in poisson_batches(n, q, steps, SecureStream())])
    std = math.sqrt(n * q * (1 - q) / steps)
    assert abs(float(sizes.double().mean()) - n * q) < 4 * std
    assert float(sizes.double().var()) == pytest.approx(n * q * (1 - q), rel=0.25)
    counts = torch.zeros(n)
    for idx in poisson_batches(n, q, steps, SecureStream()):
        assert len(idx.unique()) == len(idx)
        counts[idx] += 1
    assert float(counts.mean() / steps) == pytest.approx(q, rel=0.05)


def test_sampling_helpers():
    assert sample_rate(64, 1000) == 0.064
    assert num_steps(1000, 64, 2.0) == 31
    with pytest.raises(ValueError, match="batch_size"):
        sample_rate(2000, 1000)
    empties = sum(len(i) == 0 for i in poisson_batches(10, 0.01, 50, SecureStream()))
    assert empties > 30


HOSTILE = {"nan": float("nan"), "inf": float("inf"), "huge": 1e20}


@pytest.mark.parametrize("path", ["general", "fast"])
@pytest.mark.parametrize("style", ["all_layer", "layer_wise", "param_wise", "groups"])
@pytest.mark.parametrize("record", list(HOSTILE))
def test_a_hostile_record_trains_to_a_finite_model(path, style, record):
    """docs/design.md, invariant 9: one planted record with NaN, inf or 1e20 features, sampled in
    every step, must not make the model non-finite — otherwise whether the released model is
    NaN tells whether the record was sampled."""
    from workers.dp import get_clipper

    model = mlp()
    spec = [["1", "3"], ["5"]] if style == "groups" else style
    groups = resolve_groups(model, spec)
    step = PrivateStep(
        model,
        LOSS,
        groups,
        get_clipper(path),
        clipping="abadi",
        gamma=0.01,
        rule=ThresholdRule(1.0),
        grad_noise=1.0,
        expected_batch_size=8,
        optimizer=SGD(model.parameters(), lr=0.1),
        noise=SecureStream(),
    )
    x, y = batch(n=8, scale=1.0)
    x[3] = HOSTILE[record]
    for t in range(3):
        step.step([(x, y)], t)
    assert all(torch.isfinite(p).all() for p in model.parameters())


class SlowKeystream(Keystream):
    """Test double: a keystream each of whose readers takes 50 ms longer to start."""

    def reader(self, start: int) -> Reader:
        time.sleep(0.05)
        return super().reader(start)


class Keyed(SecureStream):
    """Test double: a stream with a fixed key."""

    def __init__(self, key: int, keystream: type[Keystream] = Keystream) -> None:
        self.numpy = np.random.Generator(AESCounter(key=key, counter=0))
        self.keystream = keystream(key.to_bytes(16, "little"))


def slow_keyed(key: int) -> Keyed:
    """A keyed stream whose every draw is 100 ms late (drawn ahead, on the noise thread: the
    noise process reads only a plain keystream)."""
    return Keyed(key, SlowKeystream)


class Shrinking(ThresholdRule):
    """Test double: C_{t+1} = 0.9·C_t."""

    def update(self, norms, step):
        self.threshold *= 0.9


@pytest.mark.parametrize("style", ["all_layer", "layer_wise"])
@pytest.mark.parametrize("where", ["late, on the noise thread", "in the noise process"])
def test_noise_drawn_ahead_trains_the_very_model_that_noise_drawn_in_line_does(
    style, where, make_step, monkeypatch
):
    """Each step uses the draw made ahead for it once it is complete (a late one would
    otherwise land on the sums), scaled by that step's C_t; with an empty batch the noise is
    the gradient. The draw goes into the gradient buffer itself: no second model-sized one.
    In the noise process, it is made there: after the first step (whose draw is needed as
    soon as it is asked for), nothing here made a chunk of it."""
    made_here = []
    monkeypatch.setattr(
        noise_process, "make", lambda *args, **kw: made_here.append(gaussian.make(*args, **kw))
    )
    models = []
    for ahead in (False, True):
        model = mlp()
        late = where.startswith("late")
        step = make_step(
            model,
            noise=1.0,
            threshold=0.5,
            expected=6,
            stream=slow_keyed(2**90 + 3) if late else Keyed(2**90 + 3),
            style=style,
            clipper=fast_clipped_grad_sum,
            rule=Shrinking(0.5),
            lr=0.1,
            draw_ahead=ahead,
        )
        assert step.draw_ahead == ahead
        buffers = set()  # the storage every step's g̃ is in, read where the optimizer reads it
        step.optimizer.register_step_pre_hook(
            lambda *_, step=step, seen=buffers: seen.add(step.optimizer.params[0].grad.data_ptr())
        )
        process = noise_process.current()
        while ahead and not late and not process.ready():
            time.sleep(0.01)  # (draws asked for before it starts are made on the thread)
        for t, data in enumerate([batch(seed=1), batch(n=0), batch(seed=2), batch(seed=3)]):
            step.step([data], t)
            time.sleep(0.05 if ahead and not late else 0)  # the trial's work between steps
            if t == 0:
                made_here.clear()  # the first step's draw is needed as soon as it is asked for
        models.append(model)
        assert buffers == {step.flat.data_ptr()}  # one gradient buffer, drawn ahead into too
    for inline, ahead in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(inline, ahead)
    assert late or not made_here


def test_a_threshold_changed_after_the_draw_began_scales_the_drawn_noise(make_step):
    """The next step's noise σ_T·z is drawn ahead whatever the threshold (it is in units of
    the clip bound); a threshold changed afterwards (from outside the rule) still gets noise
    of std σ_T·C/B at the new C: the drawn-ahead gradient equals the one drawn in line."""
    grads = []
    for ahead in (False, True):
        step = make_step(
            mlp(), noise=1.0, threshold=0.5, expected=6, stream=Keyed(2**70 + 1), draw_ahead=ahead
        )
        step.step([batch(seed=1)], 0)
        step.rule.threshold = 0.8  # after the draw for step 1 began, at 0.5
        step.private_gradient([batch(n=0)])  # noise alone
        grads.append(torch.cat([p.grad.flatten() for p in step.params.values()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-6, atol=0)
    assert float(grads[1].std()) == pytest.approx(0.8 / 6, rel=0.5)
