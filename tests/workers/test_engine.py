"""Clipping bounds, sensitivity of the noiseless sum, the noise scale, and Poisson sampling."""

import gc
import math
import os
import signal
import threading
import time

import pytest
import torch
from scipy import stats
from torch import nn

from core.config import ModelConfig
from core.sampling import num_steps, sample_rate
from workers import gaussian
from workers.dp import PrivateStep, clipped_grad_sum, per_sample_grads, resolve_groups
from workers.dp.adaptive import ThresholdRule
from workers.dp.clipping import coefficient_fn
from workers.dp.optim import SGD
from workers.dp.randomness import NoiseChildError, SecureStream
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


class Shrinking(ThresholdRule):
    """Test double: C_{t+1} = 0.9·C_t."""

    def update(self, norms, step):
        self.threshold *= 0.9


def started(step: PrivateStep) -> PrivateStep:
    """``step`` once its noise child has started (until then its steps draw in line)."""
    deadline = time.monotonic() + 30
    while not step.ahead.ready():
        assert time.monotonic() < deadline, "the noise child did not start"
        time.sleep(0.01)
    return step


def ahead_step(make_step, *, sigma=1.3, threshold=0.8, expected=16) -> PrivateStep:
    """A step drawing ahead for a 17,802-parameter mlp, its child started."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="mlp", options={"hidden": 128}), (64,), 10)
    return started(
        make_step(
            model,
            noise=sigma,
            threshold=threshold,
            expected=expected,
            rule=Shrinking(threshold),
            draw_ahead=True,
        )
    )


def gradients(step: PrivateStep, count: int) -> list[torch.Tensor]:
    """g̃ of ``count`` steps on empty batches (pure noise), as the optimizer reads them."""
    seen = []
    step.optimizer.register_step_pre_hook(lambda *_: seen.append(step.flat.clone()))
    empty = (torch.zeros(0, 64), torch.zeros(0, dtype=torch.long))
    for t in range(count):
        step.step([empty], t)
    return seen


def test_noise_drawn_ahead_is_fresh_gaussian_noise_of_std_sigma_c_over_b(make_step):
    """Every step's noise is a fresh N(0, σ_T²) draw, scaled by that step's C_t/B (the
    threshold shrinks every step): the first step's, before the child has started, drawn in
    line; every later one by the child, from its own key, taking no byte of this process's
    stream. The draws go into the gradient buffer itself."""
    sigma, b = 1.3, 16
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="mlp", options={"hidden": 128}), (64,), 10)
    step = make_step(
        model, noise=sigma, threshold=0.8, expected=b, rule=Shrinking(0.8), draw_ahead=True
    )
    assert step.flat.data_ptr() == step.ahead.flat.data_ptr()
    seen = []
    step.optimizer.register_step_pre_hook(lambda *_: seen.append(step.flat.clone()))
    empty = (torch.zeros(0, 64), torch.zeros(0, dtype=torch.long))
    step.step([empty], 0)  # the child takes a tenth of a second to start: in line
    in_line = gaussian.keystream_bytes(step.flat.numel(), 4)
    assert step.noise.keystream.claim(0) == in_line
    started(step)
    for t in range(1, 4):
        step.step([empty], t)
    assert step.noise.keystream.claim(0) == in_line
    z = [g / (sigma * 0.8 * 0.9**t / b) for t, g in enumerate(seen)]
    for t, drawn in enumerate(z):
        assert stats.kstest(drawn.double().numpy(), "norm").pvalue > 1e-4, t
        assert all(not torch.equal(drawn, other) for other in z[:t])


def test_a_step_waits_for_its_noise_drawn_late(make_step):
    """A child that has not finished (here: stopped for 0.3 s) holds the step until it has:
    the step's noise is whole, not what the buffer held before. The child is stopped before
    a step ends, so the draw that step asks for is surely pending (one asked for earlier may
    be made already, or not: then that step waits instead)."""
    step = ahead_step(make_step)
    (first,) = gradients(step, 1)
    os.kill(step.ahead.pid, signal.SIGSTOP)
    threading.Timer(0.3, os.kill, (step.ahead.pid, signal.SIGCONT)).start()
    started_at = time.monotonic()
    (second,) = gradients(step, 1)
    (late,) = gradients(step, 1)
    assert time.monotonic() - started_at >= 0.3
    # not waiting gives the step before's g̃ scaled by this step's C_t/B (C_t = 0.8·0.9^t):
    # every entry close to it; fresh noise makes an entry close only by chance (about 10⁻⁵)
    for t, before, after in ((1, first, second), (2, second, late)):
        assert torch.isclose(after, before * 0.8 * 0.9**t / 16).float().mean() < 0.01
    assert stats.kstest((late / (1.3 * 0.8 * 0.9**2 / 16)).double().numpy(), "norm").pvalue > 1e-4


def test_a_dead_noise_child_fails_the_step_that_needs_its_noise(make_step):
    step = ahead_step(make_step)
    gradients(step, 1)  # the next step's draw is asked for
    os.kill(step.ahead.pid, signal.SIGKILL)
    # a kill is asynchronous: until the child is dead its pipes are open, and a step that finds
    # its draw made (its reply already in the pipe) could still ask for the next one unharmed
    os.waitpid(step.ahead.pid, 0)
    with pytest.raises(NoiseChildError, match="exited"):
        gradients(step, 1)


def test_the_noise_child_exits_with_its_step(make_step):
    """A draw asked for when training stops is never used: the child ends with the buffer."""
    step = ahead_step(make_step)
    gradients(step, 2)
    pid = step.ahead.pid
    del step
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # reaped already
            return
        time.sleep(0.01)
    pytest.fail("the noise child outlived its step")
