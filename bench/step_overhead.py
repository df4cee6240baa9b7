"""Step time and peak memory of DP training steps, as ratios to the non-private step.

    python bench/step_overhead.py --threads 1  # full table (5 models x batches 64, 256)
    python bench/step_overhead.py --quick      # mlp and logreg at B=64, under a minute
    python bench/step_overhead.py --json out.json
    python bench/step_overhead.py --style all_layer layer_wise param_wise  # a row per style

Columns: ``nonprivate`` (forward, mean-loss backward, SGD step), ``nonprivate_graph`` (the
same step captured in one CUDA graph and replayed; CUDA only), ``general`` (our torch.func
clipper), ``fast`` (our ghost-norm / book-keeping clipper), ``fast_graph`` (the same step with
its micro-batch padded and, on CUDA, replayed from a CUDA graph: ``workers.dp.graphed``; its
fair baseline is ``nonprivate_graph``), ``fast_inline`` (the same step with
its noise drawn in line, never ahead on a spare core: see ``workers.dp.engine``),
``fast_torchrng`` (the same step with its noise from torch's own generator instead of the
product's AES-CTR stream: the ratio ``fast`` / ``fast_torchrng`` is what secure randomness
costs), ``opacus_hooks`` and
``opacus_ghost`` (Opacus 1.6 ``grad_sample_mode="hooks"`` / ``"ghost"``, an optional benchmark
dependency). Every DP column clips (Abadi, R = 1, all-layer unless ``--style``), adds Gaussian
noise once and takes an SGD step; ours run the product's own step
(:class:`~workers.dp.engine.PrivateStep`: clipper, noise from a
:class:`~workers.dp.randomness.SecureStream` into one flat gradient buffer, optimizer step).

Each (model, batch, column) runs in a fresh subprocess, so peak memory is not polluted by other
runs. Peak memory = the largest memory in use during two steady steps, the fifth and the
sixth, counting the model, its optimizer, the batch, what the first four steps left behind
(optimizer state, buffers libraries allocate on first use; by then each convolution geometry's
way of forming per-sample gradients is chosen, ``workers.dp.ghost.layers._Faster``) and every
transient: on CUDA ``torch.cuda.max_memory_allocated`` (reset after the fourth step); on CPU
the process's peak resident set during those steps (VmHWM, reset through
``/proc/self/clear_refs`` after the fourth step) minus the resident set after every import and
a throwaway computation that sets up the math libraries, taken before the model is built
(their one-time set-up is no column's cost), plus the noise child's own peak over the same
steps above its private memory before its first draw (its interpreter and libraries are not
counted, as this process's imports are not; the gradient buffer the two share counts once,
here; the sum of the two peaks bounds the peak of the two together), and minus
the pages of shared-library code the first four steps mapped (``code_mb``, the growth of
``RssFile``: one-time, shared with every process that maps the library, and not memory a step
holds; the first Gaussian draw of a process maps the vectorised log, cos and sin code it
runs). glibc is told to
``mmap`` every block over 64 KiB during those six steps, so freed tensors leave the resident
set at once. ``first_peak_mb`` in the JSON is the peak over the first four steps, code pages
included. The timed steps then run with glibc's usual heap reuse: after a warm-up of
``--seconds``/2, step time is the median of at least ``--steps`` steps, more until
``--seconds`` have passed (the median shrugs off the stalls of a shared machine).

Time ratios in the table come from one more process per model, batch and style in which every
column that ran is built and the columns take turns (``interleaved``): on a shared machine,
columns measured minutes apart in their own processes move with the machine's load from run to
run, while turns of a few steps each meet the same machine. ``--separate`` skips that run; the table
then divides the columns' own medians, which the JSON keeps either way (``time_s``; the
interleaved ratio is ``time_ratio``).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = [
    "nonprivate",
    "nonprivate_graph",
    "general",
    "fast",
    "fast_graph",
    "fast_inline",
    "fast_torchrng",
    "opacus_hooks",
    "opacus_ghost",
]
# name: (input shape, classes, model options)
MODELS: dict[str, tuple[tuple[int, ...], int, dict]] = {
    "mlp": ((3, 32, 32), 10, {}),
    "cnn": ((3, 32, 32), 10, {}),
    "resnet18": ((3, 32, 32), 10, {}),
    "transformer": ((16, 128), 10, {}),  # sequences of 128 steps of 16 features
    "logreg": ((9216,), 255, {}),  # paper 004's synthetic problem
}
# Columns that hold every per-sample gradient at once (B x #params floats).
MATERIALIZING = {"general", "opacus_hooks"}
# The noise child's private memory before its first draw, by pid (``_noise_child_peak_kb``)
_noise_idle_kb: dict[int, int] = {}
# Steps of a column in a row when columns take turns (``interleaved``); the first is not timed.
ROUND_STEPS = 3


@dataclass
class Result:
    model: str
    batch: int
    method: str
    status: str  # "ok", or why there is no number
    time_s: float | None = None
    peak_mb: float | None = None
    style: str = "all_layer"  # clipping style of a DP column (non-private: none applies)
    code_mb: float | None = None  # CPU: shared-library pages the first four steps mapped
    first_peak_mb: float | None = None  # steps 1-4, code pages included
    time_ratio: float | None = None  # to the non-private step, columns taking turns


# ------------------------------------------------------------------ one run (in a subprocess)
def _proc_kb(field: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def _noise_child_pid() -> int | None:
    """The pid of the noise child of the step built last in this process, if it has one
    (``workers.dp.randomness.NoiseChild``)."""
    return next(reversed(_noise_idle_kb), None)


def _mmap_threshold(size: int) -> None:
    """glibc ``mallopt``: blocks ≥ ``size`` bytes are ``mmap``ed (and unmapped when freed)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-1, size)  # M_TRIM_THRESHOLD: give freed heap tops back beyond this size
    libc.mallopt(-3, size)  # M_MMAP_THRESHOLD


def _start_runtime(device: str) -> None:
    """A throwaway convolution, matmul and backward, so that the one-time set-up of the math
    libraries and the autograd engine is not counted in any column's peak memory."""
    import torch

    conv = torch.nn.Conv2d(2, 2, 3).to(device)
    x = torch.randn(2, 2, 5, 5, device=device)
    weights = torch.randn(2, 5, 5, device=device)
    torch.func.vmap(torch.func.grad(lambda w: (x[0] @ w).sum()))(weights)
    conv(x).flatten(1).matmul(torch.ones(18, 1, device=device)).sum().backward()


def _build_step(model_name: str, batch: int, method: str, device: str, style: str):
    import torch
    from torch import nn

    from core.config import ModelConfig
    from workers.models import build_model

    shape, classes, options = MODELS[model_name]
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=model_name, options=options), shape, classes).to(device)
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    if method == "nonprivate":
        loss_fn = nn.CrossEntropyLoss()

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            optimizer.step()

        return step
    if method == "nonprivate_graph":
        return _graphed_nonprivate(model, optimizer, x, y)
    if method.startswith("opacus"):
        return _opacus_step(model, optimizer, x, y, method.removeprefix("opacus_"))

    if method.startswith("fast"):
        from workers.dp.ghost import clipped_grad_sum
    else:
        from workers.dp.grads import clipped_grad_sum
    from workers.dp.randomness import SecureStream, spare_core

    class TorchNoise(SecureStream):
        """torch's own (not secure) generator, to price the secure one: ``fast_torchrng``."""

        def normal(self, shape, *, device="cpu", dtype=torch.float32, out=None, scale=1.0):
            out = torch.empty(shape, device=device, dtype=dtype) if out is None else out
            return out.normal_(0.0, scale)

    private = private_step(
        model,
        clipped_grad_sum,
        batch,
        style,
        noise=TorchNoise() if method == "fast_torchrng" else SecureStream(),
        draw_ahead=method != "fast_inline" and spare_core(),
        padded_rows=batch if method == "fast_graph" else None,
    )

    def dp_step() -> None:
        private.step([(x, y)], 0)

    def settle() -> None:  # the draw made ahead for the next step, done (interleaved timing)
        if private.ahead is not None:
            private.ahead.wait()

    dp_step.settle = settle  # type: ignore[attr-defined]
    return dp_step


def _graphed_nonprivate(model, optimizer, x, y) -> Callable[[], None]:
    """``nonprivate`` captured whole in one CUDA graph (forward, backward, SGD step), as the
    PyTorch notes on CUDA graphs capture a network: the baseline of ``fast_graph``. Each step
    copies the batch into the graph's input, as ``fast_graph`` does."""
    import torch
    from torch import nn

    loss_fn = nn.CrossEntropyLoss()
    static_x, static_y = x.clone(), y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(static_x), static_y).backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss_fn(model(static_x), static_y).backward()
        optimizer.step()

    def step() -> None:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()

    return step


def private_step(
    model, clipper, batch: int, style: str, *, noise, draw_ahead: bool, padded_rows=None
):
    """The product's step as every DP column of these benchmarks runs it: ``clipper``, Abadi's
    function at R = 1, σ = 1, ``noise`` into one flat buffer (drawn ahead if ``draw_ahead``),
    SGD; with ``padded_rows`` (``fast_graph``), micro-batches of that many rows replayed from a
    CUDA graph on a GPU. Drawn ahead, the noise is made in the step's noise child, which has
    started when this returns."""
    import torch
    from torch import nn

    from workers.dp.adaptive import ThresholdRule
    from workers.dp.clipping import resolve_groups
    from workers.dp.engine import PrivateStep

    step = PrivateStep(
        model,
        nn.CrossEntropyLoss(reduction="none"),
        resolve_groups(model, style),
        clipper,
        clipping="abadi",
        gamma=0.01,
        rule=ThresholdRule(1.0),
        grad_noise=1.0,
        expected_batch_size=batch,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        noise=noise,
        draw_ahead=draw_ahead,
        padded_rows=padded_rows,
    )
    while step.ahead is not None and not step.ahead.ready():
        time.sleep(0.01)  # until it has started, draws are made in line
    if step.ahead is not None:
        _noise_idle_kb[step.ahead.pid] = _proc_kb("RssAnon", step.ahead.pid)
    return step


def _opacus_step(model, optimizer, x, y, mode: str) -> Callable[[], None]:
    import warnings

    import torch
    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator
    from torch import nn

    warnings.filterwarnings("ignore")
    model = ModuleValidator.fix(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    engine = PrivacyEngine(accountant="rdp")
    made = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        criterion=nn.CrossEntropyLoss(),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode=mode,
    )
    if mode == "ghost":
        dp_model, dp_optimizer, criterion, _ = made
    else:
        (dp_model, dp_optimizer, _), criterion = made, nn.CrossEntropyLoss()

    def step() -> None:
        dp_optimizer.zero_grad(set_to_none=True)
        criterion(dp_model(x), y).backward()
        dp_optimizer.step()

    return step


@dataclass
class Memory:
    """A column's memory in MB (see the module docstring)."""

    peak_mb: float  # steps 5-6, less the code pages
    code_mb: float | None  # CPU: shared-library pages the first four steps mapped
    first_peak_mb: float  # steps 1-4, code pages included


def measure_memory(
    build: Callable[[], Callable[[], None]], device: str
) -> tuple[Callable[[], None], Memory]:
    """Build a step with ``build`` and measure its memory over its first six runs; glibc then
    goes back to heap reuse for the timed steps."""
    cuda = device == "cuda"
    if not cuda:
        _mmap_threshold(1 << 16)
    baseline_kb, file_kb = _proc_kb("VmRSS"), _proc_kb("RssFile")
    step = build()
    first_peak_mb = _peak_over(step, cuda, baseline_kb, 4)
    code_mb = None if cuda else (_proc_kb("RssFile") - file_kb) / 1024
    peak_mb = _peak_over(step, cuda, baseline_kb + 1024 * (code_mb or 0), 2)
    if not cuda:
        _mmap_threshold(1 << 25)  # glibc's largest threshold: tensors reuse the heap
    return step, Memory(peak_mb, code_mb, first_peak_mb)


def _peak_over(step: Callable[[], None], cuda: bool, base_kb: float, steps: int) -> float:
    """Peak memory (MB) of ``steps`` steps, above ``base_kb`` of resident set on CPU."""
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20
    child = _noise_child_pid()
    for pid in ("self", child) if child else ("self",):
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    for _ in range(steps):
        step()
    return (_proc_kb("VmHWM") - base_kb + (_noise_child_peak_kb(child) if child else 0)) / 1024


def _noise_child_peak_kb(pid: int) -> int:
    """The noise child's peak over the steps since its VmHWM was reset, less what it held
    before its first draw (``_noise_idle_kb``) and less its file and shared pages (the
    library code its first draw mapped; the gradient buffer, counted in this process)."""
    mapped = _proc_kb("RssFile", pid) + _proc_kb("RssShmem", pid)
    return _proc_kb("VmHWM", pid) - mapped - _noise_idle_kb[pid]


def run_one(
    model_name: str,
    batch: int,
    method: str,
    device: str,
    steps: int,
    seconds: float,
    style: str,
    threads: int | None,
) -> Result:
    """Measure one column in this process (meant to be a fresh subprocess)."""
    import torch

    libraries = ["workers.models", "workers.dp.clipping", "workers.dp.ghost", "workers.dp.grads"]
    for name in libraries + (["opacus"] if method.startswith("opacus") else []):
        importlib.import_module(name)  # before the memory baseline: imports are not the step
    _start_runtime(device)

    if threads:
        torch.set_num_threads(threads)
    step, memory = measure_memory(
        lambda: _build_step(model_name, batch, method, device, style), device
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(least: int, budget: float) -> list[float]:
        times: list[float] = []
        while len(times) < least or (sum(times) < budget and len(times) < 100):
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
        return times

    timed(1, seconds / 2)  # warm-up: fresh pages and kernel caches are slow at first
    times = timed(steps, seconds)
    median = statistics.median(times)
    return Result(model_name, batch, method, "ok", median, style=style, **asdict(memory))


def interleaved(
    model_name: str,
    batch: int,
    methods: list[str],
    device: str,
    seconds: float,
    style: str,
    threads: int | None,
) -> dict[str, dict[str, float]]:
    """Time ratios to the non-private step with every column built in this one process and
    run in turn, so that all of them meet the same machine: rounds of ``ROUND_STEPS`` steps
    of each column (in an order that rotates every round), timing all but each run's first
    step (which follows another column's steps: cold caches, and for a column that draws its
    noise ahead, a draw that had the other columns' time to finish), until ``seconds`` per
    column have passed. A column that draws ahead has its last draw finished, untimed, before
    the next column runs. Each column's ratio is the median over the rounds of its median
    step over the round's non-private median step."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    _start_runtime(device)
    steps = {m: _build_step(model_name, batch, m, device, style) for m in methods}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[list[float]]] = {m: [] for m in methods}
    spent = {m: 0.0 for m in methods}
    settle = {m: getattr(step, "settle", lambda: None) for m, step in steps.items()}
    for method, step in steps.items():  # warm-up: first-use set-up, the conv chooser's trials
        for _ in range(ROUND_STEPS + 1):
            step()
        settle[method]()
    order = list(methods)
    while min(spent.values()) < seconds or len(times[methods[0]]) < 3:
        for method in order:
            step, run = steps[method], []
            for i in range(ROUND_STEPS):
                start = time.perf_counter()
                step()
                sync()
                if i:
                    run.append(time.perf_counter() - start)
            settle[method]()
            times[method].append(run)
            spent[method] += sum(run)
        order = order[1:] + order[:1]
    base = [statistics.median(run) for run in times["nonprivate"]]
    return {
        m: {
            "time_s": statistics.median(x for run in times[m] for x in run),
            "ratio": statistics.median(
                statistics.median(run) / b for run, b in zip(times[m], base, strict=True)
            ),
            "rounds": len(times[m]),
        }
        for m in methods
    }


# ------------------------------------------------------------------ driver
def _param_count(model_name: str) -> int:
    import torch

    from core.config import ModelConfig
    from workers.models import build_model

    shape, classes, options = MODELS[model_name]
    with torch.device("meta"):
        model = build_model(ModelConfig(name=model_name, options=options), shape, classes)
    return sum(p.numel() for p in model.parameters())


def _run_self(
    what: list[str], style: str, args: argparse.Namespace, timeout: float
) -> subprocess.CompletedProcess[str] | None:
    """This script in a fresh subprocess, measuring ``what`` (``--one …`` or ``--interleave
    …``) with the run's device, time budget, clipping style and threads; None past
    ``timeout`` seconds."""
    cmd = [
        sys.executable,
        __file__,
        *what,
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--seconds",
        str(args.seconds),
        "--style",
        style,
        *(["--threads", str(args.threads)] if args.threads else []),
    ]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return None


def _spawn(
    model_name: str, batch: int, method: str, style: str, args: argparse.Namespace
) -> Result:
    done = _run_self(["--one", model_name, str(batch), method], style, args, args.timeout)
    if done is None:
        return Result(model_name, batch, method, f"timeout > {args.timeout} s", style=style)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return Result(model_name, batch, method, f"error: {last[:120]}", style=style)
    return Result(**json.loads(done.stdout.strip().splitlines()[-1]))


def _spawn_interleaved(
    model_name: str, batch: int, methods: list[str], style: str, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """``interleaved`` in a fresh subprocess; {} if it fails (the table then shows the
    columns' separate medians)."""
    what = ["--interleave", model_name, str(batch), "--methods", *methods]
    done = _run_self(what, style, args, args.timeout * len(methods))
    if done is None or done.returncode != 0:
        why = "timeout" if done is None else done.stderr[-300:]
        print(f"interleaved {model_name} B={batch}: {why}", file=sys.stderr)
        return {}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value is not None and base else "-"


def table(results: list[Result], methods: list[str]) -> str:
    """Markdown table: non-private absolute numbers, every other column as ratios; one row per
    model, batch and clipping style (the non-private step repeated on each)."""
    header = ["model", "B", "style", "non-private s / MB"] + [
        f"{m} time / mem" for m in methods[1:]
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    keys = list(
        dict.fromkeys((r.model, r.batch, r.style) for r in results if r.method != "nonprivate")
    )
    notes = []
    for model_name, batch, style in keys:
        row = {
            r.method: r
            for r in results
            if (r.model, r.batch) == (model_name, batch)
            and (r.style == style or r.method == "nonprivate")
        }
        base = row.get("nonprivate")
        cells = [model_name, str(batch), style]
        cells.append(f"{base.time_s:.3f} / {base.peak_mb:.0f}" if base and base.time_s else "-")
        for method in methods[1:]:
            r = row.get(method)
            if r is None or r.status != "ok":
                cells.append("n/a")
                if r is not None:
                    notes.append(f"{model_name} B={batch} {style} {method}: {r.status}")
                continue
            time_ratio = (
                f"{r.time_ratio:.2f}x"
                if r.time_ratio is not None
                else _ratio(r.time_s, base and base.time_s)
            )
            cells.append(f"{time_ratio} / {_ratio(r.peak_mb, base and base.peak_mb)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else []))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="mlp and logreg at B=64 only")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--models", nargs="+", choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    parser.add_argument(
        "--style",
        nargs="+",
        default=["all_layer"],
        choices=["all_layer", "layer_wise", "param_wise"],
        help="clipping styles of the DP columns (one row each)",
    )
    parser.add_argument("--steps", type=int, default=3, help="least timed steps per column")
    parser.add_argument(
        "--seconds", type=float, help="time steps until this long (default 3; quick 0.3)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's own, "
        "quick: 1); 1 is steadier on a shared machine, where threads waiting "
        "for each other stall the steps",
    )
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per column")
    parser.add_argument(
        "--max-gb",
        type=float,
        default=8.0,
        help="skip columns holding all per-sample gradients above this size",
    )
    parser.add_argument(
        "--separate",
        action="store_true",
        help="time ratios from each column's own process only (no interleaved run)",
    )
    parser.add_argument(
        "--one", nargs=3, metavar=("MODEL", "BATCH", "METHOD"), help=argparse.SUPPRESS
    )
    parser.add_argument("--interleave", nargs=2, metavar=("MODEL", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.seconds = args.seconds if args.seconds is not None else (0.3 if args.quick else 3.0)
    if args.quick and args.threads is None:
        args.threads = 1
    if args.interleave:
        model_name, batch = args.interleave
        ratios = interleaved(
            model_name,
            int(batch),
            args.methods,
            args.device,
            args.seconds,
            args.style[0],
            args.threads,
        )
        print(json.dumps(ratios))
        return
    if args.one:
        model_name, batch, method = args.one
        result = run_one(
            model_name,
            int(batch),
            method,
            args.device,
            args.steps,
            args.seconds,
            args.style[0],
            args.threads,
        )
        print(json.dumps(asdict(result)))
        return

    models = args.models or (["mlp", "logreg"] if args.quick else list(MODELS))
    batches = args.batches or ([64] if args.quick else [64, 256])
    methods = ["nonprivate", *[m for m in args.methods if m != "nonprivate"]]
    results = []
    for model_name in models:
        params = _param_count(model_name)
        for batch in batches:
            runs = [("nonprivate", "all_layer")]
            runs += [(m, style) for style in args.style for m in methods[1:]]
            for method, style in runs:
                need_gb = batch * params * 4 / 2**30
                if method in MATERIALIZING and need_gb > args.max_gb:
                    result = Result(
                        model_name,
                        batch,
                        method,
                        f"skipped: per-sample gradients need {need_gb:.1f} GB",
                        style=style,
                    )
                else:
                    result = _spawn(model_name, batch, method, style, args)
                print(
                    f"{model_name:12s} B={batch:<4d} {method:13s} {style:10s} "
                    f"{result.status:6.6s} time={result.time_s} peak_mb={result.peak_mb} "
                    f"code_mb={result.code_mb}",
                    file=sys.stderr,
                )
                results.append(result)
            if args.separate:
                continue
            for style in args.style:
                timed = ["nonprivate"] + [
                    r.method
                    for r in results
                    if (r.model, r.batch, r.style) == (model_name, batch, style)
                    and r.method != "nonprivate"
                    and r.status == "ok"
                ]
                if len(timed) < 2:
                    continue
                ratios = _spawn_interleaved(model_name, batch, timed, style, args)
                for r in results:
                    same_row = r.method == "nonprivate" or r.style == style
                    if (r.model, r.batch) == (model_name, batch) and same_row:
                        r.time_ratio = ratios.get(r.method, {}).get("ratio", r.time_ratio)
                print(
                    f"{model_name:12s} B={batch:<4d} interleaved {style:10s} "
                    + " ".join(f"{m}={v['ratio']:.3f}" for m, v in ratios.items()),
                    file=sys.stderr,
                )
    print(
        f"device: {args.device}; threads: {args.threads or 'default'}; time: "
        + (
            f"median of >= {args.steps} steps after warm-up, each column in its own process"
            if args.separate
            else "columns taking turns in one process, median over rounds of the ratio"
        )
        + "\n"
    )
    print(table(results, methods))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))


if __name__ == "__main__":
    main()
