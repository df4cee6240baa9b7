"""Configuration of one DP training trial.

This is the contract between the control plane (``service/``, which embeds these models in a
tuning-job spec and searches over their fields) and the engine (``workers/``, which trains one
trial from a :class:`TrialConfig`). Every model forbids unknown fields so that a typo is an
error naming the field, never a silently ignored setting.
"""

from __future__ import annotations

import keyword
import re
from typing import Annotated, Any, Literal, Self, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    StrictBool,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic import Strict as StrictType

ClippingFunction = Literal["abadi", "auto_s", "auto_v"]
ClippingStyle = Literal["all_layer", "layer_wise", "param_wise", "groups"]
AdaptiveRule = Literal["dcsgd_p", "dcsgd_e", "andrew", "du"]
OptimizerName = Literal["sgd", "adam", "adamw", "adambc"]
ModelName = Literal["logreg", "mlp", "cnn", "resnet18", "resnet34", "lstm", "transformer"]
PerSamplePath = Literal["fast", "general"]


#: float32's smallest normal and largest finite numbers (IEEE 754 binary32)
FLOAT32_TINY, FLOAT32_MAX = 2.0**-126, 3.4028234663852886e38

# Ranges (closed) of the numbers that reach the DP mechanism (docs/design.md, invariant 12).
# The engine forms g̃ = (C/B)·(Σᵢ c̃ᵢgᵢ + σ_T·z) with ‖c̃ᵢgᵢ‖ ≤ 1 (``workers.dp.engine``), so
# the noise σ_T·z and every contribution are normal float32 numbers whenever σ_T is, and the
# scale C/B ∈ [1e-10, 1e4] keeps the noise normal after it; the optimizer's numbers are
# bounded so that its arithmetic on g̃ (g̃/(√v̂ + eps), lr·update) stays normal and finite.
# The bounds are generous for real use: outside them a run is degenerate, not more accurate.
#: clipping threshold C (and every adaptive C_t: rules clamp into it)
THRESHOLD = (1e-4, 1e4)
#: noise multipliers: σ, σ_T, σ_H, σ_b, the validation score's; the floor is the planner's
#: smallest σ (``core.accounting.calibration.SIGMA_MIN``)
NOISE = (1e-2, 1e6)
LEARNING_RATE = (1e-7, 1e2)
ADAM_EPS = (1e-12, 1.0)
#: AUTO-S's stability constant γ (paper 003) and DP-AdamBC's floor γ′ (paper 004)
AUTO_S_GAMMA = (1e-6, 1e2)
GAMMA_PRIME = (1e-16, 1.0)
#: DP-AdamBC's floor in units of the noise variance it removes (κ: the denominator ≥ √κ·s)
NOISE_FLOOR = (0.0, 100.0)
WEIGHT_DECAY = (0.0, 10.0)
#: η_C of Andrew et al.'s geometric update
THRESHOLD_RATE = (1e-4, 10.0)
MAX_BINS = 1000
#: the largest expected batch size B: with C ≥ 1e-4 the scale C/B is at least 1e-10
MAX_BATCH = 1_000_000
#: a job's δ (and LT's δ₂): above 0.1 it guarantees nothing; the floor keeps 1/δ, ln(1/δ)
#: and LT's cap ln(1/δ₂)/γ well inside float64 (a subnormal δ made 1/δ overflow)
DELTA = (1e-30, 0.1)
#: the share of the private data held out for the selection score
FRACTION = (1e-3, 0.9)
#: a built-in model's size options: generous for real use; a typo such as 2**40 is refused
#: at admission, before anything is reserved, not by the worker after the charge
WIDTH = (1, 65_536)
DEPTH = (1, 1_000)


Threshold = Annotated[float, Field(ge=THRESHOLD[0], le=THRESHOLD[1])]
Noise = Annotated[float, Field(ge=NOISE[0], le=NOISE[1])]
#: a coefficient in [0, 1): momentum, Adam's β₁ and β₂ (strict also inside a lax tuple)
Coefficient = Annotated[float, StrictType(), Field(ge=0, lt=1)]


class Strict(BaseModel):
    """Forbids unknown fields, NaN, ±inf and coercion: no string or bool is read as a number."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class DatasetConfig(Strict):
    """``source`` is ``builtin:digits``, ``builtin:mnist1d``, ``builtin:heavy_tail`` or a file:
    ``npz:<path>``, ``csv:<path>``, ``parquet:<path>``; ``options`` are passed to the dataset
    builder (e.g. ``scale`` for ``heavy_tail``; ``label`` and ``features``, the columns of a
    table).

    ``num_classes`` declares the label set {0, …, num_classes − 1}: it sizes the model's
    output and is public, so it must not be read off private labels (required for files;
    the builtins' class counts are part of their definition). ``sha256`` is the content hash
    recorded when the control plane registered the dataset: a trial refuses data that
    changed since, because its privacy cost (q = B/N, T) was planned from the registered N.
    """

    source: str = Field(pattern=r"^(builtin:(digits|mnist1d|heavy_tail)|(npz|csv|parquet):.+)$")
    options: dict[str, float | int | str | bool | list[str]] = Field(default_factory=dict)
    num_classes: int | None = Field(None, ge=2, le=100_000)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


#: ``package.module:factory``: a model factory the operator installed on the workers
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z]\w*$")
#: arguments every factory receives; options may not name them
FACTORY_ARGUMENTS = ("input_shape", "num_classes")


def _model_name(name: str) -> str:
    if name in get_args(ModelName) or IMPORT_PATH.fullmatch(name):
        return name
    raise ValueError(
        f"{name!r} is neither a built-in model ({', '.join(get_args(ModelName))}) nor an import "
        "path 'package.module:factory'"
    )


_Width = Annotated[int, StrictType(), Field(ge=WIDTH[0], le=WIDTH[1])]
_Depth = Annotated[int, StrictType(), Field(ge=DEPTH[0], le=DEPTH[1])]
#: the options each built-in model reads (``workers.models.builtin``), with their types:
#: declared here, without torch, so that admission refuses an option no model reads before
#: anything is reserved
BUILTIN_OPTIONS: dict[str, dict[str, TypeAdapter[Any]]] = {
    "logreg": {"bias": TypeAdapter(StrictBool)},
    "mlp": {"hidden": TypeAdapter(_Width), "layers": TypeAdapter(_Depth)},
    "cnn": {},
    "resnet18": {"width": TypeAdapter(_Width), "norm_groups": TypeAdapter(_Width)},
    "resnet34": {"width": TypeAdapter(_Width), "norm_groups": TypeAdapter(_Width)},
    "lstm": {"hidden": TypeAdapter(_Width), "layers": TypeAdapter(_Depth)},
    "transformer": {
        "dim": TypeAdapter(_Width),
        "heads": TypeAdapter(_Width),
        "layers": TypeAdapter(_Depth),
        "ff": TypeAdapter(_Width),
    },
}


def _builtin_options(name: str, options: dict[str, float | int | str | bool]) -> None:
    """Refuse an option the built-in model does not read, or a value of the wrong type."""
    accepted = BUILTIN_OPTIONS[name]
    for key, value in options.items():
        if key not in accepted:
            raise ValueError(
                f"model.options.{key}: not an option of {name!r} (allowed: {sorted(accepted)})"
            )
        try:
            accepted[key].validate_python(value)
        except ValidationError as error:
            raise ValueError(f"model.options.{key}: {error.errors()[0]['msg']}") from None


class ModelConfig(Strict):
    """A built-in model (``workers.models.builtin``) or a factory by import path
    (``package.module:factory``, a public callable defined in that module), called as
    ``factory(input_shape=(C, H, W), num_classes=K, **options)``; the control plane admits only
    factories in the operator's allow-list (``DPTUNE_MODEL_IMPORTS``)."""

    name: Annotated[
        str,
        AfterValidator(_model_name),
        Field(
            max_length=200,
            description=f"A built-in model ({', '.join(get_args(ModelName))}) or a factory "
            "`package.module:factory` in a module the operator allow-listed "
            "(`DPTUNE_MODEL_IMPORTS`).",
        ),
    ]
    options: dict[str, float | int | str | bool] = Field(
        default_factory=dict,
        description="Keyword arguments of the model, scalars. A built-in model reads only its "
        "own: "
        + "; ".join(f"{m}: {', '.join(o)}" for m, o in BUILTIN_OPTIONS.items() if o)
        + ". A factory is called as `factory(input_shape=..., num_classes=..., **options)`.",
    )

    @property
    def factory(self) -> tuple[str, str] | None:
        """(module, attribute) of an imported factory; None for a built-in model."""
        if ":" not in self.name:
            return None
        module, attribute = self.name.split(":")
        return module, attribute

    @model_validator(mode="after")
    def _keyword_options(self) -> Self:
        if self.factory is None:
            _builtin_options(self.name, self.options)
            return self
        for key in self.options:
            if not key.isidentifier() or keyword.iskeyword(key) or key in FACTORY_ARGUMENTS:
                raise ValueError(
                    f"model.options.{key}: not usable as a keyword argument of the factory"
                    + (" (the engine passes it)" if key in FACTORY_ARGUMENTS else "")
                )
        return self


class LayerRoute(Strict):
    """One module of an inspected model: its dotted name (``""``: the model itself), its
    class, and why it is on the general path or refused."""

    module: str
    type: str
    reason: str | None = None


class StateTensor(Strict):
    """One ``state_dict`` entry of a model as built: its shape and element type (numpy's name:
    ``float32``, ``int64``, ``bool`` …)."""

    shape: list[int]
    dtype: str


class ModelReport(Strict):
    """What inspecting a model found (``workers.models.inspect``), for the input shape and
    label count it was built with and the job's per-sample path: its size, which modules'
    parameters take the fast path (ghost clipping, ``workers.dp.ghost``) or the general one
    (``torch.func``), and what makes it unfit for DP-SGD. A model with refusals never trains.
    ``state`` is its ``state_dict`` as the factory built it: exactly what a released weights
    file holds (``workers.release``; the control plane checks uploads against it). None in a
    job admitted before the layout was recorded."""

    input_shape: list[int]
    num_classes: int
    per_sample: PerSamplePath
    parameters: int
    trainable: int
    fast: list[LayerRoute]
    general: list[LayerRoute]
    refused: list[LayerRoute]
    state: dict[str, StateTensor] | None = None

    @property
    def reason(self) -> str:
        """Every refusal in one line (empty when the model is accepted)."""
        return "; ".join(f"{r.module or '<model>'} ({r.type}): {r.reason}" for r in self.refused)


class AdaptiveConfig(Strict):
    """Adaptive clipping threshold rules (paper 001, Algorithms 1–4, and its baselines).

    Defaults are the paper's: C₀ = 1 (``MethodConfig.threshold``), σ_H = 5, b = 20 bins,
    R₀ = 1 for DC-SGD-P and R₀ = b for DC-SGD-E.
    """

    rule: AdaptiveRule = Field(
        description="`dcsgd_p` / `dcsgd_e`: DC-SGD's percentile / expected-error rule on a noisy "
        "histogram of gradient norms (paper 001); `andrew`: Andrew et al.'s geometric update "
        "from a noisy count of unclipped examples; `du`: Du et al.'s decay."
    )
    histogram_noise: Noise = Field(
        5.0,
        description="σ_H, the noise multiplier of DC-SGD's norm histogram. Left out of a job "
        "spec, the planner raises it with the job's σ (the plan's `defaults` says to what).",
    )
    bins: int = Field(
        20,
        ge=1,
        le=MAX_BINS,
        description="b, the histogram's bins (DC-SGD). Left out of a `dcsgd_e` job spec, the "
        "planner lowers it where σ_H is large against the batch size (the plan's `defaults` "
        "says to what).",
    )
    initial_range: Threshold | None = Field(
        None, description="R₀, DC-SGD's initial norm range; null: 1 for DC-SGD-P, b for DC-SGD-E."
    )
    percentile: float = Field(
        0.5, gt=0, lt=1, description="p, the target quantile of DC-SGD-P and of Andrew et al."
    )
    learning_rate: float = Field(
        0.2,
        ge=THRESHOLD_RATE[0],
        le=THRESHOLD_RATE[1],
        description="η_C of Andrew et al.'s geometric update.",
    )
    count_noise: Noise | None = Field(
        None,
        description="σ_b of Andrew et al.'s noisy count of unclipped examples; null: B/20, "
        "raised by the planner where the job's σ needs more (the plan's `defaults` says so).",
    )
    decay: float = Field(
        0.5, gt=0, le=1, description="ρ_C of Du et al.'s decay: C_t = C₀·ρ_C^(t/T)."
    )


class MethodConfig(Strict):
    clipping: ClippingFunction = Field(
        "abadi",
        description="The per-example clipping function: `abadi` min(1, R/‖g‖) (Abadi et al. "
        "2016), `auto_s` R/(‖g‖ + γ) or `auto_v` R/‖g‖ (automatic clipping, paper 003).",
    )
    gamma: float = Field(
        0.01,
        ge=AUTO_S_GAMMA[0],
        le=AUTO_S_GAMMA[1],
        description="γ, the stability constant of AUTO-S (paper 003).",
    )
    style: ClippingStyle = Field(
        "all_layer",
        description="What is clipped as one group: the whole gradient, each layer's, each "
        "parameter's, or the `groups` given; M groups are each clipped at R/√M (paper 002, "
        "eq. 4).",
    )
    groups: list[list[str]] | None = Field(
        None,
        description="`style: groups` only (required there): the groups, each a list of "
        "parameter-name prefixes.",
    )
    threshold: Threshold = Field(
        1.0, description="The clipping threshold R; an adaptive rule's initial C₀."
    )
    adaptive: AdaptiveConfig | None = Field(
        None,
        description="A rule that adapts the clipping threshold during training (paper 001 and "
        "its baselines); null: the threshold stays fixed.",
    )
    per_sample: PerSamplePath = Field(
        "fast",
        description="How per-example gradients are computed: `fast` (ghost clipping where a "
        "layer allows it) or `general` (torch.func); speed only, no privacy effect.",
    )

    @model_validator(mode="after")
    def _groups_match_style(self) -> Self:
        if (self.style == "groups") != (self.groups is not None):
            raise ValueError("groups: required exactly when style is 'groups'")
        if self.groups is not None and (not self.groups or any(not g for g in self.groups)):
            raise ValueError("groups: every group needs at least one parameter prefix")
        return self


class OptimizerConfig(Strict):
    name: OptimizerName = Field(
        "sgd",
        description="`sgd`, `adam`, `adamw` (torch's, stepping on the private gradient) or "
        "`adambc` (DP-AdamBC, paper 004).",
    )
    lr: float = Field(
        0.1,
        ge=LEARNING_RATE[0],
        le=LEARNING_RATE[1],
        description="The learning rate. Left out of a job spec, the planner picks one for the "
        "optimizer and clipping (the plan's `defaults` says which and why); one rate serves "
        "every optimizer of a searched `optimizer.name`, so a search across `sgd` and the Adam "
        "family must give it (or search it).",
    )
    momentum: Coefficient = Field(0.0, description="Momentum (`sgd`).")
    weight_decay: float = Field(
        0.0, ge=WEIGHT_DECAY[0], le=WEIGHT_DECAY[1], description="Weight decay."
    )
    #: a JSON list is read as the tuple; its items are strict
    betas: Annotated[tuple[Coefficient, Coefficient], Field(strict=False)] = Field(
        (0.9, 0.999), description="(β₁, β₂) of the Adam family."
    )
    eps: float = Field(
        1e-8,
        ge=ADAM_EPS[0],
        le=ADAM_EPS[1],
        description="ε added to the Adam family's denominator.",
    )
    gamma_prime: float = Field(
        1e-8,
        ge=GAMMA_PRIME[0],
        le=GAMMA_PRIME[1],
        description="γ′, DP-AdamBC's floor on the bias-corrected second moment (paper 004, "
        "Algorithm 2).",
    )
    noise_floor: float = Field(
        0.0,
        ge=NOISE_FLOOR[0],
        le=NOISE_FLOOR[1],
        description="κ, DP-AdamBC's floor on the bias-corrected second moment in units of the "
        "noise variance s² it removes: the floor is max(γ′, κ·s²).",
    )


class ValidationConfig(Strict):
    """Where the selection score comes from (docs/design.md, invariant 5): a public split, or the
    private one released through a Gaussian mechanism with noise multiplier ``noise``."""

    split: Literal["public", "private"] = Field(
        "public",
        description="`public`: the dataset's public validation split; `private`: examples of "
        "the private data held out, the score released through the Gaussian mechanism and "
        "charged with the trial.",
    )
    noise: Noise | None = Field(
        None, description="`private` only (required there): the released score's noise multiplier."
    )
    fraction: float = Field(
        0.1,
        ge=FRACTION[0],
        le=FRACTION[1],
        description="`private`: the probability with which each example is held out.",
    )

    @model_validator(mode="after")
    def _private_needs_noise(self) -> Self:
        if self.split == "private" and self.noise is None:
            raise ValueError("validation.noise: required when validation.split is 'private'")
        return self


class TrialConfig(Strict):
    dataset: DatasetConfig
    model: ModelConfig
    method: MethodConfig = Field(default_factory=MethodConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    epochs: float = Field(1.0, gt=0)
    batch_size: int = Field(64, ge=1, le=MAX_BATCH)  # expected logical batch size B; q = B / N
    physical_batch_size: PositiveInt = 256
    noise_multiplier: Noise | None = None  # σ; or calibrate from target_epsilon
    target_epsilon: float | None = Field(None, gt=0)
    delta: float = Field(1e-5, gt=0, lt=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @model_validator(mode="after")
    def _noise_or_target(self) -> Self:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(
                "noise_multiplier: give exactly one of noise_multiplier or target_epsilon"
            )
        return self
