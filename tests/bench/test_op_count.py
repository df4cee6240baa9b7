"""``bench/op_count.py`` counts the operations a step dispatches (views excluded); a tiny
instance of its table, and the count itself checked on known operations."""

from __future__ import annotations

import pytest
import torch


def test_views_and_profiler_ranges_launch_nothing_and_are_not_counted(bench) -> None:
    x = torch.ones(4, 6)
    with bench("op_count").Count() as count:
        y = x.view(6, 4).t()[1:]  # views only
        with torch.autograd.profiler.record_function("a range"):
            (y + 1).sum()
    assert dict(count.by_op) == {"add": 1, "sum": 1}
    assert count.total == 2


def test_the_dp_step_dispatches_more_operations_than_the_non_private(bench, capsys) -> None:
    results = bench("op_count").main(["--models", "mlp", "--batches", "4", "--top", "3"])
    counts = results[("mlp", 4)]
    assert 0 < counts["nonprivate"] < counts["fast_torchrng"]
    captured = capsys.readouterr()
    assert f"| mlp | 4 | {counts['nonprivate']} | {counts['fast_torchrng']} |" in captured.out
    assert "workers/dp/" in captured.err  # the top lines name the product's code


#: the DP step's operations over the non-private step's (issue 43's CPU proxy of kernel launches
#: on a GPU; both optimizer steps by torch's CUDA ``foreach`` kernels): the transformer 160 / 108
#: = 1.48 at B = 64 (the goal, 1.5, met), resnet18 376 / 142 = 2.65 at B = 16 (not met: its
#: book-kept convolutions, docs/performance.md); resnet18's bound a little above. resnet18 is
#: counted at B = 16, in a quarter of the time of B = 64, where its stacked convolutions' norms
#: and sums take two chunks of samples each (411, 2.89×).
RATIO_BOUNDS = {("resnet18", 16): 2.7, ("transformer", 64): 1.5}


@pytest.mark.parametrize(("model", "batch"), RATIO_BOUNDS)
def test_the_dp_steps_operations_stay_within_their_bound(bench, model: str, batch: int) -> None:
    results = bench("op_count").main(["--models", model, "--batches", str(batch)])
    counts = results[(model, batch)]
    assert counts["fast_torchrng"] <= RATIO_BOUNDS[model, batch] * counts["nonprivate"], counts


def test_sgd_steps_by_its_foreach_kernels_as_on_cuda(bench) -> None:
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(5)]
    for p in params:
        p.grad = torch.ones(3)
    optimizer = torch.optim.SGD(params, lr=0.1)
    op_count = bench("op_count")
    with op_count.as_on_cuda(), op_count.Count() as count:
        optimizer.step()
    assert dict(count.by_op) == {"_foreach_add_": 1}
    assert all(p.detach().eq(torch.tensor(0.9)).all() for p in params)
