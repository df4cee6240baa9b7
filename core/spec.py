"""The tuning-job spec an analyst POSTs (pydantic, strict: unknown fields are errors).

It embeds the trial-config parts of ``workers/config.py`` (the dataset is replaced by the id of
a registered dataset) plus the search space, the privacy target, the selection metric and the
resources of a trial. Sizes are bounded so that a request cannot exhaust the machine.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Mapping
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic import Strict as StrictType

from core.accounting import CAP_DELTA_SHARE, LT_DELTA2_SHARE, STATEMENT_DELTA_SHARE
from core.accounting.tuning import ETA_MIN, checked_eta
from core.config import (
    DELTA,
    LEARNING_RATE,
    MAX_BATCH,
    DatasetConfig,
    MethodConfig,
    ModelConfig,
    OptimizerConfig,
    Strict,
    TrialConfig,
    ValidationConfig,
)
from core.shapes import Shape

K = TypeVar("K", bound=Hashable)

MAX_TRIALS = 1000  # trials of one job (grid size × samples, or a cap on a random K)
#: the largest id (of a dataset, job, attempt) and count the service stores: a 32-bit integer,
#: what a PostgreSQL ``integer`` column holds; a larger one is refused as invalid (422) rather
#: than overflowing in the database (a 500)
MAX_ID = 2**31 - 1
MAX_VALUES = 100  # values listed for one hyperparameter
MAX_DIMENSIONS = 8

#: what a search space may vary, and the spec part each path lives in. Batch size and epochs
#: are searchable too (:data:`SHAPES`): they set q and T, so each candidate gets its own σ
#: (:mod:`core.shapes`).
SEARCHABLE: dict[str, type[BaseModel]] = {
    "optimizer.lr": OptimizerConfig,
    "optimizer.momentum": OptimizerConfig,
    "optimizer.weight_decay": OptimizerConfig,
    "optimizer.name": OptimizerConfig,
    "method.threshold": MethodConfig,
    "method.clipping": MethodConfig,
    "method.gamma": MethodConfig,
}


BatchSize = Annotated[int, StrictType(), Field(ge=1, le=MAX_BATCH)]  # expected logical batch B
Epochs = Annotated[float, StrictType(), Field(gt=0, le=1000)]
#: the searchable spec fields that change a trial's (q, T, σ): its shape (:mod:`core.shapes`)
SHAPES: dict[str, TypeAdapter[Any]] = {
    "batch_size": TypeAdapter(BatchSize),
    "epochs": TypeAdapter(Epochs),
}
#: at most this many shapes per job: each is calibrated on its own when the job is planned
MAX_SHAPES = 16


#: how deep a spec (or anything a runner stores) may nest; a spec needs 4 levels
MAX_DEPTH = 16


def text_problem(text: str) -> str | None:
    """Why a string is not storable text, or None: a lone surrogate is not Unicode text (no
    UTF-8 encoding) and PostgreSQL refuses NUL in text."""
    if "\x00" in text:
        return "contains NUL"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode text (a lone surrogate)"
    return None


def printable(text: str) -> str:
    """``text`` with what no response or database may carry escaped: lone surrogates (not
    encodable as UTF-8) as ``\\udXXX`` and NUL as ``\\x00``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def check_json(value: Any, path: str = "", max_depth: int = MAX_DEPTH) -> None:
    """Refuse NaN, ±inf, nesting deeper than ``max_depth`` and strings (keys too) that are not
    storable text, anywhere in a JSON-like value. Iterative, so that no input, however deep,
    reaches Python's recursion limit; errors name the path (``<path>: <reason>``), with any
    offending key escaped."""
    stack = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        named = where or "body"
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{named}: must be a finite number, got {item}")
        if isinstance(item, str) and (problem := text_problem(item)) is not None:
            raise ValueError(f"{named}: {problem}")
        if isinstance(item, list | tuple):
            item = dict(enumerate(item))
        if not isinstance(item, dict):
            continue
        if depth >= max_depth:
            raise ValueError(f"{named}: nested deeper than {max_depth} levels")
        for key, child in item.items():
            if isinstance(key, str) and (problem := text_problem(key)) is not None:
                raise ValueError(f"{named}: the key {key!a} {problem}")
            stack.append((child, f"{where}.{key}" if where else str(key), depth + 1))


def _text(value: str) -> str:
    if (problem := text_problem(value)) is not None:
        raise ValueError(problem)
    return value


#: a string every database stores and every response renders
Text = Annotated[str, AfterValidator(_text)]


def _scalar(value: Any) -> bool | int | float | str:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number")
    if isinstance(value, str) and (problem := text_problem(value)) is not None:
        raise ValueError(problem)
    if isinstance(value, bool | int | float | str):
        return value
    raise ValueError("must be a number, a string or a boolean")


Scalar = Annotated[Any, AfterValidator(_scalar)]


class Grid(Strict):
    """Every value is tried (grid search: the grids' product is the set of candidates)."""

    grid: list[Scalar] = Field(
        min_length=1, max_length=MAX_VALUES, description="The values, each tried."
    )


class Choice(Strict):
    """Each trial draws one value uniformly at random."""

    values: list[Scalar] = Field(
        min_length=1,
        max_length=MAX_VALUES,
        description="The values, one drawn uniformly at random per trial.",
    )


class LogUniform(Strict):
    """Each trial draws exp(U(ln low, ln high))."""

    #: a JSON list is read as the tuple; its items are strict
    log_uniform: Annotated[
        tuple[
            Annotated[float, StrictType(), Field(gt=0)],
            Annotated[float, StrictType(), Field(gt=0)],
        ],
        Field(strict=False, description="[low, high]: a trial draws exp(U(ln low, ln high))."),
    ]

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        low, high = self.log_uniform
        if not low < high:
            raise ValueError(f"log_uniform: low ({low}) must be below high ({high})")
        return self


def _dimension_kind(value: Any) -> str | None:
    """Which kind of dimension a value is, by its key. (The tags are not plain names so that
    error locations leave them out: ``search_space.optimizer.lr.grid.0``.)"""
    keys = ("grid", "values", "log_uniform")
    if isinstance(value, dict):
        return next((f"<{k}>" for k in keys if k in value), None)
    return next((f"<{k}>" for k in keys if hasattr(value, k)), None)


Dimension = Annotated[
    Annotated[Grid, Tag("<grid>")]
    | Annotated[Choice, Tag("<values>")]
    | Annotated[LogUniform, Tag("<log_uniform>")],
    Discriminator(
        _dimension_kind,
        custom_error_type="dimension",
        custom_error_message="give one of {'grid': [...]}, {'values': [...]} or "
        "{'log_uniform': [low, high]}",
    ),
]


class Privacy(Strict):
    """The job's privacy target and how its trials are charged.

    - ``rdp``: a fixed number K of trials composed in RDP; K = (grid size) × ``trials``
      (``trials`` random draws per grid point, default 1; required when some dimension is
      random). ``max_retries`` re-runs of a failed trial are reserved and charged if used.
    - ``lt``: Liu–Talwar random stopping: stop after each trial with probability ``gamma``
      (or give ``expected_trials`` = 1/γ); ``delta2`` (default: a share of δ,
      :data:`~core.accounting.LT_DELTA2_SHARE`) sets the cap on trials.
    - ``ps``: Papernot–Steinke: K ~ truncated negative binomial with ``mean`` and ``eta``
      (η = 1 geometric, η = 0 logarithmic) or ``eta: "poisson"``; ``max_trials`` caps K
      (default: the smallest cap whose cost in δ, (1 + e^ε)·P[K > cap], is at most a share of
      δ, :data:`~core.accounting.CAP_DELTA_SHARE`; see :func:`core.accounting.cap_delta`).

    ``hold_release`` (``lt``, ``ps``): the analyst sees the job ``running``, with no model,
    until as long after its start as the cap on trials would take at the pace of its first
    trial — so that when the model appears tells little about how many trials ran
    (:func:`service.visibility.hold_until`).
    """

    epsilon: float = Field(
        gt=0,
        le=100,
        description="The job's target ε: the whole search, every trial and retry included, is "
        "planned to cost at most this and at least 0.99 of it.",
    )
    delta: float | None = Field(
        None,
        ge=DELTA[0],
        le=DELTA[1],
        description="The job's δ, at most the dataset's. Null: the dataset's δ under `rdp` and "
        "`ps` (their RDP curves compose with the dataset's other charges); under `lt` "
        f"{STATEMENT_DELTA_SHARE:g} of the dataset's δ that (ε, δ) statements may hold and do "
        "not hold yet, as `lt`'s δ is held out of the dataset's by basic composition, so that "
        "the defaults fit in any order of jobs. The plan's `defaults` names each value the "
        "planner filled in, and why.",
    )
    accounting: Literal["rdp", "lt", "ps"] = Field(
        description="How the search is charged. `rdp`: a fixed number K of trials composed in "
        "RDP, K = grid size × `trials`. `lt`: Liu–Talwar random stopping, charged as an "
        "(ε, δ) pair whose δ comes out of the dataset's δ. `ps`: Papernot–Steinke, K drawn "
        "from a truncated negative binomial. Under `lt` and `ps` the search space may hold no "
        "grid: candidates are drawn at random from a fixed prior."
    )
    trials: int | None = Field(
        None,
        ge=1,
        le=MAX_TRIALS,
        description="`rdp`: random draws per grid point (null: 1); required when a dimension "
        "of the search space is random.",
    )
    max_retries: int = Field(
        0,
        ge=0,
        le=3,
        description="`rdp`: re-runs of a failed trial, reserved with the job and charged if used.",
    )
    #: at least 1/MAX_TRIALS, as ``expected_trials`` is at most MAX_TRIALS
    gamma: float | None = Field(
        None,
        ge=1 / MAX_TRIALS,
        le=1,
        description="`lt`: γ, the probability of stopping after each trial; give it or "
        "`expected_trials`.",
    )
    expected_trials: float | None = Field(
        None,
        ge=1,
        le=MAX_TRIALS,
        description="`lt`: the expected number of trials 1/γ, instead of `gamma`.",
    )
    delta2: float | None = Field(
        None,
        ge=DELTA[0],
        le=DELTA[1],
        description="`lt`: δ₂, which sets the cap on trials, ln(1/δ₂)/γ; null: "
        f"{LT_DELTA2_SHARE:g} of the job's δ.",
    )
    mean: float | None = Field(
        None,
        ge=1,
        le=MAX_TRIALS,
        description="`ps` (required): the expected number of trials, E[K].",
    )
    eta: (
        Annotated[float, Field(ge=0, le=10), AfterValidator(checked_eta)]
        | Literal["poisson"]
        | None
    ) = Field(
        None,
        description="`ps` (required): η of the truncated negative binomial (1: geometric, "
        f"0: logarithmic; a positive η at least {ETA_MIN:g}), or `poisson`.",
    )
    max_trials: int | None = Field(
        None,
        ge=1,
        le=MAX_TRIALS,
        description="`ps`: a cap on K. Null: the smallest cap whose cost in δ, "
        f"(1 + e^ε)·P[K > cap], is at most {CAP_DELTA_SHARE:g}·δ, ε the larger of the dataset's "
        "and the job's "
        f"(refused on `privacy.mean` if above {MAX_TRIALS}); a cap given whose cost is not "
        "below the job's δ is refused.",
    )
    hold_release: bool = Field(
        False,
        description="`lt`, `ps`: analysts see the job running, without a model, until as long "
        "after its start as the cap on trials would take at the pace of its first trial, so "
        "that when the model appears tells little about how many trials ran.",
    )

    @model_validator(mode="after")
    def _method_fields(self) -> Self:
        allowed = {
            "rdp": {"trials", "max_retries"},
            "lt": {"gamma", "expected_trials", "delta2", "hold_release"},
            "ps": {"mean", "eta", "max_trials", "hold_release"},
        }[self.accounting]
        method_fields = {
            "trials",
            "max_retries",
            "gamma",
            "expected_trials",
            "delta2",
            "mean",
            "eta",
            "max_trials",
            "hold_release",
        }
        # a field counts as given when it differs from its default, so that a stored spec
        # (dumped with every field) validates again
        given = {n for n in method_fields if getattr(self, n) != type(self).model_fields[n].default}
        for name in sorted(given - allowed):
            raise ValueError(f"privacy.{name}: not a parameter of accounting {self.accounting!r}")
        if self.accounting == "lt" and (self.gamma is None) == (self.expected_trials is None):
            raise ValueError("privacy.gamma: lt needs exactly one of gamma or expected_trials")
        if self.accounting == "ps" and (self.mean is None or self.eta is None):
            raise ValueError("privacy.mean: ps needs mean and eta (a number, or 'poisson')")
        return self


#: the searched learning rate of a ``scaling`` job (its only dimension)
LR = "optimizer.lr"
#: a run's key in a ``scaling`` job's trial parameters: the index of its level in the plan
#: (``Plan.scaling``; the final run's is the number of cheap levels); the final run's also
#: carry the fitted line (:data:`SCALING_FIT`)
LEVEL = "scaling.level"
SCALING_FIT = ("scaling.slope", "scaling.r")
#: cheap levels of a ``scaling`` job whose ``levels`` are left to the planner
DEFAULT_LEVELS = 2
#: the share of the job's ε its cheap runs take when ``scaling.share`` is left out
DEFAULT_SHARE = 0.5


class Scaling(Strict):
    """Cheap trials, then one final run (Panda et al., "A New Linear Scaling Rule for Private
    Adaptive Hyperparameter Optimization", ICML 2024): the search space holds the final run's
    candidate learning rates; at each of a few small privacy levels every candidate runs at
    its rate scaled down by the level's ε over the final run's (where the rule puts that
    level's best); at each level the best score gives r* = lr·T, the line r*(ε) = a·ε is
    fitted through the levels (on a log scale, :func:`runner.search.fit_slope`), and one final
    run trains at the ε the budget leaves with lr = a·ε_f/T. Every
    run is a fixed mechanism and the final lr is chosen from released DP outputs
    (post-processing), so the job costs the composition of all its runs (RDP or PLD, the
    smaller: ``service.scaling``), and every run's outputs are shown."""

    levels: (
        Annotated[
            list[Annotated[float, StrictType(), Field(gt=0, le=100)]],
            Field(min_length=2, max_length=4),
        ]
        | None
    ) = Field(
        None,
        description="The ε of one cheap run at each level (at the job's δ), ascending, 2 to 4 "
        "levels; every candidate learning rate runs once at each, scaled down by the level's ε "
        "over the final run's. Null: "
        f"{DEFAULT_LEVELS} levels, the second with about twice the first's ε (half its σ), "
        "placed so that all cheap runs together cost `share` of the job's ε.",
    )
    share: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Without `levels`: the share of the job's ε (all cheap runs composed, at "
        f"its δ) the cheap runs take; the final run gets the rest. Null: {DEFAULT_SHARE:g}.",
    )

    @model_validator(mode="after")
    def _levels(self) -> Self:
        if self.levels is not None:
            if any(b <= a for a, b in itertools.pairwise(self.levels)):
                raise ValueError(f"scaling.levels: {self.levels} must be strictly ascending")
            if self.share is not None:
                raise ValueError("scaling.share: give levels or a share, not both")
        return self

    @property
    def level_count(self) -> int:
        return DEFAULT_LEVELS if self.levels is None else len(self.levels)


def lr_range(dim: Dimension) -> tuple[float, float]:
    """The learning rates a ``scaling`` job's runs may take: up to the largest searched (the
    final run's candidates), down to the optimizer's smallest (a cheap run's rate is a
    candidate's scaled down by its level's share of ε, :func:`runner.search.scaling_candidates`)."""
    return LEARNING_RATE[0], max(float(v) for v in endpoints(dim))


class Selection(Strict):
    """How the released trial is chosen. The only metric is the DP selection score each trial
    releases (docs/design.md, invariant 5): validation accuracy on the public split, or on the
    private hold-out through the Gaussian mechanism. Any other metric would be computed on
    private data without noise, so it is refused rather than silently ignored."""

    metric: Literal["val_accuracy"] = Field(
        "val_accuracy",
        description="The DP selection score each trial releases; any other metric would be "
        "computed on private data without noise, and is refused.",
    )
    mode: Literal["max", "min"] = Field(
        "max", description="Whether the highest or the lowest score is released."
    )

    def best(self, scores: Mapping[K, float]) -> K | None:
        """The key of the best score (None when there is none): the one rule that picks the
        released trial, applied by the runner and checked by the control plane."""
        sign = 1 if self.mode == "max" else -1
        return max(scores, key=lambda key: sign * scores[key], default=None)


class Resources(Strict):
    """Per trial; passed to Ray (``tune.with_resources``)."""

    cpu: float = Field(1.0, ge=0.01, le=64, description="CPUs of each trial.")
    gpu: float = Field(
        0.0, ge=0, le=8, description="GPUs of each trial; a fraction shares a GPU between trials."
    )


class JobSpec(Strict):
    dataset: int = Field(
        ge=1,
        le=MAX_ID,
        description="Id of a registered dataset in the key's scope: the private data the job "
        "trains on, whose budget pays for it.",
    )
    model: ModelConfig = Field(description="The model each trial trains.")
    method: MethodConfig = Field(
        default_factory=MethodConfig,
        description="How per-example gradients are clipped. Left out (and no `method.*` or "
        "`optimizer.name` searched): the method that wins untuned for the optimizer, AUTO-S "
        "with SGD and DC-SGD-E with the Adam family; the plan's `defaults` says which.",
    )
    optimizer: OptimizerConfig = Field(
        default_factory=OptimizerConfig,
        description="The optimizer that steps on the private (clipped, noised) gradient.",
    )
    validation: ValidationConfig = Field(
        default_factory=ValidationConfig,
        description="Where each trial's DP selection score comes from. Left out: the "
        "dataset's public split if it has one, else a private hold-out whose score's release "
        "noise has a small standard deviation at a small share of ε (the plan's `defaults` "
        "and `score_std` say which).",
    )
    epochs: Epochs | None = Field(
        None,
        description="Epochs of each trial: with B, T = round(epochs·N/B) steps (at least 1). "
        "Null: the planner picks them (the plan's `defaults` says why).",
    )
    batch_size: BatchSize | None = Field(
        None,
        description="The expected batch size B: each step samples each example with "
        "probability q = B/N. Null: the planner picks it (the plan's `defaults` says why).",
    )
    physical_batch_size: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="The most examples in one micro-batch: memory and speed only, no privacy "
        "effect.",
    )
    search_space: dict[str, Dimension] = Field(
        default_factory=dict,
        max_length=MAX_DIMENSIONS,
        description='Per searched field, `{"grid": [...]}` (every value), `{"values": [...]}` '
        '(one drawn at random per trial) or `{"log_uniform": [low, high]}`; at most '
        f"{MAX_VALUES} values each and {MAX_TRIALS} trials in all. Searchable: "
        f"{', '.join(f'`{path}`' for path in [*SEARCHABLE, *SHAPES])}. `batch_size` and "
        "`epochs` take a `grid` under `rdp` and `values` under `lt`/`ps`, at most "
        f"{MAX_SHAPES} combinations, each with its own σ.",
    )
    privacy: Privacy = Field(description="The job's privacy target and how its trials are charged.")
    selection: Selection = Field(
        default_factory=Selection, description="How the released trial is chosen."
    )
    resources: Resources = Field(
        default_factory=Resources, description="What each trial asks Ray for."
    )
    seed: int | None = Field(
        None,
        ge=0,
        lt=2**32,
        description="`rdp` only: fixes the random draws of candidates from the search space "
        "(every trial's outcome is released anyway). Refused under `lt`/`ps`, whose trials "
        "draw their candidates from OS entropy. No seed reaches a trial: its privacy "
        "randomness is fresh OS entropy.",
    )
    proxy: int | None = Field(
        None,
        ge=1,
        le=MAX_ID,
        description="`rdp` only: id of a public dataset (registered `public`, same input shape "
        "and classes) to search on: every candidate trains there, for free, and only the best "
        "trains on `dataset`, once, charged as one trial.",
    )
    scaling: Scaling | None = Field(
        None,
        description="`rdp` only, with `optimizer.lr` the only searched field (a `grid`, or "
        "`log_uniform` with `privacy.trials` draws) and no `proxy`: cheap runs of every "
        "learning rate at small privacy levels, then one final run, the released one, at the "
        "ε the budget leaves with the learning rate their best scores extrapolate to "
        "(Panda et al., ICML 2024). The job is charged the composition of every run (RDP or "
        "PLD, whichever is smaller); every run is shown.",
    )

    @model_validator(mode="before")
    @classmethod
    def _json(cls, data: Any) -> Any:
        """Refuse NaN, ±inf, deep nesting and strings that are not text anywhere, including
        inside the embedded worker configs, before anything recurses into the value."""
        check_json(data)
        return data

    @model_validator(mode="after")
    def _search_space(self) -> Self:
        for path, dim in self.search_space.items():
            _check_dimension(self, path, dim)
        random = [p for p, d in self.search_space.items() if not isinstance(d, Grid)]
        privacy = self.privacy
        if privacy.accounting == "rdp":
            if random and privacy.trials is None:
                raise ValueError(
                    f"privacy.trials: required with random dimension {random[0]!r} "
                    "(the number of random draws)"
                )
        elif len(random) < len(self.search_space):
            grid = next(p for p, d in self.search_space.items() if isinstance(d, Grid))
            raise ValueError(
                f"search_space.{grid}: grid search is not allowed under {privacy.accounting!r}: "
                "random-stopping trials are drawn at random from a fixed prior (docs/design.md "
                "invariant 6); use 'values' or 'log_uniform'"
            )
        if self.proxy is not None and privacy.accounting != "rdp":
            raise ValueError(
                f"proxy: not allowed under {privacy.accounting!r}: the search on public data "
                "is free and the one private run is charged as an 'rdp' trial"
            )
        if self.seed is not None and privacy.accounting != "rdp":
            raise ValueError(
                f"seed: not allowed under {privacy.accounting!r}: each trial draws its candidate "
                "from OS entropy, so that the released hyperparameters do not tell which draw "
                "won (and so how many trials ran)"
            )
        shaped = [p for p in self.search_space if p in SHAPES]
        if shaped and len(self.shape_grid()) > MAX_SHAPES:
            raise ValueError(
                f"search_space.{shaped[0]}: {len(self.shape_grid())} combinations of "
                f"{' and '.join(shaped)} exceed {MAX_SHAPES} (each gets its own noise)"
            )
        count = max(self.candidate_count(), self.trial_count())
        if count > MAX_TRIALS:
            raise ValueError(f"search_space: {count} trials exceed {MAX_TRIALS}")
        return self

    @model_validator(mode="after")
    def _scaling(self) -> Self:
        """A scaling job searches the learning rate alone, at one fixed shape, under fixed-K
        accounting: its final run's lr is extrapolated as r/T at that T (Panda et al.'s rule
        is for lr at a fixed batch size and number of steps)."""
        if self.scaling is None:
            return self
        if self.privacy.accounting != "rdp":
            raise ValueError(
                f"scaling: not allowed under {self.privacy.accounting!r}: its runs are a fixed "
                "number of mechanisms, all released, composed in RDP ('rdp')"
            )
        if self.proxy is not None:
            raise ValueError("proxy: not allowed with scaling, whose cheap runs are private")
        for path in self.search_space:
            if path != LR:
                raise ValueError(f"search_space.{path}: scaling searches {LR} alone")
        dim = self.search_space.get(LR)
        if not isinstance(dim, Grid | LogUniform):
            raise ValueError(
                f"search_space.{LR}: scaling needs a grid or a log_uniform range of learning rates"
            )
        return self

    def trial_config(
        self,
        dataset: DatasetConfig,
        shape: Shape,
        delta: float,
        params: dict[str, Scalar],
    ) -> TrialConfig:
        """One trial's configuration: the spec's parts with a candidate's hyperparameters
        (search-space path → value) applied, and its shape's *planned* B, epochs and σ — a
        trial never calibrates its own noise, so it costs exactly what was reserved."""
        parts = {name: getattr(self, name).model_dump() for name in ("method", "optimizer")}
        for path, value in params.items():
            if self.scaling is not None and path in (LEVEL, *SCALING_FIT):
                continue  # the run's level (its σ is its shape's) and the fitted line
            if path not in self.search_space:
                raise ValueError(f"{path}: not a dimension of the job's search space")
            if path in SHAPES:
                if value != getattr(shape, path):
                    raise ValueError(f"{path}: {value} is not the shape's {getattr(shape, path)}")
                continue
            dim = self.search_space[path]
            if self.scaling is not None:  # a cheap run's scaled rate, or the fitted final one
                low, high = lr_range(dim)
                value = min(max(value, low), high)
            elif isinstance(dim, LogUniform):  # exp(U(ln low, ln high)) may round past an end
                value = min(max(value, dim.log_uniform[0]), dim.log_uniform[1])
            part, name = path.split(".")
            parts[part][name] = value
        return TrialConfig(
            dataset=dataset,
            model=self.model,
            validation=self.validation,
            epochs=shape.epochs,
            batch_size=shape.batch_size,
            physical_batch_size=self.physical_batch_size,
            noise_multiplier=shape.noise_multiplier,
            delta=delta,
            **parts,
        )

    def shape_grid(self) -> list[dict[str, Any]]:
        """Every (batch_size, epochs) a trial may run with: the product of the searched values,
        a field not searched keeping the spec's value (None: the planner's default)."""
        values = [
            endpoints(self.search_space[p]) if p in self.search_space else [getattr(self, p)]
            for p in SHAPES
        ]
        return [dict(zip(SHAPES, combo, strict=True)) for combo in itertools.product(*values)]

    def grid_size(self) -> int:
        return math.prod(len(d.grid) for d in self.search_space.values() if isinstance(d, Grid))

    def candidate_count(self) -> int:
        """Candidates of a fixed-K search: grid points × random draws (1 under ``lt``/``ps``,
        whose K is random)."""
        if self.privacy.accounting != "rdp":
            return 1
        return self.grid_size() * (self.privacy.trials or 1)

    def trial_count(self) -> int:
        """Trials on the private data: every candidate under ``rdp``, the chosen one after a
        search on a ``proxy``, every candidate at each ``scaling`` level and the final run;
        1 under ``lt``/``ps`` (K is random)."""
        if self.scaling is not None:
            return self.candidate_count() * self.scaling.level_count + 1
        return 1 if self.proxy is not None else self.candidate_count()


def endpoints(dim: Dimension) -> list[Scalar]:
    """The listed values, or the two ends of a range (the field's constraints are intervals)."""
    if isinstance(dim, Grid):
        return dim.grid
    return dim.values if isinstance(dim, Choice) else list(dim.log_uniform)


def _check_dimension(spec: JobSpec, path: str, dim: Dimension) -> None:
    """Every value a dimension can take must be a valid setting of its field."""
    if path in SHAPES:
        _check_shape_dimension(spec, path, dim)
        return
    if path not in SEARCHABLE:
        raise ValueError(
            f"search_space.{path}: cannot be searched; searchable: "
            f"{', '.join([*SEARCHABLE, *SHAPES])} (the noise is planned for each candidate)"
        )
    part, name = path.split(".")
    base = getattr(spec, part)
    for value in endpoints(dim):
        try:
            SEARCHABLE[path].model_validate({**base.model_dump(), name: value})
        except ValidationError as error:
            reason = error.errors()[0]["msg"]
            raise ValueError(f"search_space.{path}: bad value {value!r}: {reason}") from None


def _check_shape_dimension(spec: JobSpec, path: str, dim: Dimension) -> None:
    """A shape is a finite set of values, each planned on its own: a grid under ``rdp`` (every
    one runs, and is charged), a choice under random stopping (each trial draws one)."""
    kind = "grid" if spec.privacy.accounting == "rdp" else "values"
    if not isinstance(dim, Grid if kind == "grid" else Choice):
        raise ValueError(
            f"search_space.{path}: give {{'{kind}': [...]}} under {spec.privacy.accounting!r}: "
            "each value gets its own planned noise"
        )
    for value in endpoints(dim):
        try:
            SHAPES[path].validate_python(value)
        except ValidationError as error:
            reason = error.errors()[0]["msg"]
            raise ValueError(f"search_space.{path}: bad value {value!r}: {reason}") from None
    if len(set(endpoints(dim))) < len(endpoints(dim)):
        raise ValueError(f"search_space.{path}: values repeat")
