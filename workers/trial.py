"""Train one model with DP from a :class:`~core.config.TrialConfig`.

``python -m workers.trial --config trial.json --out result.json`` runs one trial with a progress
bar; :func:`run_trial` is the same thing for the Ray trainable. The result holds the privacy
parameters and cost, the per-step thresholds of adaptive rules, per-epoch metrics each marked
``public`` or ``private`` (private ones are operator-only, docs/design.md, invariant 4) and the
selection score (invariant 5).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError
from torch import nn

from core.accounting import (
    calibrate_noise,
    epsilon_from_rdp,
    gaussian_rdp,
    trial_rdp,
)
from core.config import TrialConfig
from core.noise import gradient_noise, release_noise
from core.sampling import num_steps, sample_rate
from workers.data import Dataset, hold_out, load_cached
from workers.dp import PrivateStep, get_clipper, resolve_groups
from workers.dp.adaptive import build_rule
from workers.dp.optim import build_optimizer
from workers.dp.physical import PhysicalBatches
from workers.dp.randomness import SecureStream, TrialRandomness, spare_core
from workers.dp.sampling import poisson_batches
from workers.metrics import evaluate, group_accuracy, noisy_accuracy
from workers.models import build_model
from workers.release import InitialState, released_state

#: Training metrics are computed on at most this many training examples per epoch.
TRAIN_EVAL_EXAMPLES = 4096

StepCallback = Callable[[int, int], None]
EpochCallback = Callable[[list[dict[str, Any]]], None]


@dataclass
class TrialOutcome:
    """The trial's result and trained model, whose state other than its trainable parameters
    may hold data (operator-side only), and the state it had when built: what is released is
    :attr:`released`, never ``model.state_dict()`` (docs/design.md, invariant 14)."""

    result: dict[str, Any]
    model: nn.Module
    initial: InitialState

    @property
    def released(self) -> dict[str, torch.Tensor]:
        """The weights to release: the initial state with the trained parameters
        (:func:`workers.release.released_state`), on the CPU."""
        return released_state(self.initial)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but no GPU is available")
    return torch.device(name)


def _validation_data(cfg: TrialConfig, dataset: Dataset, stream: SecureStream) -> Dataset:
    if cfg.validation.split == "private":
        return hold_out(dataset, cfg.validation.fraction, stream)
    if dataset.x_val is None or not dataset.val_public:
        raise ValueError(
            f"validation.split: dataset {dataset.name!r} has no public validation "
            "split; use 'private' (with validation.noise)"
        )
    return dataset


def _epoch_metrics(
    model: nn.Module, data: Dataset, epoch: int, batch_size: int
) -> list[dict[str, Any]]:
    """Training metrics on at most TRAIN_EVAL_EXAMPLES examples spread evenly over the
    training set: not its first ones, which in a dataset stored by class (heavy_tail) would
    leave the rare classes' groups out. Evaluated ``batch_size`` examples at a time.

    Total over the data (docs/design.md, invariant 13): every value is a finite number or None
    (a loss where some example's logits are not finite, :func:`workers.metrics.evaluate`), so
    that a planted record cannot make a row that no report can carry."""
    every = -(-data.size // TRAIN_EVAL_EXAMPLES)
    x, y = data.x[::every], data.y[::every]
    train = evaluate(model, x, y, batch_size)
    rows = [("train_loss", train.loss, "private"), ("train_accuracy", train.accuracy, "private")]
    if data.class_group is not None:
        by_group = group_accuracy(train.predictions, y, data.class_group)
        rows += [(f"train_accuracy_group{g}", a, "private") for g, a in by_group.items()]
    if data.x_val is not None:
        val = evaluate(model, data.x_val, data.y_val, batch_size)  # type: ignore[arg-type]
        visibility = "public" if data.val_public else "private"
        rows += [("val_loss", val.loss, visibility), ("val_accuracy", val.accuracy, visibility)]
    return [{"epoch": epoch, "name": n, "value": v, "visibility": vis} for n, v, vis in rows]


@dataclass(frozen=True)
class Privacy:
    """The trial's privacy parameters, fixed before any training data is touched."""

    sample_rate: float
    steps: int
    noise_multiplier: float  # σ: what the trial costs (DP-SGD with σ, Theorem 2)
    grad_noise: float  # σ_T: what the gradient gets after the rule's release
    validation_rdp: np.ndarray | None  # the private selection score's Gaussian mechanism

    def epsilon(self, delta: float) -> tuple[float, float]:
        rdp = trial_rdp(self.sample_rate, self.noise_multiplier, self.steps, self.validation_rdp)
        return epsilon_from_rdp(rdp, delta)


def plan_privacy(cfg: TrialConfig, size: int) -> Privacy:
    """q = B/N and T = epochs·N/B for the dataset's full (registered) size N, and σ given or
    calibrated so that the whole trial (validation included) costs ``target_epsilon`` at δ."""
    q = sample_rate(cfg.batch_size, size)
    steps = num_steps(size, cfg.batch_size, cfg.epochs)
    noise = cfg.validation.noise
    val_rdp = gaussian_rdp(noise) if cfg.validation.split == "private" and noise else None
    sigma = cfg.noise_multiplier or calibrate_noise(
        q, steps, cfg.target_epsilon, cfg.delta, extra_rdp=val_rdp
    )  # type: ignore[arg-type]
    return Privacy(q, steps, sigma, gradient_noise(cfg.method, cfg.batch_size, sigma), val_rdp)


def replayed_rows(cfg: TrialConfig, device: torch.device) -> int | None:
    """On a GPU, the rows every micro-batch of a built-in model is padded to, so that its
    clipper calls replay one CUDA graph (:mod:`workers.dp.graphed`): the expected batch B plus
    four standard deviations of the Poisson size (|𝓑_t| ≤ B + 4√B but in about 3·10⁻⁵ of steps,
    which take a second micro-batch), in multiples of 8, at most the physical batch size. A
    model of the analyst's own is not replayed: a recorded call would skip whatever its
    ``forward`` does in Python."""
    if device.type != "cuda" or cfg.model.factory is not None:
        return None
    rows = 8 * math.ceil((cfg.batch_size + 4 * math.sqrt(cfg.batch_size)) / 8)
    return min(rows, cfg.physical_batch_size)


def build_engine(
    cfg: TrialConfig,
    model: nn.Module,
    privacy: Privacy,
    randomness: TrialRandomness,
    padded_rows: int | None = None,
) -> PrivateStep:
    groups = resolve_groups(
        model, cfg.method.groups if cfg.method.style == "groups" else cfg.method.style
    )
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rule = build_rule(
        cfg.method,
        expected_batch_size=cfg.batch_size,
        steps=privacy.steps,
        grad_noise=privacy.grad_noise,
        num_params=num_params,
        stream=randomness.release,
    )
    return PrivateStep(
        model,
        nn.CrossEntropyLoss(reduction="none"),
        groups,
        get_clipper(cfg.method.per_sample),
        clipping=cfg.method.clipping,
        gamma=cfg.method.gamma,
        rule=rule,
        grad_noise=privacy.grad_noise,
        expected_batch_size=cfg.batch_size,
        optimizer=build_optimizer(cfg.optimizer, model),
        noise=randomness.gradient,
        draw_ahead=spare_core(),
        padded_rows=padded_rows,
    )


def _score(
    cfg: TrialConfig,
    model: nn.Module,
    data: Dataset,
    registered_size: int,
    stream: SecureStream,
    batch_size: int,
) -> dict[str, Any]:
    """The selection score: public validation accuracy, or the private one released through
    the Gaussian mechanism (docs/design.md, invariant 5), divided by the hold-out's expected
    size. Evaluated ``batch_size`` examples at a time."""
    val = evaluate(model, data.x_val, data.y_val, batch_size)  # type: ignore[arg-type]
    noise = cfg.validation.noise if cfg.validation.split == "private" else None
    value = (
        val.accuracy
        if noise is None
        else noisy_accuracy(val.correct, cfg.validation.fraction * registered_size, noise, stream)
    )
    return {"name": "val_accuracy", "value": value, "split": cfg.validation.split, "noise": noise}


def run_trial(
    cfg: TrialConfig,
    on_step: StepCallback | None = None,
    on_epoch: EpochCallback | None = None,
    data_dir: Path | None = None,
) -> TrialOutcome:
    """Train one model; ``on_step(t, T)`` after each logical step (what ran so far is what
    must be charged), ``on_epoch(rows)`` with each epoch's metric rows; relative ``npz:``
    paths are resolved against ``data_dir``."""
    started = time.perf_counter()
    device = resolve_device(cfg.device)
    randomness = TrialRandomness()  # fresh OS entropy for every attempt (invariant 8)
    reading = time.perf_counter()
    full = load_cached(cfg.dataset, data_dir)
    loaded = time.perf_counter()
    privacy = plan_privacy(cfg, full.size)  # before any hold-out: see workers.dp.sampling
    data = _validation_data(cfg, full, randomness.holdout)
    data = replace(  # copies: the loaded arrays are shared with the process's next trials
        data,
        x=data.x.to(device, copy=True),
        y=data.y.to(device, copy=True),
        x_val=data.x_val.to(device, copy=True),
        y_val=data.y_val.to(device, copy=True),
    )  # type: ignore[union-attr]
    randomness.seed_torch(device)
    model = build_model(cfg.model, data.input_shape, data.num_classes).to(device)
    initial = InitialState.capture(model)  # before it sees data: what the release starts from
    rows = replayed_rows(cfg, device)
    engine = build_engine(cfg, model, privacy, randomness, rows)

    thresholds, metrics, epoch = [], [], 0
    train_started_at, train_start = time.time(), time.perf_counter()
    batches = poisson_batches(data.size, privacy.sample_rate, privacy.steps, randomness.sampling)
    # on CPU, micro-batches halved while that saves page faults and time (workers.dp.physical);
    # evaluation takes batches of the same size: their tensors are the forward pass's
    physical = PhysicalBatches(rows or cfg.physical_batch_size, adapt=device.type == "cpu")
    for t, indices in enumerate(batches):
        chunks = [(data.x[i], data.y[i]) for i in physical.split(indices.to(device))]
        initial.restore(model)
        with physical.measure(len(indices)):
            thresholds.append(engine.step(chunks, t).threshold)
        if on_step:
            on_step(t + 1, privacy.steps)
        # rows at each epoch's end; a partial last one (2.99 epochs of rounded steps) is one more
        ended = int((t + 1) * privacy.sample_rate + 1e-9)
        if ended > epoch or t + 1 == privacy.steps:
            epoch = max(ended, epoch + 1)
            initial.restore(model)
            rows = _epoch_metrics(model, data, epoch, physical.size)
            metrics += rows
            if on_epoch:
                on_epoch(rows)

    trained = time.perf_counter()
    initial.restore(model)  # the score, too, from the state as built but for the DP updates
    epsilon, order = privacy.epsilon(cfg.delta)
    result = {
        "config": cfg.model_dump(mode="json"),
        "dataset": {
            "name": data.name,
            "size": full.size,
            "train_size": data.size,
            "classes": data.num_classes,
            "splits": data.splits,
        },
        "sample_rate": privacy.sample_rate,
        "steps": privacy.steps,
        "noise_multiplier": privacy.noise_multiplier,
        "grad_noise_multiplier": privacy.grad_noise,
        "release_noise_multiplier": release_noise(cfg.method, cfg.batch_size),
        "groups": len(engine.groups),
        "epsilon": epsilon,
        "delta": cfg.delta,
        "rdp_order": order,
        "thresholds": thresholds if cfg.method.adaptive else None,
        "metrics": metrics,
        "score": _score(cfg, model, data, full.size, randomness.validation, physical.size),
        "wall_time_s": time.perf_counter() - started,
        # where the time went: reading the data (once per process), the training loop (steps
        # and epoch metrics) and when it began, to line up with the runner's start-up; and the
        # physical batch size the steps ended with (it depends on realized batch sizes)
        "timings": {
            "load_s": loaded - reading,
            "train_started_at": train_started_at,
            "train_s": trained - train_start,
            "physical_batch_size": physical.size,
        },
        "device": str(device),
    }
    return TrialOutcome(result, model, initial)


def error_message(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.trial", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="trial config (JSON)")
    parser.add_argument("--out", required=True, type=Path, help="where to write the result")
    args = parser.parse_args(argv)
    from rich.progress import Progress

    try:
        cfg = TrialConfig.model_validate_json(args.config.read_text())
        with Progress(transient=True) as progress:
            task = progress.add_task("DP training", total=None)
            outcome = run_trial(
                cfg, on_step=lambda t, total: progress.update(task, completed=t, total=total)
            )
    except ValidationError as err:
        print(f"invalid config: {error_message(err)}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as err:
        print(f"invalid config: {err}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(outcome.result, indent=2))
    r = outcome.result
    print(
        f"{r['steps']} steps, σ = {r['noise_multiplier']:.3f}, ε = {r['epsilon']:.3f} at "
        f"δ = {r['delta']:g}, score ({r['score']['split']}) = {r['score']['value']:.4f}, "
        f"{r['wall_time_s']:.1f}s on {r['device']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
