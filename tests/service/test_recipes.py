"""The planner's defaults for a spec's method and learning rate (:mod:`service.recipes`): a spec
that names no method gets the one that wins untuned, each clipping rule gets its own SGD rate,
every default is explained in the plan, and whatever a spec names is kept exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from core.config import MethodConfig
from core.spec import JobSpec
from service import recipes
from service.db import Dataset
from service.planning import plan_job

from .conftest import make_spec

N = 1294  # digits' private training rows in bench/tuning_accuracy.py


def _spec(method: dict[str, Any] | None, optimizer: str = "sgd", **body: Any) -> JobSpec:
    """A spec leaving out the learning rate (and the method, when ``method`` is None)."""
    spec = make_spec(1) | {"search_space": {}, "optimizer": {"name": optimizer}} | body
    if method is None:
        del spec["method"]
    else:
        spec["method"] = method
    return JobSpec.model_validate(spec)


@pytest.mark.parametrize(
    ("optimizer", "chosen", "named"),
    [("sgd", {"clipping": "auto_s"}, "AUTO-S")]
    + [(o, {"adaptive": {"rule": "dcsgd_e"}}, "DC-SGD-E") for o in ("adam", "adamw", "adambc")],
)
@pytest.mark.parametrize(
    "search", [{}, {"optimizer.lr": {"grid": [0.1, 0.3]}}, {"batch_size": {"grid": [32, 64]}}]
)
def test_a_spec_naming_no_method_gets_its_optimizers_winner_and_the_plan_says_why(
    optimizer, chosen, named, search
):
    filled, why = recipes.fill(_spec(None, optimizer, search_space=search), N)
    assert filled.method == MethodConfig.model_validate(chosen)
    assert filled.method == recipes.default_method(optimizer)
    assert named in why["method"] and "docs/results.md" in why["method"]
    if "optimizer.lr" not in search:  # the rate is the filled method's, for the trials' T
        steps = None if "batch_size" in search else _steps(filled.epochs, filled.batch_size)
        assert filled.optimizer.lr == recipes.learning_rate([optimizer], filled.method, steps)


@pytest.mark.parametrize(
    "search",
    [
        {"method.threshold": {"grid": [0.1, 1.0]}},
        {"method.clipping": {"grid": ["abadi", "auto_s"]}},
        {"optimizer.name": {"grid": ["adam", "adambc"]}},
    ],
)
def test_a_search_the_default_was_not_chosen_for_keeps_the_base_method(search):
    """A searched method field or optimizer: the default was measured for neither candidate
    set, so the contract's base method (DP-SGD) is kept."""
    spec = _spec(None, search_space=search)
    filled, why = recipes.fill(spec, N)
    assert filled.method == spec.method == MethodConfig()
    assert "method" not in why


METHODS = st.fixed_dictionaries(
    {"clipping": st.sampled_from(["abadi", "auto_s", "auto_v"])},
    optional={
        "threshold": st.sampled_from([0.1, 0.5, 1.0, 4.0]),
        "gamma": st.sampled_from([0.01, 0.1]),
        "adaptive": st.sampled_from(
            [{"rule": r} for r in ("dcsgd_p", "dcsgd_e", "andrew", "du")] + [None]
        ),
    },
)


@given(method=st.one_of(st.just({}), METHODS), optimizer=st.sampled_from(["sgd", "adam"]))
def test_a_named_method_is_kept_exactly_and_a_filled_spec_is_not_filled_again(method, optimizer):
    try:
        spec = _spec(method, optimizer)
    except ValidationError:  # a combination the contract refuses: nothing to fill
        return
    filled, why = recipes.fill(spec, N)
    assert filled.method == spec.method and "method" not in why
    stored = JobSpec.model_validate(filled.model_dump())  # as the job's spec is stored
    assert recipes.fill(stored, N) == (stored, {})


@pytest.mark.parametrize(
    ("optimizer", "steps"), [("sgd", 200), ("adam", 400), ("adamw", 400), ("adambc", 400)]
)
@pytest.mark.parametrize("n", [60, 1294, 3600, 60_000])
def test_the_default_epochs_give_about_the_optimizers_steps_and_the_plan_says_so(
    optimizer, steps, n
):
    """Adam's and DP-AdamBC's normalised steps did best at about 400 steps, SGD's fixed rates
    were swept at 200 (docs/results.md): T = epochs·N/B lands within one epoch's steps of the
    target (or at the epochs' bounds)."""
    filled, why = recipes.fill(
        JobSpec.model_validate(
            {**make_spec(1), "optimizer": {"name": optimizer}, "search_space": {}}
            | {"batch_size": None, "epochs": None}
        ),
        n,
    )
    batch, epochs = filled.batch_size, filled.epochs
    assert batch == recipes.batch_size(n)
    per_epoch = n / batch
    assert epochs in (recipes.MIN_EPOCHS, recipes.MAX_EPOCHS) or (
        steps <= epochs * per_epoch < steps + per_epoch
    )
    assert why["epochs"].startswith(f"{epochs:g}: about {steps} steps of batch {batch}")


def test_a_search_over_optimizers_gets_the_fewest_steps_of_them():
    spec = make_spec(1) | {"batch_size": None, "epochs": None, "method": {"clipping": "abadi"}}
    spec["search_space"] = {"optimizer.name": {"grid": ["adam", "sgd"]}}
    spec["optimizer"] = {"lr": 0.01}
    filled, why = recipes.fill(JobSpec.model_validate(spec), 1294)
    assert filled.epochs == recipes.epochs(1294, filled.batch_size, 200)
    assert "about 200 steps" in why["epochs"]
    adam_only = spec | {"search_space": {"optimizer.name": {"grid": ["adam", "adamw"]}}}
    assert recipes.fill(JobSpec.model_validate(adam_only), 1294)[0].epochs == recipes.epochs(
        1294, filled.batch_size, 400
    )


@pytest.mark.parametrize(
    "search",
    [{}, {"optimizer.name": {"grid": ["adam", "adambc"]}}, {"batch_size": {"grid": [32, 64]}}],
)
def test_adambc_gets_its_rate_and_a_floor_in_units_of_the_noise_and_the_plan_says_why(search):
    spec = _spec({"clipping": "abadi"}, "adambc", search_space=search)
    filled, why = recipes.fill(spec, N)
    assert filled.optimizer.noise_floor == recipes.ADAMBC_NOISE_FLOOR
    assert filled.optimizer.gamma_prime == spec.optimizer.gamma_prime  # the paper's γ′ kept
    assert why["optimizer.noise_floor"].startswith(f"{recipes.ADAMBC_NOISE_FLOOR:g}: ")
    if "optimizer.name" not in search:
        assert filled.optimizer.lr == recipes.ADAMBC_LR
        assert "DP-AdamBC" in why["optimizer.lr"]


@pytest.mark.parametrize(
    ("optimizer", "search"),
    [
        ({"name": "adambc", "gamma_prime": 1e-6}, {}),  # a floor of its own: the paper's rule
        ({"name": "adambc", "noise_floor": 0.0}, {}),
        ({"name": "adam"}, {}),  # no DP-AdamBC trial
        ({"name": "sgd", "lr": 0.1}, {"optimizer.name": {"grid": ["sgd", "adam"]}}),
    ],
)
def test_a_floor_the_spec_chooses_or_no_adambc_trial_is_left_alone(optimizer, search):
    spec = JobSpec.model_validate(make_spec(1) | {"optimizer": optimizer, "search_space": search})
    filled, why = recipes.fill(spec, N)
    assert filled.optimizer.noise_floor == spec.optimizer.noise_floor
    assert "optimizer.noise_floor" not in why


@pytest.mark.parametrize(
    ("grid", "lr"),
    [
        (["adam", "adamw"], recipes.ADAM_LR),
        (["adam", "adambc"], recipes.ADAM_LR),  # Adam's rate serves DP-AdamBC under its floor
        (["adambc"], recipes.ADAMBC_LR),
        (["sgd"], recipes.SGD_LR),  # DP-SGD at C = 1: the base method of a searched optimizer
    ],
)
def test_a_search_over_optimizers_gets_the_rate_of_all_of_them(grid, lr):
    """The one rate every trial gets is chosen for the optimizers the search may run, not for
    the spec's base ``optimizer.name`` (``sgd`` by default: its rate 0.5 made Adam diverge)."""
    spec = make_spec(1) | {"optimizer": {}, "search_space": {"optimizer.name": {"grid": grid}}}
    filled, why = recipes.fill(JobSpec.model_validate(spec), N)
    assert filled.optimizer.lr == pytest.approx(lr)
    assert why["optimizer.lr"].startswith(f"{lr:g}")


@pytest.mark.parametrize("grid", [["sgd", "adam"], ["adambc", "sgd", "adamw"]])
def test_a_search_across_sgd_and_adam_needs_a_rate_and_the_plan_names_the_field(api, grid):
    dataset = api.register(epsilon=8.0)["id"]
    body = make_spec(dataset, 2.0) | {"search_space": {"optimizer.name": {"grid": grid}}}
    body["optimizer"] = {}
    before = api.client.get(f"/v1/datasets/{dataset}/budget", headers=api.operator).json()
    for path in ("/v1/plans", "/v1/jobs"):
        r = api.client.post(path, headers=api.operator, json=body)
        assert r.status_code == 422, r.text
        assert "optimizer.lr" in r.text and "search it" in r.text
    after = api.client.get(f"/v1/datasets/{dataset}/budget", headers=api.operator).json()
    assert after == before  # nothing reserved
    given = body | {"optimizer": {"lr": 0.05}}
    assert api.client.post("/v1/plans", headers=api.operator, json=given).status_code == 200


@pytest.mark.parametrize("clipping", ["auto_s", "auto_v"])
@pytest.mark.parametrize("gamma", [0.01, 0.5])
def test_automatic_clipping_gets_its_own_sgd_rate(clipping, gamma):
    method = {"clipping": clipping, "gamma": gamma, "threshold": 4.0}
    filled, why = recipes.fill(_spec(method, epochs=10, batch_size=64), N)
    assert filled.optimizer.lr == 1.39  # 202 steps: 1.4·200/202 = 1.386; no threshold in it
    grid = ", ".join(f"{r:g}" for r in recipes.AUTO_SGD_SWEEP)
    assert clipping in why["optimizer.lr"] and grid in why["optimizer.lr"]
    assert "T = 202 steps" in why["optimizer.lr"]
    assert recipes.AUTO_SGD_LR in recipes.AUTO_SGD_SWEEP


def _steps(epochs: float, batch: int) -> int:
    return round(epochs * N / batch)


@settings(deadline=None)
@given(epochs=st.integers(1, 100), batch=st.sampled_from([16, 64, 256, 1024]))
def test_automatic_clippings_rate_keeps_the_distance_lr_times_steps(epochs, batch):
    """At T steps the rate is 1.4·200/T, the distance lr·T = 280 of the sweep's 1.4 at 200
    steps, to 3 significant digits; below 100 steps it stays at 100's, 2.8."""
    filled, why = recipes.fill(_spec(None, epochs=epochs, batch_size=batch), N)
    assert filled.method.clipping == "auto_s"
    steps = _steps(epochs, batch)
    assert filled.optimizer.lr * max(steps, 100) == pytest.approx(280, rel=5e-3)
    assert f"T = {steps} steps" in why["optimizer.lr"]


@pytest.mark.parametrize(("epochs", "rate"), [(40, 1.4), (80, 0.7), (20, 2.8), (5, 2.8)])
def test_automatic_clippings_rate_on_the_bench_digits(epochs, rate):
    """The bench's digits shapes (B = 256): T ≈ 200 (the recipe's), 400 (1.4 diverged there at
    ε = 1), 100, and 25 (below the shortest measured: 100's rate)."""
    filled, _ = recipes.fill(_spec(None, epochs=epochs, batch_size=256), N)
    assert filled.optimizer.lr == pytest.approx(rate, rel=0.02)


def test_trials_of_several_lengths_get_the_swept_rate():
    search = {"epochs": {"grid": [10, 40]}}
    filled, why = recipes.fill(_spec(None, batch_size=256, search_space=search), N)
    assert filled.optimizer.lr == recipes.AUTO_SGD_LR
    assert "shapes differ in T" in why["optimizer.lr"]


@pytest.mark.parametrize("threshold", [0.1, 0.5, 1.0, 2.0, 10.0])
def test_abadi_keeps_its_rate_per_unit_of_threshold(threshold):
    filled, why = recipes.fill(_spec({"clipping": "abadi", "threshold": threshold}), N)
    assert filled.optimizer.lr == pytest.approx(recipes.SGD_LR / threshold)
    assert f"{recipes.SGD_LR:g}/C with C = {threshold:g}" in why["optimizer.lr"]
    adam, _ = recipes.fill(_spec({"clipping": "abadi", "threshold": threshold}, "adam"), N)
    assert adam.optimizer.lr == recipes.ADAM_LR


@pytest.mark.parametrize("rule", ["dcsgd_p", "dcsgd_e", "andrew", "du"])
@pytest.mark.parametrize("initial", [0.5, 1.0, 4.0])
def test_an_adaptive_rule_scales_sgds_rate_by_its_initial_threshold(rule, initial):
    method = {"threshold": initial, "adaptive": {"rule": rule}}
    filled, why = recipes.fill(_spec(method), N)
    assert filled.optimizer.lr == pytest.approx(recipes.SGD_LR / initial)
    assert f"{recipes.SGD_LR:g}/C₀ with C₀ = {initial:g}" in why["optimizer.lr"]


def test_the_plan_endpoint_says_which_method_it_chose(api):
    dataset = api.register(epsilon=8.0)["id"]
    body = make_spec(dataset, 2.0) | {"search_space": {}, "optimizer": {"name": "sgd"}}
    del body["method"]
    r = api.client.post("/v1/plans", headers=api.operator, json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert "auto_s" in plan["defaults"]["method"]
    lr = plan["defaults"]["optimizer.lr"]
    assert ": automatic clipping (auto_s)" in lr and "T = " in lr
    adam = body | {"optimizer": {"name": "adam"}}
    plan = api.client.post("/v1/plans", headers=api.operator, json=adam).json()
    assert "dcsgd_e" in plan["defaults"]["method"]
    # DC-SGD-E's histogram is released out of σ (paper 001, Theorem 2): the rule really runs
    assert "method.adaptive.histogram_noise" in plan["defaults"]
    assert "method.adaptive.bins" in plan["defaults"]
    assert plan["gradient_noise_multiplier"] > plan["noise_multiplier"]
    named = api.client.post(
        "/v1/plans", headers=api.operator, json=adam | {"method": {"clipping": "abadi"}}
    ).json()
    assert "method" not in named["defaults"]
    assert named["gradient_noise_multiplier"] == named["noise_multiplier"]


@given(batch=st.integers(1, 4096), noise=st.floats(0.01, 1e4))
def test_dcsgd_e_gets_the_most_bins_that_keep_its_noisy_count_three_deviations_above_zero(
    batch, noise
):
    """√b·σ_H ≤ B/3 for the b chosen and not for b + 1, within [MIN_BINS, the paper's 20]."""
    bins = recipes.histogram_bins(batch, noise)
    assert recipes.MIN_BINS <= bins <= recipes.BINS == 20

    def fits(b: int) -> bool:
        return b**0.5 * noise <= batch / recipes.TOTAL_Z

    assert bins == recipes.MIN_BINS or fits(bins)
    assert bins == recipes.BINS or not fits(bins + 1)


def _planned(epsilon: float, method: dict[str, Any] | None = None, **body: Any) -> Any:
    """The plan of a spec leaving out the learning rate, batch size and epochs (and the method
    when ``method`` is None) with Adam, on data of digits' size, as the bench runs it."""
    spec = make_spec(1, epsilon, delta=1 / N) | {
        "model": {"name": "cnn"},
        "optimizer": {"name": "adam"},
        "validation": {"split": "public"},
        "search_space": {},
        "method": method,
    }
    del spec["batch_size"], spec["epochs"]
    if method is None:
        del spec["method"]
    data = Dataset(id=1, n=N, epsilon=100.0, delta=2 / N, public_validation=True, num_classes=10)
    return plan_job(JobSpec.model_validate(spec | body), data, None)


@pytest.mark.parametrize(("epsilon", "bins"), [(0.5, 4), (1.0, 4), (2.0, 12), (4.0, 20), (8.0, 20)])
def test_the_default_method_has_fewer_bins_where_its_histogram_noise_is_large(epsilon, bins):
    """Digits' recipe (B = 256, about 400 steps): at ε = 1, σ ≈ 10.6 and σ_H = 4σ ≈ 42, so the
    paper's 20 bins would leave the noisy count 256 ± 190 and the threshold wandering
    (docs/results.md); the plan takes the least, 4, and says why; at ε = 2 (σ_H ≈ 24) 12. At
    ε ≥ 4 the paper's 20 keep it 3 deviations above 0."""
    planned = _planned(epsilon)
    adaptive = planned.spec.method.adaptive
    assert adaptive.rule == "dcsgd_e" and adaptive.bins == bins
    assert bins == recipes.histogram_bins(planned.spec.batch_size, adaptive.histogram_noise)
    why = planned.plan.defaults["method.adaptive.bins"]
    assert why.startswith(f"{bins}: the paper's 20 bins") and "docs/results.md" in why


@pytest.mark.parametrize(
    "method",
    [
        {"adaptive": {"rule": "dcsgd_e", "bins": 20}},
        {"adaptive": {"rule": "dcsgd_p"}},
        {"adaptive": {"rule": "andrew"}},
        {"clipping": "abadi"},
    ],
)
def test_bins_a_spec_gives_or_another_rule_are_kept(method):
    planned = _planned(1.0, method)
    adaptive = planned.spec.method.adaptive
    assert adaptive is None or adaptive.bins == 20
    assert "method.adaptive.bins" not in planned.plan.defaults


def test_a_searched_batch_size_gets_the_bins_of_its_smallest_batch():
    searched = {"batch_size": {"grid": [128, 256]}}
    planned = _planned(2.0, search_space=searched)
    adaptive = planned.spec.method.adaptive
    smallest = recipes.histogram_bins(128, adaptive.histogram_noise)
    assert adaptive.bins == smallest < recipes.histogram_bins(256, adaptive.histogram_noise)


@pytest.mark.parametrize("n", [60, 1294, 60_000, 10**6])
def test_a_spec_leaving_out_validation_gets_a_private_score_of_small_std(n) -> None:
    """No public split: a private hold-out of the default fraction, its noise
    max(VALIDATION_NOISE_MIN, SCORE_STD·f·N) — std SCORE_STD where N allows, and the plan says
    which. A public split, when there is one, is used (it is free); a spec's own is kept."""
    body = make_spec(1)
    del body["validation"]
    spec = JobSpec.model_validate(body)
    filled, why = recipes.fill_validation(spec, n, public=False)
    validation = filled.validation
    assert validation.split == "private" and validation.fraction == 0.1
    std = validation.noise / (validation.fraction * n)
    assert validation.noise >= recipes.VALIDATION_NOISE_MIN
    assert (
        std == pytest.approx(recipes.SCORE_STD) or validation.noise == recipes.VALIDATION_NOISE_MIN
    )
    assert f"{std:.2g}" in why["validation"]
    public, why = recipes.fill_validation(spec, n, public=True)
    assert public.validation.split == "public" and why["validation"].startswith("public")
    own = JobSpec.model_validate(make_spec(1))
    assert recipes.fill_validation(own, n, public=False) == (own, {})


def test_the_plan_of_data_without_a_public_split_holds_out_a_private_score(api, settings) -> None:
    """Through the plan endpoint: a dataset without a public split (an npz file with no
    validation arrays) and a spec without ``validation``: planned, not refused; the plan's
    ``score_std`` is the chosen noise's."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4)).astype(np.float32)
    np.savez(settings.data_path / "plain.npz", x=x, y=rng.integers(0, 3, size=2000))
    dataset = api.register("plain", source="npz:plain.npz", num_classes=3, epsilon=8.0)
    assert not dataset["public_validation"]
    body = make_spec(dataset["id"], 2.0)
    del body["validation"]
    r = api.client.post("/v1/plans", headers=api.operator, json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["defaults"]["validation"].startswith("private")
    noise = max(recipes.VALIDATION_NOISE_MIN, recipes.SCORE_STD * 0.1 * dataset["n"])
    assert plan["validation_noise"] == pytest.approx(noise)
    assert plan["score_std"] == pytest.approx(noise / (0.1 * dataset["n"]))
