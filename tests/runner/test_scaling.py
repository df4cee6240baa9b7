"""A scaling job's search (``runner.search``): the cheap runs, the line fitted through their
levels' best r = lr·T, and the final run's learning rate (Panda et al., ICML 2024)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.config import DatasetConfig
from core.plan import Plan
from core.spec import JobSpec, lr_range
from runner.job import JobContext, param_space
from runner.search import final_candidate, fit_slope, scaling_candidates
from runner.summary import TrialRow, show

STEPS = 20
LEVEL_EPSILONS = (0.25, 0.5)
FINAL_EPSILON = 1.5


def _shape(level: int, sigma: float) -> dict[str, Any]:
    return {
        "batch_size": 64,
        "epochs": 1.0,
        "sample_rate": 0.05,
        "steps": STEPS,
        "noise_multiplier": sigma,
        "gradient_noise_multiplier": sigma,
        "trial_epsilon": [*LEVEL_EPSILONS, FINAL_EPSILON][level],
        "level": level,
    }


PLAN = Plan.model_validate(
    {
        "accounting": "rdp",
        "sample_rate": None,
        "noise_multiplier": None,
        "gradient_noise_multiplier": None,
        "steps": None,
        "shapes": [_shape(0, 8.0), _shape(1, 4.0), _shape(2, 1.5)],
        "validation_noise": None,
        "trials": {"distribution": "fixed", "mean": 5, "max": 5},
        "attempts_reserved": 5,
        "trial_epsilon": FINAL_EPSILON,
        "epsilon": 2.0,
        "delta": 1e-5,
        "method": {"kind": "rdp", "trials": 5},
        "defaults": {},
        "scaling": {
            "levels": [
                {"epsilon": e, "noise_multiplier": s, "trials": 2}
                for e, s in zip(LEVEL_EPSILONS, (8.0, 4.0), strict=True)
            ],
            "final": {"epsilon": FINAL_EPSILON, "noise_multiplier": 1.5, "trials": 1},
            "cheap_epsilon": 1.0,
        },
    }
)


def _spec(grid: list[float], mode: str = "max") -> JobSpec:
    return JobSpec.model_validate(
        {
            "dataset": 1,
            "model": {"name": "logreg"},
            "search_space": {"optimizer.lr": {"grid": grid}},
            "privacy": {"epsilon": 2.0, "accounting": "rdp"},
            "selection": {"mode": mode},
            "scaling": {},
        }
    )


@given(
    slope=st.floats(0.01, 1000),
    xs=st.lists(st.floats(0.01, 10), min_size=1, max_size=4, unique=True),
)
def test_the_fit_is_exact_on_a_line_through_the_origin(slope, xs):
    assert fit_slope([(x, slope * x) for x in xs]) == pytest.approx(slope, rel=1e-9)


@pytest.mark.parametrize(
    ("points", "slope"),
    [
        ([(1.0, 1.0), (2.0, 3.0)], 7 / 5),  # Σεr/Σε² = (1 + 6)/(1 + 4)
        ([(0.5, 10.0), (1.0, 10.0)], 15 / 1.25),  # tied levels: still a rising line
        ([(0.5, 20.0), (1.0, 10.0)], 20 / 1.25),  # swapped by noise: still rising
    ],
)
def test_the_fit_is_least_squares_through_the_origin(points, slope):
    assert fit_slope(points) == pytest.approx(slope)


def test_the_cheap_runs_are_every_lr_at_every_level():
    runs = scaling_candidates(_spec([0.1, 1.0]), 2)
    assert runs == [
        {"optimizer.lr": 0.1, "scaling.level": 0},
        {"optimizer.lr": 1.0, "scaling.level": 0},
        {"optimizer.lr": 0.1, "scaling.level": 1},
        {"optimizer.lr": 1.0, "scaling.level": 1},
    ]


@pytest.mark.parametrize("mode", ["max", "min"])
@pytest.mark.parametrize(("best0", "best1"), [(0.1, 0.2), (0.2, 0.4), (0.4, 0.2), (0.1, 0.1)])
def test_the_final_lr_extrapolates_the_levels_best(mode, best0, best1):
    """Each level's best r by its score, the line through the origin fitted to them, lr = r/T
    at the final ε, at least the top level's best."""
    grid = [0.1, 0.2, 0.4]
    sign = 1 if mode == "max" else -1
    finished = [
        ({"optimizer.lr": lr, "scaling.level": level}, sign * (1.0 if lr == best else 0.5))
        for level, best in ((0, best0), (1, best1))
        for lr in grid
    ]
    final = final_candidate(_spec(grid, mode), PLAN, finished)
    r0, r1 = best0 * STEPS, best1 * STEPS
    e0, e1 = LEVEL_EPSILONS
    slope = (e0 * r0 + e1 * r1) / (e0**2 + e1**2)
    r = slope * FINAL_EPSILON
    _, high = lr_range(_spec(grid).search_space["optimizer.lr"])
    assert final is not None
    assert final["scaling.level"] == 2
    assert final["scaling.slope"] == pytest.approx(slope)
    assert final["scaling.r"] == pytest.approx(r)
    assert final["optimizer.lr"] == pytest.approx(min(max(r, r1) / STEPS, high))


def test_the_final_lr_is_kept_within_a_stretch_of_the_search():
    """A line rising steeply leaves the final run at ten times the largest rate searched."""
    grid = [0.01, 1.0]
    finished = [
        ({"optimizer.lr": 1.0, "scaling.level": 0}, 0.9),
        ({"optimizer.lr": 1.0, "scaling.level": 1}, 0.9),
    ]
    plan = PLAN.model_copy(deep=True)
    assert plan.scaling is not None
    plan.scaling.final.epsilon = 50.0  # r = 100·ε·STEPS/… far past the search
    final = final_candidate(_spec(grid), plan, finished)
    assert final is not None
    assert final["scaling.r"] / STEPS > 10.0 and final["optimizer.lr"] == 10.0
    # the trial runs what the runner chose: the spec keeps a scaling run's lr in the same range
    config = _spec(grid).trial_config(
        DatasetConfig(source="builtin:digits"), PLAN.shapes[2], 1e-5, final
    )
    assert config.optimizer.lr == final["optimizer.lr"]
    assert config.noise_multiplier == PLAN.shapes[2].noise_multiplier
    too_far = {**final, "optimizer.lr": 50.0}  # a runner's lr past the range is kept in it
    assert (
        _spec(grid)
        .trial_config(DatasetConfig(source="builtin:digits"), PLAN.shapes[2], 1e-5, too_far)
        .optimizer.lr
        == 10.0
    )


def test_no_finished_run_no_final_and_a_lost_level_is_left_out():
    spec = _spec([0.1, 0.2])
    assert final_candidate(spec, PLAN, []) is None
    final = final_candidate(spec, PLAN, [({"optimizer.lr": 0.2, "scaling.level": 1}, 0.7)])
    assert final is not None  # the line through the origin and the one level left
    assert final["optimizer.lr"] == pytest.approx(0.2 * FINAL_EPSILON / LEVEL_EPSILONS[1])


def _context() -> JobContext:
    runs = scaling_candidates(_spec([0.1, 0.2]), 2)
    final = final_candidate(_spec([0.1, 0.2]), PLAN, [(runs[0], 0.5), (runs[3], 0.6)])
    assert final is not None
    return JobContext(
        7, "http://control", "dpr_x", Path("/nonexistent"), _spec([0.1, 0.2]), PLAN,
        DatasetConfig(source="builtin:digits"), 5, [*runs, final], first=4,
    )  # fmt: skip


def test_the_final_search_runs_the_final_run_alone():
    [trial] = param_space(_context())["trial"]["grid_search"]
    assert trial["index"] == 4 and trial["params"]["scaling.level"] == 2


def test_the_log_shows_each_runs_level_and_the_fit():
    ctx = _context()
    rows = [
        TrialRow(i, c, "finished", STEPS, 0.5 + i / 10, 1) for i, c in enumerate(ctx.candidates)
    ]
    out = io.StringIO()
    show(ctx, rows, 4, (2.0, 1e-5), file=out)
    text = out.getvalue().replace("\u00a0", " ")
    assert "scaling.level" in text and "scaling: r = " in text
    assert "released: trial 4" in text
