"""Defaults for what a job spec leaves out: batch size, epochs and the learning rate.

What matters most for DP-SGD at a fixed ε is the batch size, the number of steps (hence σ) and
the learning rate, and the literature agrees on the first two:

- *Large batches, kept for many steps.* At a fixed ε, σ grows far slower than B, so the noise
  per averaged gradient, σ/B, falls as B grows; accuracy then improves as long as the number
  of steps T is kept (De et al., "Unlocking High-Accuracy Differentially Private Image
  Classification through Scale", 2022, §3–4, B = 4096 on CIFAR-10; Sander et al., "TAN
  Without a Burn: Scaling Laws of DP-SGD", ICML 2023, who show that at a fixed σ/B accuracy
  depends on T). We take q = B/N near 1/4 on small datasets, B at most 4096, and enough
  epochs for :data:`TARGET_STEPS` steps.
- *The learning rate, matched to the clipping.* With automatic clipping (AUTO-S/AUTO-V,
  Bu et al., "Automatic Clipping: Differentially Private Deep Learning Made Easier and
  Stronger", NeurIPS 2023, paper 003) every per-example gradient is normalized, so the
  threshold drops out and the learning rate is the only knob; with Abadi clipping the update
  is at most the threshold C in norm, so the learning rate is scaled by 1/C. The values are
  the best of a sweep of single runs (cnn on digits at ε = 2 with the batch and epochs above)
  over Adam's 10⁻³ … 3·10⁻², SGD's 0.25 … 8 at C = 1 and AUTO-S's 0.5 … 8.

Each default is explained in the plan (``Plan.defaults``).
"""

from __future__ import annotations

import math

from core.config import MethodConfig, OptimizerName
from core.spec import JobSpec

#: q = B/N is about this on datasets too small for :data:`MAX_BATCH`
SAMPLE_RATE = 0.25
MIN_BATCH, MAX_BATCH = 16, 4096
#: epochs are chosen so that a trial runs about this many steps ...
TARGET_STEPS = 200
#: ... within these bounds
MIN_EPOCHS, MAX_EPOCHS = 1, 100
#: learning rate of the Adam family, and of SGD per unit of clipped update
ADAM_LR = 1e-2
SGD_LR = 0.5


#: an adaptive rule's release noise, when the spec leaves it out: at least this many times σ
#: (and DC-SGD's σ_H at least its paper default)
RELEASE_RATIO = 4.0
HISTOGRAM_NOISE_MIN = 5.0


def batch_size(n: int) -> int:
    """The power of two nearest below q·N, within [MIN_BATCH, MAX_BATCH] and at most N."""
    b = 2 ** math.floor(math.log2(max(SAMPLE_RATE * n, 1)))
    return min(n, MAX_BATCH, max(MIN_BATCH, b))


def epochs(n: int, batch: int) -> float:
    """Epochs for about TARGET_STEPS steps of batch ``batch``: T = epochs·N/B."""
    return float(min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(TARGET_STEPS * batch / n))))


def learning_rate(optimizer: OptimizerName, method: MethodConfig) -> float:
    """Adam-family optimizers adapt their step per coordinate, so one rate serves; SGD's step
    scales with the update's norm: 1 under automatic clipping, at most C under Abadi's."""
    if optimizer != "sgd":
        return ADAM_LR
    return SGD_LR if method.clipping != "abadi" else SGD_LR / method.threshold


def fill(spec: JobSpec, n: int) -> tuple[JobSpec, dict[str, str]]:
    """``spec`` with its missing batch size, epochs and learning rate chosen for a dataset of
    ``n`` examples, and why each was chosen (spec field → explanation)."""
    searched = spec.search_space
    update: dict[str, object] = {}
    why: dict[str, str] = {}
    if spec.batch_size is None and "batch_size" not in searched:
        update["batch_size"] = b = batch_size(n)
        why["batch_size"] = (
            f"{b}: q = B/N ≈ {b / n:.3g}, large batches as in De et al. 2022 and Sander et al. "
            f"2023 (σ grows slower than B at a fixed ε, so the averaged gradient is less noisy); "
            f"a power of two near {SAMPLE_RATE:g}·N, at most {MAX_BATCH}."
        )
    if spec.epochs is None and "epochs" not in searched:
        reference = _largest_batch(spec, update)
        update["epochs"] = e = epochs(n, reference)
        why["epochs"] = (
            f"{e:g}: about {TARGET_STEPS} steps of batch {reference} (T = epochs·N/B); many "
            "steps at a large batch is what keeps accuracy at a fixed ε (Sander et al. 2023)."
        )
    optimizer = spec.optimizer
    if "lr" not in optimizer.model_fields_set and "optimizer.lr" not in searched:
        lr = learning_rate(optimizer.name, spec.method)
        update["optimizer"] = optimizer.model_copy(update={"lr": lr})
        why["optimizer.lr"] = _lr_reason(lr, optimizer.name, spec.method)
    return spec.model_copy(update=update), why


def _largest_batch(spec: JobSpec, update: dict[str, object]) -> int:
    """The batch size the default epochs are counted in: the largest a trial may use, so that
    no shape runs fewer than TARGET_STEPS steps."""
    sizes = [s["batch_size"] for s in spec.model_copy(update=update).shape_grid()]
    return int(max(sizes))


def _lr_reason(lr: float, optimizer: OptimizerName, method: MethodConfig) -> str:
    if optimizer != "sgd":
        return f"{lr:g}: the Adam-family rate that did best in a sweep (service/recipes.py)."
    if method.clipping != "abadi":
        return (
            f"{lr:g}: automatic clipping ({method.clipping}) normalizes each per-example "
            "gradient, so the learning rate is the only knob (paper 003)."
        )
    return (
        f"{lr:g} = {SGD_LR:g}/C with C = {method.threshold:g}: Abadi clipping bounds the update "
        "by C, so SGD's rate is scaled by 1/C."
    )


def fill_release_noise(
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
