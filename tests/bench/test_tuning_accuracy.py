"""``bench/tuning_accuracy.py``'s own parts, without Ray: the jobs it POSTs (a valid spec under
every accounting, K equal to the grid size), the splits it keeps from the product, the scoring
of a released model file, and the tables of its results."""

from __future__ import annotations

import argparse
import json
import math
from types import ModuleType

import numpy as np
import pytest
import torch
from safetensors.torch import save

from core.config import ModelConfig
from core.spec import JobSpec
from workers.models import build_model


@pytest.fixture(scope="module")
def ta(bench) -> ModuleType:
    return bench("tuning_accuracy")


ONE_RUN = ["DC-SGD-P", "DC-SGD-E", "AUTO-S", "Andrew", "Du", "recipe", "default"]


@pytest.mark.parametrize("accounting", ["rdp", "lt", "ps"])
def test_every_method_is_a_valid_spec_with_the_grid_size_as_its_trial_count(
    ta, accounting: str
) -> None:
    table = ta.methods(ta.THRESHOLDS, quick=False)
    for name, method in table.items():
        if method.rdp_only and accounting != "rdp":
            continue  # plan_runs leaves them out: the product refuses them under lt/ps
        raw = ta.job_spec(7, ta.DATASETS["digits"], 1000, method, accounting, 2.0, 3, proxy=9)
        assert raw["privacy"]["epsilon"] == 2.0 and raw["privacy"]["delta"] == 1e-3
        k = len(method.candidates())
        if name == "shape":
            kind = "grid" if accounting == "rdp" else "values"
            assert raw["search_space"] == {
                "batch_size": {kind: [64, 128, 256]},
                "epochs": {kind: [5, 15, 30]},
            }
        spec = JobSpec.model_validate(raw)
        assert spec.grid_size() == (k if accounting == "rdp" else 1)
        assert spec.proxy == (9 if name == "proxy" else None)
        if name == "proxy":
            assert spec.trial_count() == 1 and spec.candidate_count() == k
        elif method.scaling:  # every rate at two levels, then the final run
            assert spec.trial_count() == 2 * k + 1 and spec.scaling is not None
        elif accounting == "rdp":
            assert spec.trial_count() == k and spec.seed == 3
        elif accounting == "lt":
            assert spec.privacy.expected_trials == k and spec.seed is None
        else:
            assert (spec.privacy.mean, spec.privacy.eta) == (k, 1)
        assert k == (
            1 if name in ONE_RUN else 9 if name == "shape" else 3 if method.scaling else 10
        )
        recipe = name in ("recipe", "default")
        shape = recipe or method.scaling  # batch size and epochs: the recipes'
        assert (spec.batch_size is None, spec.epochs is None) == (shape, shape)
        assert ("lr" in raw["optimizer"]) != recipe
        assert ("method" in raw) != (name == "default")  # the planner's default method


def test_a_proxy_runs_under_rdp_only_and_trains_on_the_public_part(ta, tmp_path) -> None:
    table = ta.methods(ta.QUICK_THRESHOLDS, quick=False)
    args = argparse.Namespace(
        seeds=1,
        datasets=["digits"],
        epsilons=[1.0],
        methods=["proxy", "recipe"],
        accountings=["rdp", "lt", "ps"],
        reference=[],
    )
    kinds = [(r.method, r.accounting) for r in ta.plan_runs(args, table)]
    assert kinds == [("proxy", "rdp"), ("recipe", "rdp"), ("recipe", "lt"), ("recipe", "ps")]
    x = np.arange(100, dtype=np.float32)[:, None]
    part = ta.split(x, np.arange(100) % 2, test=0.2, val=0.25)
    part.save_public(tmp_path / "p.npz")
    with np.load(tmp_path / "p.npz") as saved:
        assert np.array_equal(saved["x"], part.x_val) and np.array_equal(saved["y"], part.y_val)
        assert not set(saved["x"][:, 0].tolist()) & set(part.x[:, 0].tolist())


def test_a_reference_run_fixes_its_candidate_and_searches_nothing(ta) -> None:
    table = ta.methods(ta.THRESHOLDS, quick=False)
    setup = ta.DATASETS["digits"]
    raw = ta.job_spec(1, setup, 500, table["DP-SGD"], "rdp", 4.0, 0, {"method.threshold": 6.0})
    spec = JobSpec.model_validate(raw)
    assert spec.method.threshold == 6.0 and spec.search_space == {} and spec.trial_count() == 1
    shape = ta.job_spec(1, setup, 500, table["shape"], "rdp", 4.0, 0, {"batch_size": 64})
    assert shape["batch_size"] == 64 and shape["search_space"] == {}
    # a one-run method's reference is its rdp tuning job: one job serves both
    one = table["DC-SGD-E"]
    assert one.candidates() == [{}]
    assert ta.spec_key(ta.job_spec(1, setup, 500, one, "rdp", 4.0, 0)) == ta.spec_key(
        ta.job_spec(2, setup, 500, one, "rdp", 4.0, 0, {})
    )


def test_plan_runs_orders_by_epsilon_and_adds_every_reference_candidate(ta) -> None:
    table = ta.methods(ta.QUICK_THRESHOLDS, quick=True)
    args = argparse.Namespace(
        seeds=2,
        datasets=["digits"],
        epsilons=[1.0, 4.0],
        methods=["DP-SGD", "AUTO-S"],
        accountings=["rdp", "ps"],
        reference=["DP-SGD", "AUTO-S"],
    )
    runs = ta.plan_runs(args, table)
    # per seed and ε: 2 methods × 2 accountings + 3 thresholds + AUTO-S's one candidate
    assert len(runs) == 2 * 2 * (4 + 3 + 1)
    assert [r.epsilon for r in runs] == sorted(r.epsilon for r in runs)
    assert [r.seed for r in runs[:16]] == sorted(r.seed for r in runs[:16])
    assert {r.fixed["method.threshold"] for r in runs if r.fixed} == {0.1, 1.0, 10.0}


def test_splits_are_disjoint_and_the_test_part_never_reaches_the_file(ta, tmp_path) -> None:
    x = np.arange(200, dtype=np.float32)[:, None]
    y = np.arange(200) % 4
    part = ta.split(x, y, test=0.2, val=0.1)
    assert (len(part.y_test), len(part.y_val), len(part.y)) == (40, 16, 144)
    rows = [set(a[:, 0].tolist()) for a in (part.x, part.x_val, part.x_test)]
    assert set.union(*rows) == set(range(200)) and sum(map(len, rows)) == 200
    part.save(tmp_path / "d.npz")
    with np.load(tmp_path / "d.npz") as saved:
        assert sorted(saved.files) == ["x", "x_val", "y", "y_val"]
        assert not set(saved["x"][:, 0].tolist()) & rows[2]


def test_an_npz_keeps_its_own_test_and_validation_parts(ta, tmp_path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "x": rng.random((50, 3)),
        "y": rng.integers(0, 3, 50),
        "x_val": rng.random((5, 3)),
        "y_val": np.array([0, 1, 2, 0, 1]),
        "x_test": rng.random((7, 3)),
        "y_test": np.array([0, 1, 4, 0, 1, 0, 0]),
    }
    np.savez(tmp_path / "mine.npz", **arrays)
    part = ta.npz_split(tmp_path / "mine.npz")
    assert len(part.y) == 50 and np.array_equal(part.y_val, arrays["y_val"])
    assert np.array_equal(part.x_test, arrays["x_test"]) and part.num_classes == 5
    np.savez(tmp_path / "bare.npz", x=arrays["x"], y=arrays["y"])
    bare = ta.npz_split(tmp_path / "bare.npz")
    assert (len(bare.y_test), len(bare.y_val), len(bare.y)) == (10, 4, 36)


def test_the_released_model_is_rebuilt_from_its_file_and_scored(ta) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="logreg"), (1, 2, 2), 3)
    x = np.random.default_rng(1).random((30, 1, 2, 2)).astype(np.float32)
    y = model(torch.tensor(x)).argmax(1).numpy()  # the labels it predicts: accuracy 1
    y[:3] = (y[:3] + 1) % 3  # …but for three
    config = {"model": {"name": "logreg", "options": {}}, "method": {"threshold": 0.5}}
    data = save(
        model.state_dict(),
        metadata={
            "config": json.dumps(config),
            "dataset": json.dumps({"num_classes": 3, "input_shape": [1, 2, 2]}),
        },
    )
    accuracy, released = ta.released_accuracy(data, x, y)
    assert accuracy == pytest.approx(27 / 30) and released == config
    method = ta.methods(ta.THRESHOLDS, quick=False)["DP-SGD"]
    assert ta.searched_fields(released, method) == {"method.threshold": 0.5}


def _run(ta, method: str, accounting: str, eps: float, seed: int, acc, fixed=None, status=None):
    return ta.Run(
        "digits",
        method,
        accounting,
        eps,
        seed,
        fixed,
        status=status or "released",
        accuracy=acc,
        wall_s=None if status == "pending" else 40.0,
    )


def test_tables_give_mean_and_std_over_seeds_failures_and_the_best_reference(ta) -> None:
    runs = [
        _run(ta, "DP-SGD", "rdp", 1.0, 0, 0.80),
        _run(ta, "DP-SGD", "rdp", 1.0, 1, 0.90),
        _run(ta, "DP-SGD", "lt", 1.0, 0, None, status="refused"),
        _run(ta, "DP-SGD", "lt", 1.0, 1, None, status="pending"),  # never submitted: not shown
        _run(ta, "DP-SGD", "rdp", 1.0, 0, 0.70, {"method.threshold": 0.1}),
        _run(ta, "DP-SGD", "rdp", 1.0, 1, 0.72, {"method.threshold": 0.1}),
        _run(ta, "DP-SGD", "rdp", 1.0, 0, 0.95, {"method.threshold": 1.0}),
        _run(ta, "DP-SGD", "rdp", 1.0, 1, 0.85, {"method.threshold": 1.0}),
    ]
    best = ta.reference(runs)
    assert best[("digits", "DP-SGD", 1.0)] == ([0.95, 0.85], '{"method.threshold": 1.0}')
    text = ta.tables(runs, ["DP-SGD"], [1.0], seeds=2)
    std = 100 * math.sqrt(((0.80 - 0.85) ** 2 + (0.90 - 0.85) ** 2) / 1)
    assert f"| DP-SGD | 85.0 ± {std:.1f} (40) |" in text
    assert "| DP-SGD | — (40) [1 refused] |" in text
    assert "no tuning cost" in text and "| DP-SGD | 90.0 ± 7.1 |" in text


def test_plot_writes_a_png(ta, tmp_path) -> None:
    runs = [_run(ta, "AUTO-S", a, e, 0, 0.5 + e / 20) for a in ("rdp", "ps") for e in (1.0, 2.0)]
    ta.plot(runs, ["AUTO-S"], tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_repetition_is_its_own_job_and_a_one_run_reference_shares_the_rdp_job(ta) -> None:
    table = ta.methods(ta.QUICK_THRESHOLDS, quick=True)
    args = argparse.Namespace(
        seeds=2,
        datasets=["digits"],
        epsilons=[2.0],
        methods=["DC-SGD-E"],
        accountings=["rdp", "lt", "ps"],
        reference=["DC-SGD-E"],
    )
    runs = ta.plan_runs(args, table)
    setup = ta.DATASETS["digits"]

    def spec(run):
        method = table[run.method]
        return ta.job_spec(1, setup, 900, method, run.accounting, run.epsilon, run.seed, run.fixed)

    groups = ta.job_groups(runs, spec)
    # per seed: rdp (with its reference), lt, ps — lt and ps specs carry no seed, yet each
    # repetition is a job of its own
    assert len(groups) == 6
    assert sorted(len(g) for g in groups) == [1, 1, 1, 1, 2, 2]
    assert all(len({(r.seed, r.accounting) for r in g}) == 1 for g in groups)


def test_resume_keeps_only_released_runs_of_the_same_setting(ta) -> None:
    previous = [
        _run(ta, "AUTO-S", "rdp", 1.0, 0, 0.6),
        _run(ta, "AUTO-S", "lt", 1.0, 0, None, status="failed"),
        _run(ta, "AUTO-S", "rdp", 1.0, 1, 0.7, fixed={"method.threshold": 1.0}),
    ]
    runs = [ta.Run("digits", "AUTO-S", a, 1.0, s) for a in ("rdp", "lt") for s in (0, 1)]
    assert ta.resumed(runs, [ta.asdict(r) for r in previous]) == 1
    assert [(r.accuracy, r.status) for r in runs] == [
        (0.6, "released"),
        (None, "pending"),
        (None, "pending"),
        (None, "pending"),
    ]
    assert len(ta.job_groups(runs, lambda r: {"accounting": r.accounting})) == 3


def test_each_datasets_tables_show_only_the_epsilons_run_on_it(ta) -> None:
    runs = [_run(ta, "AUTO-S", "rdp", e, 0, 0.5) for e in (1.0, 4.0)]
    runs.append(ta.Run("mnist1d", "AUTO-S", "rdp", 4.0, 0, status="released", accuracy=0.6))
    text = ta.tables(runs, ["AUTO-S"], [1.0, 4.0], seeds=1)
    digits, mnist1d = text.split("**mnist1d, rdp**")
    assert "| method | ε = 1 | ε = 4 |" in digits
    assert "| method | ε = 4 |" in mnist1d and "ε = 1" not in mnist1d
    assert "| AUTO-S | 60.0 ± 0.0 |" in mnist1d


def test_reports_of_several_runs_merge_into_one(ta) -> None:
    def report(dataset: str, eps: list[float], runs: list[dict]) -> dict:
        return {
            "args": {"datasets": [dataset], "epsilons": eps, "methods": ["AUTO-S"], "seeds": 3},
            "datasets": {dataset: {"train": 10}},
            "methods": {"AUTO-S": {}},
            "elapsed_s": 60.0,
            "runs": runs,
        }

    done = ta.asdict(_run(ta, "AUTO-S", "rdp", 4.0, 0, 0.5))
    pending = ta.asdict(_run(ta, "AUTO-S", "rdp", 8.0, 0, None, status="pending"))
    one = report("digits", [4.0, 8.0], [done, pending])
    two = report("mnist1d", [1.0], [done | {"dataset": "mnist1d", "epsilon": 1.0}])
    out = ta.merged([one, two])
    assert out["args"]["datasets"] == ["digits", "mnist1d"]
    assert out["args"]["epsilons"] == [1.0, 4.0, 8.0] and out["elapsed_s"] == 120.0
    assert [(r["dataset"], r["epsilon"]) for r in out["runs"]] == [
        ("digits", 4.0),
        ("mnist1d", 1.0),
    ]
    assert set(out["datasets"]) == {"digits", "mnist1d"}
    assert one["args"]["datasets"] == ["digits"]  # the inputs are left as they were


def test_a_run_line_shows_a_sigma_only_where_the_plan_has_one(ta) -> None:
    one = ta.Run("digits", "recipe", "rdp", 1.0, 0, status="released", noise_multiplier=6.876)
    levels = ta.Run("digits", "scaling", "rdp", 1.0, 0, status="released")  # several σs
    assert " σ 6.88 " in ta._done(one) and " σ — " in ta._done(levels)
