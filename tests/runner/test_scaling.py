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
from core.spec import JobSpec
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
        ([(1.0, 1.0), (2.0, 3.0)], 1.5**0.8),  # ratios 1 and 1.5, weights 1 and 4
        ([(0.5, 10.0), (1.0, 10.0)], 10 * 2**0.2),  # tied levels: still a rising line
        ([(0.5, 20.0), (1.0, 10.0)], 10 * 4**0.2),  # swapped by noise: still rising
    ],
)
def test_the_fit_is_a_weighted_geometric_mean_of_the_slopes(points, slope):
    assert fit_slope(points) == pytest.approx(slope)


def test_a_noisy_low_level_moves_the_fit_by_its_share_of_the_log_grid():
    """The cheap level at a quarter of the top one's ε picks a rate 10× too large: the final
    rate moves by its weight's share (1/17) of the grid's log-width, not to about 1.5×."""
    top, low = (1.0, 1.0), (0.25, 0.25 * 10)
    assert fit_slope([low, top]) == pytest.approx(10 ** (1 / 17))


def test_the_cheap_runs_are_every_lr_at_every_level_scaled_down_to_it():
    runs = scaling_candidates(_spec([0.1, 1.0]), PLAN)
    e0, e1 = (e / FINAL_EPSILON for e in LEVEL_EPSILONS)
    assert runs == [
        {"optimizer.lr": 0.1 * e0, "scaling.level": 0},
        {"optimizer.lr": 1.0 * e0, "scaling.level": 0},
        {"optimizer.lr": 0.1 * e1, "scaling.level": 1},
        {"optimizer.lr": 1.0 * e1, "scaling.level": 1},
    ]


def _finished(grid: list[float], picks: tuple[float, float], sign: int = 1) -> list[Any]:
    """Every cheap run of ``grid``, the one of rate ``picks[level]`` (unscaled) best at its
    level (score 1 against 0.5, times ``sign``)."""
    runs = scaling_candidates(_spec(grid), PLAN)
    return [
        (run, sign * (1.0 if lr == picks[run["scaling.level"]] else 0.5))
        for run, lr in zip(runs, grid * len(LEVEL_EPSILONS), strict=True)
    ]


@pytest.mark.parametrize("mode", ["max", "min"])
@pytest.mark.parametrize(("best0", "best1"), [(0.1, 0.2), (0.2, 0.4), (0.4, 0.2), (0.1, 0.1)])
def test_the_final_lr_extrapolates_the_levels_best(mode, best0, best1):
    """Each level's best r by its score, the line through the origin fitted to them, lr = r/T
    at the final ε: the picks as final rates, their geometric mean with weights ε²."""
    grid = [0.1, 0.2, 0.4]
    finished = _finished(grid, (best0, best1), 1 if mode == "max" else -1)
    final = final_candidate(_spec(grid, mode), PLAN, finished)
    e0, e1 = LEVEL_EPSILONS
    w0, w1 = e0**2 / (e0**2 + e1**2), e1**2 / (e0**2 + e1**2)
    lr = best0**w0 * best1**w1
    assert final is not None
    assert final["scaling.level"] == 2
    assert final["scaling.slope"] == pytest.approx(lr * STEPS / FINAL_EPSILON)
    assert final["scaling.r"] == pytest.approx(lr * STEPS)
    assert final["optimizer.lr"] == pytest.approx(lr)


@given(
    grid=st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=5, unique=True),
    scores=st.lists(st.floats(0.0, 1.0), min_size=10, max_size=10),
    lost=st.sampled_from([None, 0, 1]),
)
def test_the_final_lr_stays_within_the_searched_rates(grid, scores, lost):
    """Whatever the scores (a level lost too), the final run's rate is between the smallest
    and the largest searched, and the trial runs it as chosen."""
    runs = scaling_candidates(_spec(grid), PLAN)
    finished = [
        (run, score)
        for run, score in zip(runs, scores, strict=False)
        if run["scaling.level"] != lost
    ]
    final = final_candidate(_spec(grid), PLAN, finished)
    assert final is not None
    assert min(grid) * (1 - 1e-12) <= final["optimizer.lr"] <= max(grid) * (1 + 1e-12)
    config = _spec(grid).trial_config(
        DatasetConfig(source="builtin:digits"), PLAN.shapes[2], 1e-5, final
    )
    assert config.optimizer.lr == pytest.approx(final["optimizer.lr"], rel=1e-12)


def test_the_trial_runs_a_cheap_rate_as_scaled_and_keeps_a_runner_rate_in_range():
    grid = [0.01, 1.0]
    spec, dataset = _spec(grid), DatasetConfig(source="builtin:digits")
    [cheap, *_] = scaling_candidates(spec, PLAN)
    config = spec.trial_config(dataset, PLAN.shapes[0], 1e-5, cheap)
    assert config.optimizer.lr == cheap["optimizer.lr"] < min(grid)
    assert config.noise_multiplier == PLAN.shapes[0].noise_multiplier
    too_far = {"optimizer.lr": 50.0, "scaling.level": 2}  # past the largest searched: kept at it
    assert spec.trial_config(dataset, PLAN.shapes[2], 1e-5, too_far).optimizer.lr == 1.0


def test_no_finished_run_no_final_and_a_lost_level_is_left_out():
    spec = _spec([0.1, 0.2])
    assert final_candidate(spec, PLAN, []) is None
    scaled = 0.2 * LEVEL_EPSILONS[1] / FINAL_EPSILON
    final = final_candidate(spec, PLAN, [({"optimizer.lr": scaled, "scaling.level": 1}, 0.7)])
    assert final is not None  # the line through the origin and the one level left
    assert final["optimizer.lr"] == pytest.approx(0.2)


def _context() -> JobContext:
    runs = scaling_candidates(_spec([0.1, 0.2]), PLAN)
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
