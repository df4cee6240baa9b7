"""Operations a training step dispatches, DP against non-private: a count of kernel launches
that needs no GPU.

On a GPU the eager DP step is bound by launching kernels, not by arithmetic (docs/performance.md,
"The step replayed from a CUDA graph"). Each tensor operation torch dispatches is at least one
launch there, so counting them on CPU tells whether a change adds or removes launches without a GPU.
Views (``view``, ``slice``, ``permute``, ...) launch nothing and are not counted; neither is what
one operation does inside (torch's CPU and CUDA kernels of one operation may loop differently).

The DP column is ``fast_torchrng``: the product's step with its noise from torch's generator,
one operation as on CUDA (where the secure stream keys Philox on the device; on CPU its
Box–Muller takes a few operations per 2¹⁶ draws). Convolutions' per-sample gradients are formed
as on CUDA, by one grouped convolution (``workers.dp.ghost.layers._grouped_per_sample``): on CPU
the step may choose batched matmuls over a few samples at a time where those are faster
(``_Faster``), a CPU-only choice that would count a bmm and a copy per few samples. Both
columns' optimizer steps are torch's ``foreach`` ones, as torch chooses on CUDA (a few
operations for all parameters, where CPU's loop takes one or more a parameter), and the
profiler's range markers around them are not counted (no kernel runs).

    python bench/op_count.py                          # mlp cnn transformer logreg, B = 64
    python bench/op_count.py --models resnet18 --batches 16 --top 15
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import step_overhead  # noqa: E402

from workers.dp.ghost import clipper as ghost_clipper  # noqa: E402
from workers.dp.ghost import layers as ghost_layers  # noqa: E402

#: operations that make a view of their input: no kernel runs
VIEWS = frozenset(
    [
        "alias",
        "as_strided",
        "detach",
        "diagonal",
        "expand",
        "lift_fresh",
        "narrow",
        "permute",
        "select",
        "slice",
        "split",
        "split_with_sizes",
        "squeeze",
        "t",
        "transpose",
        "unbind",
        "unflatten",
        "unsqueeze",
        "view",
        "_reshape_alias",
        "_unsafe_view",
    ]
)
#: the profiler's range markers (``torch.autograd.profiler.record_function``): no kernel runs
MARKERS = frozenset(["_record_function_enter_new", "_record_function_exit"])


class Count(TorchDispatchMode):
    """Counts the non-view operations dispatched while active, by name and by the line of this
    repository's code (outside ``.venv``) that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: collections.Counter[str] = collections.Counter()
        self.by_line: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in VIEWS and name not in MARKERS:
            self.by_op[name] += 1
            self.by_line[_caller()] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if path.startswith(str(ROOT)) and ".venv" not in path and not path.endswith("op_count.py"):
            return f"{Path(path).relative_to(ROOT)}:{frame.lineno} {frame.name}"
    return "torch"


def count_step(step: Callable[[], None]) -> Count:
    """The operations of one steady step (after three first steps)."""
    for _ in range(3):
        step()
    count = Count()
    with count:
        step()
    return count


def main(argv: list[str] | None = None) -> dict[tuple[str, int], dict[str, int]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "transformer", "logreg"])
    parser.add_argument("--batches", nargs="+", type=int, default=[64])
    parser.add_argument("--top", type=int, default=0, help="also list the DP step's top lines")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the other benches; restored for a caller
    try:
        with as_on_cuda():
            return _table(args.models, args.batches, args.top)
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def as_on_cuda() -> Iterator[None]:
    """Every convolution's per-sample gradients by the grouped convolution, as CUDA forms them
    (the first of ``_Faster``'s candidates), not by the faster way on this CPU; small per-sample
    gradients in their group's flat buffer, as on CUDA (``clipper.flat_limit``); SGD's step by
    its ``foreach`` kernels, torch's default on CUDA (its CPU default loops over parameters)."""
    with (
        mock.patch.object(ghost_layers, "_Faster", lambda candidates: candidates[0]),
        mock.patch.object(ghost_clipper, "flat_limit", lambda device: ghost_clipper.FLAT_ELEMENTS),
        mock.patch("torch.optim.sgd._default_to_fused_or_foreach", _foreach),
    ):
        yield


def _foreach(params: list[torch.Tensor], differentiable: bool, use_fused: bool = False):
    """torch's choice of optimizer kernels for CUDA parameters: ``foreach``, not fused."""
    return False, not differentiable


def _table(
    models: list[str], batches: list[int], top: int
) -> dict[tuple[str, int], dict[str, int]]:
    step_overhead._start_runtime("cpu")
    results: dict[tuple[str, int], dict[str, int]] = {}
    lines = [
        "| model | B | non-private | DP (`fast`, torch's noise) | ratio |",
        "|---|---|---|---|---|",
    ]
    for model in models:
        for batch in batches:
            counts = {
                method: count_step(
                    step_overhead._build_step(model, batch, method, "cpu", "all_layer")
                )
                for method in ("nonprivate", "fast_torchrng")
            }
            results[(model, batch)] = {m: c.total for m, c in counts.items()}
            base, dp = counts["nonprivate"].total, counts["fast_torchrng"].total
            lines.append(f"| {model} | {batch} | {base} | {dp} | {dp / base:.2f}× |")
            for line, n in counts["fast_torchrng"].by_line.most_common(top):
                print(f"{model} B={batch}: {n:5d}  {line}", file=sys.stderr)
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
