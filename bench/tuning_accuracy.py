"""Tuning accuracy: the released model's held-out accuracy of whole tuning jobs at a fixed total ε.

    flock /tmp/dptune-ray.lock nice -n 10 .venv/bin/python bench/tuning_accuracy.py --quick
    flock /tmp/dptune-ray.lock nice -n 10 .venv/bin/python bench/tuning_accuracy.py \\
        --datasets digits --epsilons 1,4 --seeds 3 --reference

Every job runs through the product's own path, as ``bench/job_overhead.py`` does: a Ray head
started with ``ray start`` (token auth on, 2 CPUs), ``dptune serve`` against it, datasets
registered and jobs POSTed over HTTP; the released model is downloaded
(``GET /v1/jobs/{id}/model``), rebuilt from the config in its metadata and scored here on a
TEST split the product never saw.

**Data.** Each dataset is written to an ``npz`` under the service's DATA_DIR with its private
training part (``x``, ``y``) and a public validation part (``x_val``, ``y_val``, the selection
score); the test part stays in this process. ``digits``: scikit-learn's 1797 images, 20% test,
10% of the rest public validation. ``mnist1d``: the ``mnist1d`` package's procedural data (its
``make_dataset``, never a download; :func:`workers.data.mnist1d`), its 1000 test rows held out,
10% of the 4000 training rows public validation. ``heavy_tail``: paper 004's synthetic problem
(:func:`workers.data.heavy_tail`, ``--heavy-tail-scale``); its labels are independent of the
inputs, so there is nothing to generalize to: as in paper 004 the accuracy reported is on the
*training* set, and the public validation split is a second draw of the inputs with the same
labels (so selection sees only the class prior). ``--npz PATH``: ``x``, ``y`` and optionally
``x_val``/``y_val`` and ``x_test``/``y_test`` (split off as for digits when absent).

**Privacy.** Every job asks for the total ε at ``privacy.delta`` = 1/N (N the private training
rows), whatever the accounting. Each job gets its own dataset registration (so jobs share no
budget) with budget ε exactly the job's and δ = 2/N: a Liu–Talwar job's δ (and a
Papernot–Steinke cap's) is charged by basic composition, and the ledger refuses a job whose
(ε, δ) charges would use up all of the dataset's δ.

**Methods** (paper 001, Tables VI and VII; one optimizer for all, Adam at lr 0.01 as paper
001's Table IV, DP-GD on heavy_tail as paper 004: :data:`DATASETS`): DP-SGD (Abadi's
clipping) tuned over the threshold grid C ∈ {0.1 0.2 0.5 0.8 1 2 4 6 8 10}; DC-SGD-P (p = 0.5:
p is not a searchable field of the product), DC-SGD-E, AUTO-S, Andrew et al. and Du et al. in
one run each, at their defaults (paper 001 also tunes Du's C₀ and ρ_C, and Andrew's p and η_C:
left out for time; ``Method({"adaptive": {"rule": "du"}}, {"method.threshold": THRESHOLDS})``
would tune C₀); the search over batch size and epochs ("shape"), at C = 1; "recipe": one run
of DP-SGD at C = 1 whose spec leaves out ``batch_size``, ``epochs`` and ``optimizer.lr`` for
the planner's recipes (``service/recipes.py``); "default": the same with no ``method``
either, for the planner's default method (DC-SGD-E with the Adam family, AUTO-S with SGD);
and "proxy": DP-SGD's threshold grid searched
on a public proxy (the dataset's public validation part, registered with ``public: true``),
the best candidate then trained once on the private data (``rdp`` only: the product refuses a
proxy under ``lt``/``ps``); "scaling": DP-SGD at C = 1 with plain SGD, at the recipe's
batch size and epochs, its learning rate searched over :data:`SCALING_LRS` as the spec's
``scaling`` runs it (Panda et al., ICML 2024: every
rate at two cheap privacy levels, then one final run at the rate their best scores
extrapolate to; ``rdp`` only, as the product allows; its reference, ``--reference scaling``,
trains each rate alone at the full ε, the full-budget sweep its final rate is compared
with); "scaling-m" the same with momentum 0.9 over :data:`SCALING_MOMENTUM_LRS`, and
"scaling-adam" with the recipe's Adam over :data:`SCALING_ADAM_LRS`. Otherwise
the learning rate is not searched (paper 001 searches it too; here it is
fixed per dataset). Each method is charged three ways:

- ``rdp``: a grid search, K = grid size (one-run methods: K = 1);
- ``lt``: Liu–Talwar random stopping over the same candidates drawn uniformly at random
  (``values``), ``expected_trials`` = grid size (one-run methods: 1, i.e. γ = 1: exactly one
  trial, charged as Liu–Talwar charges it), δ₂ the product's default (δ/2);
- ``ps``: Papernot–Steinke with ``eta: 1`` (K geometric, the truncated negative binomial with
  η = 1), ``mean`` = grid size (one-run methods: 1), the product's default cap on K.

Under rdp, ``--seeds`` are the jobs' ``seed`` (unused by a grid) and repetitions; every run's
DP noise comes from OS entropy anyway.

**Reference** (``--reference``, or ``--reference DP-SGD,Du`` for some methods; paper 001
Table IV "without the privacy cost of tuning"): every
candidate of a method trained alone at the full ε (rdp, K = 1, one job each); per method and ε
the best candidate by mean test accuracy over seeds (an oracle choice, as the paper's table).

**Wall time**: from the POST to the job's terminal state (``wall``), and the job's own
``started_at``→``finished_at`` (``run``). ``--concurrency`` jobs are in flight at once (they
share the 2 CPUs, so a job's times grow with it; the bench's total time shrinks). Jobs go in
ε by ε, seed by seed within; ``--minutes M`` submits none after M minutes (those in flight
finish), so a run cut short has every seed of its first ε values.

Writes ``<out>.json`` and ``<out>.png`` (accuracy vs ε per method, one panel per dataset ×
accounting, reference dashed). Default ``--out``: ``docs/tuning_accuracy``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # job_overhead: ``dptune serve`` against a cluster
sys.path.insert(0, str(ROOT / "tests" / "e2e"))  # the e2e tests' own Ray cluster helper
from cluster import local_cluster  # noqa: E402
from job_overhead import dptune_serve  # noqa: E402

from core.config import ModelConfig  # noqa: E402
from workers.models import build_model  # noqa: E402

#: paper 001, Table VII: the clipping thresholds C
THRESHOLDS = [0.1, 0.2, 0.5, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0]
QUICK_THRESHOLDS = [0.1, 1.0, 10.0]
#: a scaling job's optimizer and the rates it searches: plain SGD, as Panda et al.'s rule
#: scales the distance r = lr·T an SGD run travels (Adam's step does not grow with the
#: gradient's signal, and with it the best rate fell as ε grew: a first run of this bench), over
#: half-decades from the recipe's SGD rate 0.5/C at C = 1 (``service/recipes.py``) up
SCALING_SGD = {"name": "sgd"}
SCALING_LRS = [0.3, 1.0, 3.0]
#: the same with heavy-ball momentum 0.9 (a step travels lr/(1 − 0.9) in the long run: rates a
#: tenth of plain SGD's)
SCALING_MOMENTUM = {"name": "sgd", "momentum": 0.9}
SCALING_MOMENTUM_LRS = [0.03, 0.1, 0.3]
#: the same with the recipe's Adam, over half-decades about its rate 0.01
SCALING_ADAM = {"name": "adam"}
SCALING_ADAM_LRS = [0.003, 0.01, 0.03]
ACCOUNTINGS = ("rdp", "lt", "ps")
TERMINAL = ("released", "succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class Method:
    """A spec fragment (``method`` and top-level fields) and the dimensions it searches
    (spec path → candidate values); no dimension: one run."""

    method: dict[str, Any]
    search: dict[str, list[Any]] = field(default_factory=dict)
    #: spec paths left out, for the planner's recipes to fill in (``service/recipes.py``)
    recipe: tuple[str, ...] = ()
    #: search on the dataset's public validation part as the job's public ``proxy`` (rdp only)
    proxy: bool = False
    #: cheap runs of every candidate at small privacy levels, then one final run at the
    #: extrapolated learning rate (the spec's ``scaling``, rdp only)
    scaling: bool = False
    #: the optimizer's fields this method sets over the dataset's (:data:`DATASETS`)
    optimizer: dict[str, Any] = field(default_factory=dict)

    @property
    def rdp_only(self) -> bool:
        return self.proxy or self.scaling

    def candidates(self) -> list[dict[str, Any]]:
        """Every point of the search grid (one empty point for a one-run method)."""
        paths = list(self.search)
        return [dict(zip(paths, v, strict=True)) for v in itertools.product(*self.search.values())]


def methods(thresholds: list[float], quick: bool) -> dict[str, Method]:
    shapes = {"batch_size": [64, 256], "epochs": [5, 15]} if quick else None
    return {
        "DP-SGD": Method({"clipping": "abadi"}, {"method.threshold": thresholds}),
        "DC-SGD-P": Method({"adaptive": {"rule": "dcsgd_p"}}),
        "DC-SGD-E": Method({"adaptive": {"rule": "dcsgd_e"}}),
        "AUTO-S": Method({"clipping": "auto_s"}),
        "Andrew": Method({"adaptive": {"rule": "andrew"}}),
        "Du": Method({"adaptive": {"rule": "du"}}),
        "shape": Method(
            {"clipping": "abadi", "threshold": 1.0},
            shapes or {"batch_size": [64, 128, 256], "epochs": [5, 15, 30]},
        ),
        "recipe": Method(
            {"clipping": "abadi", "threshold": 1.0}, recipe=("batch_size", "epochs", "optimizer.lr")
        ),
        "default": Method({}, recipe=("method", "batch_size", "epochs", "optimizer.lr")),
        "proxy": Method({"clipping": "abadi"}, {"method.threshold": thresholds}, proxy=True),
        "scaling": _scaling(SCALING_LRS, SCALING_SGD),
        "scaling-m": _scaling(SCALING_MOMENTUM_LRS, SCALING_MOMENTUM),
        "scaling-adam": _scaling(SCALING_ADAM_LRS, SCALING_ADAM),
    }


def _scaling(rates: list[float], optimizer: dict[str, Any]) -> Method:
    """A scaling job of DP-SGD at C = 1 over these rates, at the recipe's batch size and epochs."""
    return Method(
        {"clipping": "abadi", "threshold": 1.0},
        {"optimizer.lr": rates},
        recipe=("batch_size", "epochs"),
        scaling=True,
        optimizer=optimizer,
    )


@dataclass
class Split:
    """A dataset as the bench holds it: what the product gets (train, public validation) and
    what it never sees (test)."""

    x: np.ndarray
    y: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    #: what the test accuracy measures ("held-out" or "training")
    test_kind: str = "held-out"

    def save(self, path: Path) -> None:
        """The product's part only: train and public validation."""
        np.savez(path, x=self.x, y=self.y, x_val=self.x_val, y_val=self.y_val)

    def save_public(self, path: Path) -> None:
        """The public validation part alone, as a public proxy dataset: it trains there and is
        scored on the same rows (too few to split; DP training hardly overfits)."""
        np.savez(path, x=self.x_val, y=self.y_val, x_val=self.x_val, y_val=self.y_val)


def split(
    x: np.ndarray, y: np.ndarray, test: float = 0.2, val: float = 0.1, seed: int = 0
) -> Split:
    """Disjoint test (``test`` of the rows), public validation (``val`` of the rest) and
    training parts, by a seeded permutation."""
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = round(test * len(y))
    n_val = round(val * (len(y) - n_test))
    te, va, tr = order[:n_test], order[n_test : n_test + n_val], order[n_test + n_val :]
    f, i = np.float32, np.int64
    return Split(
        x[tr].astype(f),
        y[tr].astype(i),
        x[va].astype(f),
        y[va].astype(i),
        x[te].astype(f),
        y[te].astype(i),
        int(y.max()) + 1,
    )


def digits_split(_: argparse.Namespace) -> Split:
    from sklearn.datasets import load_digits

    raw = load_digits()
    return split(raw.images[:, None] / 16.0, raw.target)


def mnist1d_split(_: argparse.Namespace) -> Split:
    from workers.data import mnist1d

    data = mnist1d({})
    assert data.x_val is not None and data.y_val is not None
    part = split(data.x.numpy(), data.y.numpy(), test=0.0)
    part.x_test, part.y_test = data.x_val.numpy(), data.y_val.numpy()
    return part


def heavy_tail_split(args: argparse.Namespace) -> Split:
    from workers.data import heavy_tail

    options = {"scale": args.heavy_tail_scale}
    train, other = heavy_tail(options), heavy_tail({**options, "seed": 1})
    x, y = train.x.numpy(), train.y.numpy()
    return Split(x, y, other.x.numpy(), y, x, y, train.num_classes, test_kind="training")


def npz_split(path: Path) -> Split:
    """A user's file: its own test and public validation parts where it has them, otherwise
    split off as for digits."""
    with np.load(path, allow_pickle=False) as raw:
        arrays = {k: raw[k] for k in raw.files}
    has_test = "x_test" in arrays
    part = split(arrays["x"], arrays["y"], test=0.0 if has_test else 0.2)
    if has_test:
        part.x_test, part.y_test = arrays["x_test"], arrays["y_test"]
    if "x_val" in arrays:  # the file's own public validation split; ours goes back to training
        part.x, part.y = np.concatenate([part.x, part.x_val]), np.concatenate([part.y, part.y_val])
        part.x_val = arrays["x_val"].astype(np.float32)
        part.y_val = arrays["y_val"].astype(np.int64)
    part.num_classes = int(max(a.max() for a in (part.y, part.y_val, part.y_test))) + 1
    return part


@dataclass(frozen=True)
class Setup:
    """How a dataset is built and trained: the spec parts every job on it shares."""

    build: Callable[[argparse.Namespace], Split]
    model: dict[str, Any]
    optimizer: dict[str, Any]
    epochs: float
    batch_size: int


#: one optimizer for every method (the learning rate is not searched): with SGD at one learning
#: rate, methods whose threshold ends far from 1 (DC-SGD-E/P, Andrew) diverged on digits while
#: Adam, invariant to the gradient's scale, trained them all (a one-trial check at ε = 1)
ADAM = {"name": "adam", "lr": 0.01}
DATASETS: dict[str, Setup] = {
    # Adam as paper 001's Table IV
    "digits": Setup(digits_split, {"name": "cnn"}, ADAM, 15, 128),
    "mnist1d": Setup(mnist1d_split, {"name": "cnn"}, ADAM, 15, 128),
    # paper 004's linear model, full-batch DP-GD at its lr
    "heavy_tail": Setup(
        heavy_tail_split, {"name": "logreg", "options": {"bias": False}}, {"lr": 1.0}, 100, 0
    ),
}
NPZ_SETUP = {"model": {"name": "mlp"}, "optimizer": ADAM}


def job_spec(
    dataset: int,
    setup: Setup,
    n: int,
    method: Method,
    accounting: str,
    epsilon: float,
    seed: int,
    fixed: dict[str, Any] | None = None,
    proxy: int | None = None,
) -> dict[str, Any]:
    """The job a method is run as, charged by ``accounting`` at total ``epsilon`` and δ = 1/n.
    ``fixed``: one candidate (spec path → value) trained alone instead of a search (the
    reference). ``proxy``: the public dataset a proxy method searches on."""
    spec: dict[str, Any] = {
        "dataset": dataset,
        "model": setup.model,
        "method": dict(method.method),
        "optimizer": {"name": "sgd", **setup.optimizer, **method.optimizer},
        "validation": {"split": "public"},
        "epochs": setup.epochs,
        "batch_size": setup.batch_size or n,  # 0: full batch
        "physical_batch_size": 256,
        "privacy": {"epsilon": epsilon, "delta": 1 / n, "accounting": accounting},
    }
    search = method.search if fixed is None else {}
    for path, value in (fixed or {}).items():
        holder, name = _field(spec, path)
        holder[name] = value
    for path in method.recipe:
        holder, name = _field(spec, path)
        del holder[name]
    if method.proxy and fixed is None:
        spec["proxy"] = proxy
    if method.scaling and fixed is None:
        spec["scaling"] = {}
    kind = "grid" if accounting == "rdp" else "values"
    spec["search_space"] = {path: {kind: values} for path, values in search.items()}
    k = math.prod(len(v) for v in search.values())
    if accounting == "rdp":
        spec["seed"] = seed
    elif accounting == "lt":
        spec["privacy"]["expected_trials"] = k
    else:
        spec["privacy"] |= {"mean": k, "eta": 1}
    return spec


def spec_key(spec: dict[str, Any]) -> str:
    """What makes two jobs the same job (the dataset registration aside)."""
    return json.dumps({k: v for k, v in spec.items() if k != "dataset"}, sort_keys=True)


@dataclass
class Run:
    """One job: what it was, and what came of it."""

    dataset: str
    method: str
    accounting: str
    epsilon: float
    seed: int
    #: the candidate trained alone (reference runs), None for a tuning job
    fixed: dict[str, Any] | None = None
    job: int | None = None
    status: str = "pending"
    error: str | None = None
    accuracy: float | None = None
    #: the released trial config's searched fields (threshold, batch size, epochs)
    released: dict[str, Any] = field(default_factory=dict)
    #: the plan's σ (None when shapes differ) and one trial's ε (the largest shape's)
    noise_multiplier: float | None = None
    trial_epsilon: float | None = None
    trials: int | None = None
    wall_s: float | None = None
    run_s: float | None = None
    #: a scaling job's runs, (level, lr, DP score) each, the levels' and the final run's ε, T,
    #: and the line fitted (the final run's parameters)
    scaling: dict[str, Any] | None = None


def scaling_record(plan: dict[str, Any], trials: list[dict[str, Any]]) -> dict[str, Any]:
    """What a scaling job ran and fitted, from its plan and its trials' views."""
    final = next((t["params"] for t in trials if "scaling.slope" in t["params"]), {})
    return {
        "levels": [level["epsilon"] for level in plan["scaling"]["levels"]],
        "final_epsilon": plan["scaling"]["final"]["epsilon"],
        "steps": plan["shapes"][-1]["steps"],
        "runs": [
            [t["params"]["scaling.level"], t["params"]["optimizer.lr"], t["score"]] for t in trials
        ],
        "fit": {k.split(".")[1]: v for k, v in final.items() if k.startswith("scaling.")},
    }


def read_safetensors(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file (8-byte little-endian header length, a JSON
    header whose ``__metadata__`` holds string pairs, then the data)."""
    from safetensors.torch import load

    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    return load(data), header.get("__metadata__", {})


def released_accuracy(data: bytes, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, Any]]:
    """Rebuild the released model from its file (config and public shape in the metadata) and
    score it on (x, y); also the released config."""
    tensors, meta = read_safetensors(data)
    config, shape = json.loads(meta["config"]), json.loads(meta["dataset"])
    model = build_model(
        ModelConfig.model_validate(config["model"]),
        tuple(shape["input_shape"]),
        shape["num_classes"],
    )
    model.load_state_dict(tensors)
    model.eval()
    with torch.no_grad():
        predicted = model(torch.as_tensor(x, dtype=torch.float32)).argmax(1).numpy()
    return float((predicted == y).mean()), config


def searched_fields(config: dict[str, Any], method: Method) -> dict[str, Any]:
    """The released config's values of the method's searched paths, and of those it left to
    the recipes."""
    out = {}
    for path in [*method.search, *method.recipe]:
        holder, name = _field(config, path)
        out[path] = holder[name]
    return out


def _field(spec: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The dict that holds a spec path's field ("batch_size", "method.threshold"), and its name."""
    part, _, name = path.rpartition(".")
    return (spec[part] if part else spec), name


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def cell(values: list[float], scale: float = 100, digits: int = 1) -> str:
    if not values:
        return "—"
    mean, std = mean_std([v * scale for v in values])
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def reference(runs: list[Run]) -> dict[tuple[str, str, float], tuple[list[float], str]]:
    """Per (dataset, method, ε): the accuracies over seeds of the candidate with the best mean
    (an oracle choice: no tuning cost), and which candidate that was."""
    groups: dict[tuple[str, str, float, str], list[float]] = {}
    for r in runs:
        if r.fixed is not None and r.accuracy is not None:
            key = (r.dataset, r.method, r.epsilon, json.dumps(r.fixed, sort_keys=True))
            groups.setdefault(key, []).append(r.accuracy)
    best: dict[tuple[str, str, float], tuple[list[float], str]] = {}
    for (dataset, method, eps, candidate), accs in groups.items():
        now = best.get((dataset, method, eps))
        if now is None or statistics.mean(accs) > statistics.mean(now[0]):
            best[(dataset, method, eps)] = (accs, candidate)
    return best


def tables(runs: list[Run], names: list[str], epsilons: list[float], seeds: int) -> str:
    """Markdown like paper 001's: per dataset × accounting, rows methods, columns the ε values
    run on that dataset, cells test accuracy (%) mean ± std over seeds (``n=`` when fewer than
    ``seeds`` released) and mean wall time; then the reference."""
    lines = []
    ref = reference(runs)
    for dataset in dict.fromkeys(r.dataset for r in runs):
        shown = [e for e in epsilons if any((r.dataset, r.epsilon) == (dataset, e) for r in runs)]
        kinds = {r.accounting for r in runs if r.dataset == dataset and r.fixed is None}
        for accounting in [a for a in ACCOUNTINGS if a in kinds]:
            lines += [f"\n**{dataset}, {accounting}**: accuracy % (wall s)\n"]
            lines += ["| method | " + " | ".join(f"ε = {e:g}" for e in shown) + " |"]
            lines += ["|---|" + "---|" * len(shown)]
            for name in names:
                row = []
                for eps in shown:
                    done = [
                        r
                        for r in runs
                        if (r.dataset, r.method, r.accounting, r.epsilon, r.fixed)
                        == (dataset, name, accounting, eps, None)
                        and r.status != "pending"  # not submitted (--minutes)
                    ]
                    accs = [r.accuracy for r in done if r.accuracy is not None]
                    walls = [r.wall_s for r in done if r.wall_s is not None]
                    text = cell(accs) + (f" ({statistics.mean(walls):.0f})" if walls else "")
                    text += f" n={len(accs)}" if accs and len(accs) != seeds else ""
                    lost = Counter(r.status for r in done if r.accuracy is None)
                    row.append(
                        text
                        + (f" [{', '.join(f'{n} {s}' for s, n in lost.items())}]" if lost else "")
                    )
                if any(r.method == name and r.dataset == dataset for r in runs):
                    lines.append(f"| {name} | " + " | ".join(row) + " |")
        if any(k[0] == dataset for k in ref):
            lines += [f"\n**{dataset}, no tuning cost** (best single candidate at full ε)\n"]
            lines += ["| method | " + " | ".join(f"ε = {e:g}" for e in shown) + " |"]
            lines += ["|---|" + "---|" * len(shown)]
            for name in names:
                if any(k[:2] == (dataset, name) for k in ref):
                    row = [
                        cell(ref[(dataset, name, e)][0]) if (dataset, name, e) in ref else "—"
                        for e in shown
                    ]
                    lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def scaling_lines(runs: list[Run]) -> str:
    """Where each scaling job's final r = lr·T landed against the best r of the full-budget
    sweep (its reference: every rate alone at the full ε, best by mean test accuracy), per
    dataset and ε, with the cheap levels' best rates and the fitted line."""
    ref = reference(runs)
    lines = []
    for r in runs:
        if r.scaling is None or r.fixed is not None or not r.scaling["fit"]:
            continue
        steps, fit = r.scaling["steps"], r.scaling["fit"]
        best = ref.get((r.dataset, r.method, r.epsilon))
        swept = json.loads(best[1])["optimizer.lr"] * steps if best else math.nan
        final = r.released.get("optimizer.lr", math.nan) * steps
        levels = []
        for level, eps in enumerate(r.scaling["levels"]):
            scored = [(score, lr) for lv, lr, score in r.scaling["runs"] if lv == level]
            levels.append(f"ε {eps:.2f}: r {max(scored)[1] * steps:.3g}" if scored else "—")
        lines.append(
            f"{r.dataset} ε={r.epsilon:g} seed {r.seed}: {'; '.join(levels)}; "
            f"fit r = {fit['slope']:.3g}·ε + {fit.get('intercept', 0):.3g} → {fit['r']:.3g} at "
            f"ε {r.scaling['final_epsilon']:.2f}; final r {final:.3g} (lr {final / steps:.3g}); "
            f"sweep's best r {swept:.3g}; accuracy {100 * (r.accuracy or 0):.1f}%"
        )
    return "\n".join(lines)


def plot(runs: list[Run], names: list[str], path: Path) -> None:
    """Accuracy vs ε per method (mean ± std over seeds), one row per dataset and one column per
    accounting; the reference (no tuning cost) as crosses on a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tuned = [r for r in runs if r.fixed is None and r.accuracy is not None]
    datasets = list(dict.fromkeys(r.dataset for r in tuned))
    kinds = [a for a in ACCOUNTINGS if any(r.accounting == a for r in tuned)]
    if not tuned:
        return
    ref = reference(runs)
    fig, axes = plt.subplots(
        len(datasets),
        len(kinds),
        figsize=(4.5 * len(kinds), 3.8 * len(datasets)),
        squeeze=False,
        sharey="row",
    )
    for (row, dataset), (col, accounting) in itertools.product(
        enumerate(datasets), enumerate(kinds)
    ):
        ax = axes[row][col]
        for i, name in enumerate(names):
            points: dict[float, list[float]] = {}
            for r in tuned:
                if (r.dataset, r.method, r.accounting) == (dataset, name, accounting):
                    points.setdefault(r.epsilon, []).append(100 * r.accuracy)  # type: ignore[operator]
            if points:
                eps = sorted(points)
                stats = [mean_std(points[e]) for e in eps]
                ax.errorbar(
                    eps,
                    [m for m, _ in stats],
                    [s for _, s in stats],
                    label=name,
                    color=f"C{i}",
                    marker="o",
                    capsize=3,
                )
            ref_eps = sorted(e for d, m, e in ref if (d, m) == (dataset, name))
            if ref_eps:
                ax.plot(
                    ref_eps,
                    [100 * statistics.mean(ref[(dataset, name, e)][0]) for e in ref_eps],
                    color=f"C{i}",
                    linestyle="--",
                    marker="x",
                    alpha=0.7,
                )
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dataset}, {accounting}")
        ax.set_xlabel("total ε (δ = 1/N)")
        ax.grid(alpha=0.3)
        if col == 0:
            ax.set_ylabel("test accuracy % (x: no tuning cost)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan_runs(args: argparse.Namespace, table: dict[str, Method]) -> list[Run]:
    """Tuning jobs, then reference runs, ε by ε and seed by seed within, so that a run cut
    short (``--minutes``) has every seed of its first ε values."""
    runs = []
    for dataset, eps, seed in itertools.product(args.datasets, args.epsilons, range(args.seeds)):
        for name in args.methods:
            kinds = ["rdp"] if table[name].rdp_only else args.accountings
            runs += [Run(dataset, name, a, eps, seed) for a in kinds if a in args.accountings]
            if name in args.reference:
                runs += [Run(dataset, name, "rdp", eps, seed, c) for c in table[name].candidates()]
    return runs


def job_groups(runs: list[Run], spec: Callable[[Run], dict[str, Any]]) -> list[list[Run]]:
    """The pending runs grouped by the job that serves them: one per distinct spec and seed (a
    one-run method's reference is its rdp job; repetitions are distinct jobs even where the
    spec has no seed, as under lt and ps)."""
    same: dict[tuple[int, str], list[Run]] = {}
    for run in runs:
        if run.status == "pending":  # not kept from --resume
            same.setdefault((run.seed, spec_key(spec(run))), []).append(run)
    return list(same.values())


def resumed(runs: list[Run], previous: list[dict[str, Any]]) -> int:
    """Fill ``runs`` with the released ones of an earlier report (same dataset, method,
    accounting, ε, seed and candidate); how many."""

    def key(r: Run) -> str:
        return json.dumps([r.dataset, r.method, r.accounting, r.epsilon, r.seed, r.fixed])

    done = {key(r): r for r in (Run(**p) for p in previous) if r.status == "released"}
    kept = 0
    for run in runs:
        if key(run) in done:
            run.__dict__.update(asdict(done[key(run)]))
            kept += 1
    return kept


class Bench:
    """Registers a dataset per job, POSTs the jobs, ``concurrency`` in flight, and scores the
    released models on the test parts."""

    def __init__(
        self,
        client: httpx.Client,
        data_dir: Path,
        setups: dict[str, Setup],
        splits: dict[str, Split],
        table: dict[str, Method],
    ) -> None:
        self.client, self.setups, self.splits, self.table = client, setups, splits, table
        self.registered = 0
        self.proxies: dict[str, int] = {}
        for name, part in splits.items():
            part.save(data_dir / f"{name}.npz")
            part.save_public(data_dir / f"{name}-public.npz")

    def proxy(self, name: str) -> int:
        """The dataset's public validation part, registered once as a public dataset."""
        if name not in self.proxies:
            r = self.client.post(
                "/v1/datasets",
                json={
                    "name": f"{name}-public",
                    "source": f"npz:{name}-public.npz",
                    "num_classes": self.splits[name].num_classes,
                    "epsilon": 1.0,  # never charged
                    "delta": 1e-5,
                    "public": True,
                },
            )
            r.raise_for_status()
            self.proxies[name] = r.json()["id"]
        return self.proxies[name]

    def spec(self, run: Run, dataset: int) -> dict[str, Any]:
        part = self.splits[run.dataset]
        return job_spec(
            dataset,
            self.setups[run.dataset],
            len(part.y),
            self.table[run.method],
            run.accounting,
            run.epsilon,
            run.seed,
            run.fixed,
            self.proxy(run.dataset) if self.table[run.method].proxy else None,
        )

    def submit(self, run: Run) -> float:
        """Register the job's own dataset (budget: a little above the job's ε) and POST the
        job; the POST's time."""
        part = self.splits[run.dataset]
        self.registered += 1
        r = self.client.post(
            "/v1/datasets",
            json={
                "name": f"{run.dataset}-{self.registered}",
                "source": f"npz:{run.dataset}.npz",
                "num_classes": part.num_classes,
                # the dataset's filter counts a job at least its own ε (its curve at the
                # dataset's order: up to 2 % more for a job alone), and lets (ε, δ)
                # statements (a Liu–Talwar job's, a cap's) hold a tenth of its δ: the job's own
                # ε and δ are what the bench compares, the dataset only has to admit it
                "epsilon": 1.05 * run.epsilon,
                "delta": 20 / len(part.y),
            },
        )
        r.raise_for_status()
        posted = time.time()
        r = self.client.post("/v1/jobs", json=self.spec(run, r.json()["id"]))
        if r.status_code != 202:
            run.status, run.error = "refused", f"{r.status_code} {r.text[:500]}"
        else:
            run.job, run.status = r.json()["id"], "queued"
        return posted

    def finish(self, run: Run, job: dict[str, Any], posted: float) -> None:
        """Record a job that ended: times, trials, and the released model's test accuracy."""
        run.status, run.error = job["status"], job.get("error")
        run.wall_s = time.time() - posted
        if job["started_at"] and job["finished_at"]:
            started, finished = (
                _timestamp(job["started_at"]),
                _timestamp(job["finished_at"]),
            )
            run.run_s = finished - started
        run.noise_multiplier = job["plan"].get("noise_multiplier")
        run.trial_epsilon = job["plan"].get("trial_epsilon")
        trials = self.client.get(f"/v1/jobs/{run.job}/trials").json()
        run.trials = len(trials)
        if job["plan"].get("scaling") is not None:
            run.scaling = scaling_record(job["plan"], trials)
        if run.status == "released":
            model = self.client.get(f"/v1/jobs/{run.job}/model")
            model.raise_for_status()
            part = self.splits[run.dataset]
            run.accuracy, config = released_accuracy(model.content, part.x_test, part.y_test)
            run.released = searched_fields(config, self.table[run.method])

    def run_all(
        self, runs: list[Run], concurrency: int, stop_at: float, save: Callable[[], None]
    ) -> None:
        """Every job of ``runs`` still pending (one per distinct spec and seed: a one-run
        method's reference is its rdp job), at most ``concurrency`` at once; none submitted
        after ``stop_at``."""
        pending = job_groups(runs, lambda run: self.spec(run, 0))
        flight: dict[int, tuple[list[Run], float]] = {}
        while pending or flight:
            while pending and len(flight) < concurrency and time.time() < stop_at:
                group = pending.pop(0)
                posted = self.submit(group[0])
                if group[0].job is None:
                    print(f"refused: {_label(group[0])}: {group[0].error}", flush=True)
                    _copy(group)
                    continue
                flight[group[0].job] = (group, posted)
            if time.time() >= stop_at and pending:
                print(f"--minutes reached: {sum(map(len, pending))} runs not submitted", flush=True)
                pending = []
            for job_id, (group, posted) in list(flight.items()):
                job = self.client.get(f"/v1/jobs/{job_id}").json()
                if job["status"] in TERMINAL:
                    self.finish(group[0], job, posted)
                    _copy(group)
                    del flight[job_id]
                    print(_done(group[0]), flush=True)
                    save()
            time.sleep(1)


def merged(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of several runs' (say one per dataset): their submitted runs, datasets,
    methods and ε values together, and the runs' times added up."""
    out = {**reports[0], "datasets": {}, "methods": {}, "runs": [], "elapsed_s": 0.0}
    out["args"] = {**reports[0]["args"], "datasets": [], "epsilons": [], "resume": None}
    for report in reports:
        out["datasets"] |= report["datasets"]
        out["methods"] |= report["methods"]
        out["runs"] += [r for r in report["runs"] if r["status"] != "pending"]
        out["elapsed_s"] += report["elapsed_s"]
        for key in ("datasets", "epsilons", "methods"):
            out["args"][key] = list(dict.fromkeys([*out["args"][key], *report["args"][key]]))
    out["args"]["epsilons"].sort()
    return out


def _copy(group: list[Run]) -> None:
    first = asdict(group[0])
    for run in group[1:]:
        for key in (
            "job",
            "status",
            "error",
            "accuracy",
            "released",
            "noise_multiplier",
            "trial_epsilon",
            "trials",
            "wall_s",
            "run_s",
            "scaling",
        ):
            setattr(run, key, first[key])


def _timestamp(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text).timestamp()


def _label(run: Run) -> str:
    what = (
        f"{run.method} {run.accounting}" if run.fixed is None else f"{run.method} ref {run.fixed}"
    )
    return f"{run.dataset} ε={run.epsilon:g} seed {run.seed} {what}"


def _done(run: Run) -> str:
    acc = "—" if run.accuracy is None else f"{100 * run.accuracy:.1f}%"
    # a plan of several shapes (or levels) has no one σ
    sigma = "—" if run.noise_multiplier is None else f"{run.noise_multiplier:.2f}"
    return (
        f"{_label(run)}: job {run.job} {run.status} acc {acc} trials {run.trials} "
        f"σ {sigma} ε/trial {run.trial_epsilon or 0:.2f} "
        f"wall {run.wall_s or 0:.0f} s run {run.run_s or 0:.0f} s"
        + (f" released {run.released}" if run.released else "")
        + (f" error {run.error[:300]}" if run.error and run.status != "released" else "")
    )


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",")]


def _names(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=_names, default=["digits", "mnist1d", "heavy_tail"])
    parser.add_argument("--npz", type=Path, action="append", default=[], help="also this file")
    parser.add_argument("--epsilons", type=_floats, default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--methods", type=_names, default=None, help="default: all")
    parser.add_argument("--accountings", type=_names, default=list(ACCOUNTINGS))
    parser.add_argument("--seeds", type=int, default=3, help="repetitions")
    parser.add_argument(
        "--reference",
        type=_names,
        nargs="?",
        const=["all"],
        default=[],
        help="also the no-tuning-cost runs: of all methods, or of these",
    )
    parser.add_argument("--concurrency", type=int, default=2, help="jobs in flight")
    parser.add_argument("--minutes", type=float, default=math.inf, help="submit none after")
    parser.add_argument("--heavy-tail-scale", type=float, default=0.125)
    parser.add_argument(
        "--quick", action="store_true", help="digits, ε = 4, 1 seed, 3 thresholds, 3 methods"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "tuning_accuracy")
    parser.add_argument(
        "--replot",
        type=Path,
        nargs="+",
        help="only tables and plot of these JSON reports, merged (several: also <out>.json)",
    )
    parser.add_argument("--resume", type=Path, help="keep the released runs of this JSON")
    args = parser.parse_args()
    if args.replot:
        report = merged([json.loads(path.read_text()) for path in args.replot])
        runs = [Run(**r) for r in report["runs"]]
        shown = report["args"]
        print(tables(runs, shown["methods"], shown["epsilons"], shown["seeds"]))
        print(scaling_lines(runs))
        if len(args.replot) > 1:
            args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        plot(runs, shown["methods"], args.out.with_suffix(".png"))
        return 0
    if args.quick:
        args.datasets, args.epsilons, args.seeds = ["digits"], [4.0], 1
        args.methods = args.methods or ["DP-SGD", "DC-SGD-E", "shape"]
    table = methods(QUICK_THRESHOLDS if args.quick else THRESHOLDS, args.quick)
    args.methods = args.methods or list(table)
    args.reference = args.methods if args.reference == ["all"] else args.reference
    for name in args.methods + args.reference:
        if name not in table:
            parser.error(f"--methods: unknown {name!r} (known: {', '.join(table)})")
    setups = {name: DATASETS[name] for name in args.datasets}
    for path in args.npz:
        setups[path.stem] = Setup(
            lambda _, p=path: npz_split(p), epochs=15, batch_size=128, **NPZ_SETUP
        )
        args.datasets.append(path.stem)
    splits = {name: setup.build(args) for name, setup in setups.items()}
    for name, part in splits.items():
        print(
            f"{name}: train {len(part.y)}, public validation {len(part.y_val)}, "
            f"{part.test_kind} test {len(part.y_test)}, {part.num_classes} classes, "
            f"δ = 1/{len(part.y)}"
        )
    runs = plan_runs(args, table)
    if args.resume:
        kept = resumed(runs, json.loads(args.resume.read_text())["runs"])
        print(f"--resume: {kept} released runs kept from {args.resume}")
    started = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        report = {
            "args": {
                k: [str(p) for p in v] if k == "npz" else v
                for k, v in vars(args).items()
                if k != "out"
            },
            "machine": "see README: 2 CPU cores, no GPU",
            "datasets": {
                n: {
                    "train": len(p.y),
                    "validation": len(p.y_val),
                    "test": len(p.y_test),
                    "test_kind": p.test_kind,
                    "delta": 1 / len(p.y),
                    "setup": {k: v for k, v in asdict(setups[n]).items() if k != "build"},
                }
                for n, p in splits.items()
            },
            "methods": {n: asdict(table[n]) for n in args.methods},
            "elapsed_s": time.time() - started,
            "runs": [asdict(r) for r in runs],
        }
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))

    work = Path(tempfile.mkdtemp(prefix="dpt-tacc-"))
    try:
        with local_cluster() as cluster:
            cluster.start_head(num_cpus=2)
            cluster.wait_for_nodes()
            data_dir = work / "data"
            with dptune_serve(cluster, data_dir, reuse=True) as client:
                bench = Bench(client, data_dir, setups, splits, table)
                bench.run_all(runs, args.concurrency, started + 60 * args.minutes, save)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save()
    print(tables(runs, args.methods, args.epsilons, args.seeds))
    print(scaling_lines(runs))
    plot(runs, args.methods, args.out.with_suffix(".png"))
    print(f"{time.time() - started:.0f} s; wrote {args.out.with_suffix('.json')} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
