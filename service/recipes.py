"""Defaults for what a job spec leaves out: the method, batch size, epochs and the learning rate.

What matters most for DP-SGD at a fixed ε is the batch size, the number of steps (hence σ) and
the learning rate, and the literature agrees on the first two:

- *Large batches, kept for many steps.* At a fixed ε, σ grows far slower than B, so the noise
  per averaged gradient, σ/B, falls as B grows; accuracy then improves as long as the number
  of steps T is kept (De et al., "Unlocking High-Accuracy Differentially Private Image
  Classification through Scale", 2022, §3–4, B = 4096 on CIFAR-10; Sander et al., "TAN
  Without a Burn: Scaling Laws of DP-SGD", ICML 2023, who show that at a fixed σ/B accuracy
  depends on T). We take q = B/N near 1/4 on small datasets, B at most 4096, and enough
  epochs for :data:`TARGET_STEPS` steps: with Adam, of about 100, 200, 400 and 700 steps at a
  fixed ε, 400 did best on mnist1d and as well as any on digits (DP-AdamBC gained at 400
  too); SGD's fixed rates, swept at 200 steps, diverged at 400 on digits at ε = 1
  (docs/results.md, "More steps for Adam").
- *The learning rate, matched to the clipping.* With automatic clipping (AUTO-S/AUTO-V,
  Bu et al., "Automatic Clipping: Differentially Private Deep Learning Made Easier and
  Stronger", NeurIPS 2023, paper 003) every per-example gradient is normalized, so the
  threshold drops out and the learning rate is the only knob, with a recipe of its own; with
  Abadi clipping the update is at most the threshold C in norm, so the learning rate is scaled
  by 1/C. The values are the best of sweeps of single runs (cnn at ε = 2 with the batch and
  epochs above): Adam's 10⁻³ … 3·10⁻² and SGD's 0.25 … 8 at C = 1 on digits, automatic
  clipping's on digits and mnist1d (docs/results.md).
- *The method that wins untuned.* A spec that names no method gets the one that scored best
  in single untuned runs on the bench datasets with its optimizer (docs/results.md): with SGD,
  AUTO-S (paper 003), whose step has a fixed scale, so one rate serves; with the Adam family,
  whose step ignores the update's scale, DC-SGD-E (paper 001, Algorithm 4), whose threshold
  follows the gradients' norms. Neither needs the threshold search that DP-SGD does.
  DC-SGD-E's histogram keeps the paper's 20 bins unless its noise is large against the
  batch (a small ε), where fewer bins keep its noisy count, and so its threshold, steady
  (:func:`histogram_bins`).

Each default is explained in the plan (``Plan.defaults``).
"""

from __future__ import annotations

import math
from typing import Any

from core.config import AdaptiveConfig, MethodConfig, OptimizerName, ValidationConfig
from core.plan import score_std
from core.sampling import num_steps
from core.spec import JobSpec, endpoints
from service import planning

#: q = B/N is about this on datasets too small for :data:`MAX_BATCH`
SAMPLE_RATE = 0.25
MIN_BATCH, MAX_BATCH = 16, 4096
#: epochs are chosen so that a trial runs about this many steps, by optimizer: 400 where it
#: was measured to help (Adam, AdamW, the same step, and DP-AdamBC), 200 where SGD's rates were
#: swept
TARGET_STEPS: dict[OptimizerName, int] = {"sgd": 200, "adam": 400, "adamw": 400, "adambc": 400}
#: ... within these bounds
MIN_EPOCHS, MAX_EPOCHS = 1, 100
#: learning rate of the Adam family, and of SGD per unit of clipped update
ADAM_LR = 1e-2
#: DP-AdamBC's rate and its floor κ in units of the noise variance (``noise_floor``): with the
#: paper's absolute γ′ alone its untuned runs did not train (docs/results.md, "DP-AdamBC")
ADAMBC_LR = 3e-3
ADAMBC_NOISE_FLOOR = 0.1
SGD_LR = 0.5
#: SGD's learning rate under automatic clipping, whose update is a mean of unit-norm vectors,
#: at the steps it was swept at; a trial of T steps gets AUTO_SGD_LR·AUTO_SGD_STEPS/T, raised
#: no further below AUTO_SGD_MIN_STEPS (the shortest measured)
AUTO_SGD_LR = 1.4
AUTO_SGD_STEPS, AUTO_SGD_MIN_STEPS = TARGET_STEPS["sgd"], 100
#: the rates of the sweep AUTO_SGD_LR was chosen from
AUTO_SGD_SWEEP = (0.05, 0.1, 0.2, 0.5, 1.0, 1.4, 2.0, 4.0, 8.0)
#: the method of a spec that names none, by optimizer: SGD's, and the Adam family's
SGD_METHOD = MethodConfig(clipping="auto_s")
ADAM_METHOD = MethodConfig(adaptive=AdaptiveConfig(rule="dcsgd_e"))
#: search dimensions whose candidates the default method was not chosen for
METHOD_DIMENSIONS = ("method.", "optimizer.name")


#: a private score's noise when the spec leaves out ``validation`` and the data have no public
#: split: σ_v = SCORE_STD·f·N, so that the score's release noise σ_v/(f·N) (the score counts
#: the f·N examples expected held out) has this standard deviation, but never below
#: VALIDATION_NOISE_MIN, which keeps the score's share of a trial's ε small on small data
SCORE_STD = 0.02
VALIDATION_NOISE_MIN = 5.0


#: an adaptive rule's release noise, when the spec leaves it out: at least this many times σ
#: (and DC-SGD's σ_H at least its paper default)
RELEASE_RATIO = 4.0
HISTOGRAM_NOISE_MIN = 5.0
#: DC-SGD-E's histogram bins, when the spec leaves them out: the paper's b, fewer where the
#: noisy count S′ = B + N(0, b·σ_H²) would come within TOTAL_Z standard deviations of 0, but
#: at least MIN_BINS
BINS: int = AdaptiveConfig.model_fields["bins"].default
TOTAL_Z = 3.0
MIN_BINS = 4


def batch_size(n: int) -> int:
    """The power of two nearest below q·N, within [MIN_BATCH, MAX_BATCH] and at most N."""
    b = 2 ** math.floor(math.log2(max(SAMPLE_RATE * n, 1)))
    return min(n, MAX_BATCH, max(MIN_BATCH, b))


def epochs(n: int, batch: int, steps: int) -> float:
    """Epochs for about ``steps`` steps of batch ``batch``: T = epochs·N/B."""
    return float(min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(steps * batch / n))))


def target_steps(names: list[OptimizerName]) -> int:
    """The steps a trial is given by default (:data:`TARGET_STEPS`) when the trials may run the
    optimizers ``names``: the fewest of theirs (one epochs value serves every trial)."""
    return min(TARGET_STEPS[name] for name in names)


def optimizers(spec: JobSpec) -> list[OptimizerName]:
    """The optimizers the trials of ``spec`` may run: its searched ``optimizer.name``'s, or its
    own."""
    dim = spec.search_space.get("optimizer.name")
    return [spec.optimizer.name] if dim is None else endpoints(dim)


def learning_rate(
    names: list[OptimizerName], method: MethodConfig, steps: int | None = None
) -> float:
    """The one rate every trial gets, for the optimizers ``names`` they may run, each trial
    running ``steps`` steps (None: trials of several lengths). Adam-family optimizers adapt
    their step per coordinate, so one rate serves them (DP-AdamBC's own when every trial runs
    it, with its noise floor: its denominators can be smaller than Adam's); SGD's step scales
    with the update's norm: automatic clipping's has its own rate (:func:`auto_rate`), Abadi's
    is at most C (an adaptive rule's initial C₀). A search across SGD and the Adam family has
    no rate that suits both (theirs differ 50-fold or more): the plan names ``optimizer.lr``."""
    if "sgd" not in names:
        return ADAMBC_LR if set(names) == {"adambc"} else ADAM_LR
    if len(set(names)) > 1:
        raise planning.PlanError(
            "optimizer.lr",
            "a search over optimizer.name across SGD and the Adam family needs a learning "
            f"rate: the planner's differ 50-fold or more (SGD's {SGD_LR:g}/C or "
            f"{AUTO_SGD_LR:g}, Adam's {ADAM_LR:g}); give optimizer.lr or search it",
        )
    return auto_rate(steps) if method.clipping != "abadi" else SGD_LR / method.threshold


def auto_rate(steps: int | None) -> float:
    """SGD's rate under automatic clipping for trials of ``steps`` steps: the swept rate scaled
    by AUTO_SGD_STEPS/T (3 significant digits), so that a trial travels the distance r = lr·T
    of the sweep's best (Panda et al., "A New Linear Scaling Rule for Private Adaptive
    Hyperparameter Optimization", ICML 2024: the best r depends on ε, not on how it is split
    into lr and T). Each step's update has a fixed scale here, so at the swept rate 400 steps
    go twice as far and diverged on digits at ε = 1 (docs/results.md). Below
    AUTO_SGD_MIN_STEPS the rate is not raised further (a few huge steps are not measured);
    trials of several lengths (None) get the swept rate."""
    if steps is None:
        return AUTO_SGD_LR
    return float(f"{AUTO_SGD_LR * AUTO_SGD_STEPS / max(steps, AUTO_SGD_MIN_STEPS):.3g}")


def default_method(optimizer: OptimizerName) -> MethodConfig:
    """The method that scored best untuned with ``optimizer`` on the bench datasets: under SGD
    the step is the update's norm times the rate, which automatic clipping fixes (so one rate
    serves) while an adaptive threshold moves it; the Adam family's step ignores the update's
    scale, and there DC-SGD-E's threshold, following the gradients' norms, did best."""
    return SGD_METHOD if optimizer == "sgd" else ADAM_METHOD


def fill(spec: JobSpec, n: int) -> tuple[JobSpec, dict[str, str]]:
    """``spec`` with its missing method, batch size, epochs and learning rate chosen for a
    dataset of ``n`` examples, and why each was chosen (spec field → explanation)."""
    searched = spec.search_space
    names = optimizers(spec)
    update: dict[str, object] = {}
    why: dict[str, str] = {}
    method = spec.method
    if "method" not in spec.model_fields_set and not any(
        p.startswith(METHOD_DIMENSIONS) for p in searched
    ):
        update["method"] = method = default_method(spec.optimizer.name)
        why["method"] = _method_reason(spec.optimizer.name)
    if spec.batch_size is None and "batch_size" not in searched:
        update["batch_size"] = b = batch_size(n)
        why["batch_size"] = (
            f"{b}: q = B/N ≈ {b / n:.3g}, large batches as in De et al. 2022 and Sander et al. "
            f"2023 (σ grows slower than B at a fixed ε, so the averaged gradient is less noisy); "
            f"a power of two near {SAMPLE_RATE:g}·N, at most {MAX_BATCH}."
        )
    if spec.epochs is None and "epochs" not in searched:
        reference = _largest_batch(spec, update)
        steps = target_steps(names)
        update["epochs"] = e = epochs(n, reference, steps)
        why["epochs"] = (
            f"{e:g}: about {steps} steps of batch {reference} (T = epochs·N/B); many steps at "
            "a large batch is what keeps accuracy at a fixed ε (Sander et al. 2023): 400 with "
            "the Adam family, 200 with SGD, whose rates were swept there (docs/results.md)."
        )
    optimizer = spec.optimizer
    if "lr" not in optimizer.model_fields_set and "optimizer.lr" not in searched:
        steps = _steps(spec, update, n)
        lr = learning_rate(names, method, steps)
        update["optimizer"] = optimizer = optimizer.model_copy(update={"lr": lr})
        why["optimizer.lr"] = _lr_reason(lr, names, method, steps)
    if _floor_left_out(spec, names):
        update["optimizer"] = optimizer.model_copy(update={"noise_floor": ADAMBC_NOISE_FLOOR})
        why["optimizer.noise_floor"] = (
            f"{ADAMBC_NOISE_FLOOR:g}: DP-AdamBC's denominator is at least √κ = "
            f"{ADAMBC_NOISE_FLOOR**0.5:.2g} times the noise's standard deviation. The paper's "
            "floor γ′ alone is absolute: where the second moment is mostly noise, v̂ − s² falls "
            "to γ′ and a step grows to lr·m̂/√γ′; untuned runs did not train (docs/results.md)."
        )
    return spec.model_copy(update=update), why


def _floor_left_out(spec: JobSpec, names: list[OptimizerName]) -> bool:
    """Whether DP-AdamBC is among the optimizers ``names`` the trials may run and the spec
    chose neither of its floors (γ′, κ; neither is searchable)."""
    chosen = {"gamma_prime", "noise_floor"} & spec.optimizer.model_fields_set
    return "adambc" in names and not chosen


def fill_validation(spec: JobSpec, n: int, public: bool) -> tuple[JobSpec, dict[str, str]]:
    """Where the selection score of a spec that leaves out ``validation`` comes from, for a
    dataset of ``n`` examples: the public split when the data have one (``public``: free);
    else a private hold-out of the default fraction f, the score released with noise
    max(VALIDATION_NOISE_MIN, SCORE_STD·f·N) — a standard deviation of SCORE_STD where N is
    large enough, at a small share of ε either way (the plan's ``score_std`` is the one
    chosen)."""
    if "validation" in spec.model_fields_set:
        return spec, {}
    if public:
        why = "public: the dataset's public validation split (it costs no ε)."
        return spec, {"validation": why}
    fraction = ValidationConfig.model_fields["fraction"].default
    noise = max(VALIDATION_NOISE_MIN, SCORE_STD * fraction * n)
    validation = ValidationConfig(split="private", fraction=fraction, noise=noise)
    why = (
        f"private: the dataset has no public validation split; {fraction:g} of its examples "
        f"held out, the score released with noise {noise:.3g}: a standard deviation of "
        f"{score_std(noise, fraction, n):.2g} (noise max({VALIDATION_NOISE_MIN:g}, "
        f"{SCORE_STD:g}·f·N), so that it is small at a small share of ε)."
    )
    return spec.model_copy(update={"validation": validation}), {"validation": why}


def _shapes(spec: JobSpec, update: dict[str, object]) -> list[dict[str, Any]]:
    """The (batch_size, epochs) of every trial of ``spec`` with the defaults in ``update``."""
    return spec.model_copy(update=update).shape_grid()


def _steps(spec: JobSpec, update: dict[str, object], n: int) -> int | None:
    """The steps T every trial runs on ``n`` examples, or None where its shapes differ in T."""
    lengths = {num_steps(n, s["batch_size"], s["epochs"]) for s in _shapes(spec, update)}
    return lengths.pop() if len(lengths) == 1 else None


def _largest_batch(spec: JobSpec, update: dict[str, object]) -> int:
    """The batch size the default epochs are counted in: the largest a trial may use, so that
    no shape runs fewer than TARGET_STEPS steps."""
    return int(max(s["batch_size"] for s in _shapes(spec, update)))


def _method_reason(optimizer: OptimizerName) -> str:
    if optimizer == "sgd":
        return (
            "AUTO-S ({'clipping': 'auto_s'}, paper 003): automatic clipping needs no threshold, "
            "and its SGD step has a fixed scale; untuned with SGD it beat DP-SGD at C = 1 and "
            "DC-SGD-E on digits and mnist1d, except digits at ε = 1 (docs/results.md)."
        )
    return (
        "DC-SGD-E ({'adaptive': {'rule': 'dcsgd_e'}}, paper 001, Algorithm 4): its threshold "
        f"follows the gradients' norms, so it needs no threshold search, and {optimizer}'s step "
        "ignores the update's scale; untuned with Adam it beat DP-SGD at C = 1 and automatic "
        "clipping on digits at ε = 2 and 4 and on mnist1d at ε = 1 to 4, and on digits at "
        "ε = 1, with the fewer histogram bins the planner gives it there, matched DP-SGD's best "
        "threshold picked afterwards (docs/results.md)."
    )


def _lr_reason(
    lr: float, names: list[OptimizerName], method: MethodConfig, steps: int | None
) -> str:
    if set(names) == {"adambc"}:
        return (
            f"{lr:g}: the DP-AdamBC rate that did best with the noise floor κ = "
            f"{ADAMBC_NOISE_FLOOR:g} (the planner's where a spec sets neither floor) in a sweep "
            "of 10⁻³, 3·10⁻³, 10⁻² (docs/results.md)."
        )
    if "sgd" not in names:
        return f"{lr:g}: the Adam-family rate that did best in a sweep (service/recipes.py)."
    if method.clipping != "abadi":
        grid = ", ".join(f"{r:g}" for r in AUTO_SGD_SWEEP)
        length = (
            f"scaled by {AUTO_SGD_STEPS}/T for T = {steps} steps (T ≥ {AUTO_SGD_MIN_STEPS}), "
            "so that a trial travels the same distance lr·T (Panda et al. 2024)"
            if steps is not None
            else "the trials' shapes differ in T, so it is not scaled to one"
        )
        return (
            f"{lr:g}: automatic clipping ({method.clipping}) normalizes each per-example "
            "gradient, so the learning rate is the only knob (paper 003); "
            f"{AUTO_SGD_LR:g}, the SGD rate of best mean accuracy over digits and mnist1d at "
            f"{AUTO_SGD_STEPS} steps in a sweep over {grid}, {length} (docs/results.md)."
        )
    threshold = "C₀" if method.adaptive is not None else "C"
    return (
        f"{lr:g} = {SGD_LR:g}/{threshold} with {threshold} = {method.threshold:g}: Abadi "
        f"clipping bounds the update by {threshold}, so SGD's rate is scaled by 1/{threshold}."
    )


def fill_adaptive(spec: JobSpec, shapes: list[tuple[int, float]]) -> tuple[JobSpec, dict[str, str]]:
    """What an adaptive rule's spec leaves out: the noise of its per-step release and, after it,
    DC-SGD-E's histogram bins (:func:`histogram_bins`), for a job whose shapes run (batch size,
    σ); the bins are the smallest batch size's."""
    spec, why = _fill_release_noise(spec, shapes)
    spec, bins_why = _fill_bins(spec, min(b for b, _ in shapes))
    return spec, why | bins_why


def histogram_bins(batch: int, histogram_noise: float) -> int:
    """DC-SGD-E's b for expected batch size B and histogram noise σ_H: the paper's b = 20
    (paper 001 §V-C), or fewer so that √b·σ_H ≤ B/TOTAL_Z; at least MIN_BINS.

    Eq. 4's bias term is divided by the histogram's noisy count S′ = B + N(0, b·σ_H²). Where
    σ_H is large against B (at a small ε, whose σ raises σ_H) S′ comes near 0 in some steps,
    the estimated bias there is many times its value and C_{t+1} jumps, so the threshold
    wanders from step to step; the paper's own setting (B = 256, σ_H = 5, b = 20) keeps S′
    eleven standard deviations above 0. Fewer bins keep it TOTAL_Z = 3 above."""
    fit = math.floor((batch / (TOTAL_Z * histogram_noise)) ** 2)
    return max(MIN_BINS, min(BINS, fit))


def _fill_bins(spec: JobSpec, batch: int) -> tuple[JobSpec, dict[str, str]]:
    """DC-SGD-E's bins, left out of the spec, for the job's smallest batch size ``batch``."""
    adaptive = spec.method.adaptive
    if adaptive is None or adaptive.rule != "dcsgd_e" or "bins" in adaptive.model_fields_set:
        return spec, {}
    noise = adaptive.histogram_noise
    bins = histogram_bins(batch, noise)
    method = spec.method.model_copy(update={"adaptive": adaptive.model_copy(update={"bins": bins})})
    why = (
        f"{bins}: the paper's {BINS} bins, fewer where the histogram's noisy count "
        f"S′ = B + N(0, b·σ_H²) would not stay {TOTAL_Z:g} standard deviations above 0 "
        f"(√b·σ_H ≤ B/{TOTAL_Z:g}, B = {batch}, σ_H = {noise:.4g}; at least {MIN_BINS}): "
        "S′ divides the estimated bias of paper 001's eq. 4, and near 0 it makes the "
        "threshold jump (docs/results.md)."
    )
    return spec.model_copy(update={"method": method}), {"method.adaptive.bins": why}


def _fill_release_noise(
    spec: JobSpec, shapes: list[tuple[int, float]]
) -> tuple[JobSpec, dict[str, str]]:
    """The noise of an adaptive rule's per-step release, when the spec leaves it out, for a
    job whose shapes run (batch size, σ). The release is paid out of σ (σ_T = (σ⁻² −
    σ_R⁻²)^(−1/2), paper 001, Theorem 2), so σ_R must exceed σ, and the gradient keeps nearly
    all of σ only if σ_R is well above it: paper 001 (§VI-B) raises DC-SGD's σ_H from 5 to 8 for
    2 ≤ σ ≤ 3 and to 12 for σ > 3. We take σ_R ≥ 4σ (σ_T ≤ 1.033·σ whatever σ is): DC-SGD's
    σ_H = max(5, 4σ); Andrew et al.'s count noise σ_b (σ_R = 2σ_b) stays B/20 unless that is
    below 2σ for some shape, and is then 2σ."""
    adaptive = spec.method.adaptive
    sigma = max(s for _, s in shapes)
    if adaptive is None:
        return spec, {}
    if (
        adaptive.rule in ("dcsgd_p", "dcsgd_e")
        and "histogram_noise" not in adaptive.model_fields_set
    ):
        field, value = "histogram_noise", max(HISTOGRAM_NOISE_MIN, RELEASE_RATIO * sigma)
        rule = f"max({HISTOGRAM_NOISE_MIN:g}, {RELEASE_RATIO:g}σ)"
    elif (
        adaptive.rule == "andrew"
        and adaptive.count_noise is None
        and any(b / 20 < RELEASE_RATIO * s / 2 for b, s in shapes)
    ):
        field, value = "count_noise", RELEASE_RATIO * sigma / 2
        rule = f"{RELEASE_RATIO / 2:g}σ, above B/20"
    else:
        return spec, {}
    method = spec.method.model_copy(update={"adaptive": adaptive.model_copy(update={field: value})})
    why = (
        f"{value:.4g} = {rule} with σ = {sigma:.4g}: the release's noise comes out of σ, so "
        "keeping it well above σ leaves the gradient nearly all of σ (σ_T ≤ 1.033σ; paper 001 "
        "§VI-B raises σ_H with σ likewise)."
    )
    return spec.model_copy(update={"method": method}), {f"method.adaptive.{field}": why}
