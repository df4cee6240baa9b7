"""The fast clipper (ghost norms + book-keeping) against independent per-sample gradients.

The reference is written here from scratch: ``torch.func`` per-sample gradients, group norms and
clipped sums by explicit loops. Norms are upper bounds (``workers.dp.bounds``): at least the
reference's and at most ``NORM_MARGIN`` above; clipped sums, with the clip factors those norms
give, agree to 1e-5 relative for every supported layer, every clipping style, shared layers,
fallbacks, and against the engine's general path.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from workers.dp.ghost import FallbackWarning, clipped_grad_sum
from workers.dp.ghost import clipper as ghost_clipper
from workers.dp.ghost import layers as ghost_layers

RTOL = 1e-5
#: the guard of a float32 ghost norm over T positions is κ·S² with κ ≈ 5e-4 and S/‖G‖ up to
#: about √T on random data (``workers.dp.bounds.ghost_guard``): up to 3 % over, forced on
#: convolutions of 64 positions
NORM_MARGIN = 3e-2
LOSS = nn.CrossEntropyLoss(reduction="none")


# ---------------------------------------------------------------- independent reference
def reference(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    groups: list[list[str]],
    coef_fn,
    norms_for_coef: Tensor | None = None,
):
    """Exact-ish norms and the clipped sums for the factors of ``norms_for_coef`` (the clipper's
    own norm bounds, when given) or of those norms."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return LOSS(functional_call(model, p, (xi[None],)), yi[None]).sum()

    per_sample = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.stack(
        [
            torch.stack([torch.cat([per_sample[n][i].flatten() for n in g]).norm() for g in groups])
            for i in range(x.shape[0])
        ]
    )
    coef = coef_fn(norms if norms_for_coef is None else norms_for_coef)
    sums = {
        n: sum(coef[i, m] * per_sample[n][i] for i in range(x.shape[0]))
        for m, g in enumerate(groups)
        for n in g
    }
    return norms, sums


def abadi(per_group: float):
    """Abadi's clip factor at the per-group threshold R_m, elementwise (the seam's contract)."""

    def coef_fn(norms: Tensor) -> Tensor:
        return torch.clamp(per_group / norms, max=1.0)

    return coef_fn


def style(model: nn.Module, name: str) -> list[list[str]]:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if name == "all_layer":
        return [names]
    if name == "param_wise":
        return [[n] for n in names]
    if name == "layer_wise":
        owners: dict[str, list[str]] = {}
        for n in names:
            owners.setdefault(n.rpartition(".")[0], []).append(n)
        return list(owners.values())
    # "groups": two uneven blocks, parameters interleaved across them
    return [names[::2], names[1::2]] if len(names) > 1 else [names]


def assert_bound(actual: Tensor, expected: Tensor, what: str) -> None:
    """``actual`` bounds ``expected`` from above (up to the reference's own rounding), closely."""
    scale = expected.abs().max().clamp_min(1e-12)
    below = ((expected - actual).clamp_min(0).max() / scale).item()
    above = ((actual - expected) / expected.abs().clamp_min(1e-12)).max().item()
    assert below <= RTOL and above <= NORM_MARGIN, f"{what}: {below:.2e} below, {above:.2e} above"


def assert_close(actual: Tensor, expected: Tensor, what: str) -> None:
    scale = expected.abs().max().clamp_min(1e-12)
    err = ((actual - expected).abs().max() / scale).item()
    assert err <= RTOL, f"{what}: relative error {err:.2e}"


def check(
    model: nn.Module, x: Tensor, y: Tensor, style_name: str = "all_layer", threshold: float = 0.5
) -> tuple[Tensor, dict[str, Tensor]]:
    groups = style(model, style_name)
    norms, sums = clipped_grad_sum(model, LOSS, x, y, groups, abadi(threshold))
    ref_norms, ref_sums = reference(model, x, y, groups, abadi(threshold), norms)
    assert norms.shape == (x.shape[0], len(groups))
    assert_bound(norms, ref_norms, "norms")
    assert list(sums) == [n for n, _ in model.named_parameters()]
    for name, value in sums.items():
        assert value.shape == ref_sums[name].shape, name
        assert_close(value, ref_sums[name], name)
    # clipping actually bit: some coefficient < 1, so a wrong norm would show in the sums
    assert (abadi(threshold)(ref_norms) < 1).any()
    return norms, sums


# ---------------------------------------------------------------- models
class Mlp(nn.Module):
    """Linear on 2-D inputs, with an in-place activation on a Linear's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.fc1(x).relu_())


class SequenceModel(nn.Module):
    """Embedding (padding_idx) → LayerNorm → Linear on [B, T, d], one layer on each side of the
    ghost/instantiate rule (2T² ≤ p·d), plus a LayerNorm without bias."""

    def __init__(self, positions: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 12, padding_idx=0)
        self.ln = nn.LayerNorm(12)
        self.wide = nn.Linear(12, 16)  # T(d + p) = 168 ≤ p·d = 192: ghost norm
        self.narrow = nn.Linear(16, 2)  # T(d + p) = 108 > p·d = 32: instantiated
        self.ln2 = nn.LayerNorm(2, bias=False)
        self.head = nn.Linear(2 * positions, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.wide(self.ln(self.emb(x))))
        return self.head(self.ln2(self.narrow(h)).flatten(1))


class Convs(nn.Module):
    """Conv1d (string padding, dilation, groups) and Conv2d (stride, groups), GroupNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(4, 6, 3, padding="same", dilation=2, groups=2)
        self.gn1 = nn.GroupNorm(3, 6)
        self.c2 = nn.Conv2d(3, 4, 3, padding=1)
        self.gn2 = nn.GroupNorm(2, 4)
        self.c3 = nn.Conv2d(4, 4, 3, stride=2, groups=2, bias=False)
        self.head = nn.Linear(6 * 9 + 4 * 4 * 4, 3)

    def forward(self, x: Tensor) -> Tensor:
        seq = x[:, :4, 0, :]  # [B, 4, 9]
        a = torch.relu(self.gn1(self.c1(seq))).flatten(1)
        b = self.c3(torch.relu_(self.gn2(self.c2(x[:, :3])))).flatten(1)  # in place on a GN
        return self.head(torch.cat([a, b], 1))


class Stage(nn.Module):
    """resnet18's later stages in small: convolutions of one geometry each called once on inputs
    of one shape, whose ghost norm is the cheaper one (book-kept): three 3×3 ones on 3×3
    positions (norms from pixels; two with a bias), two stride-3 ones reading the same input
    (norms from patches), and two Conv1d ones over 4 positions; plus a GroupNorm between."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(4, 16, 3, stride=3)  # 9×9 → 3×3
        self.skip = nn.Conv2d(4, 16, 3, stride=3, bias=False)
        self.a, self.b = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.c = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(4, 16)
        self.s1, self.s2 = nn.Conv1d(4, 16, 5, stride=2, padding=1), nn.Conv1d(4, 16, 5, 2, 1)
        self.head = nn.Linear(16 * 9 + 16 * 4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.down(x)) + self.skip(x)
        h = torch.relu(self.gn(self.a(h)))
        h = h + self.c(torch.relu(self.b(h)))
        seq = x[:, :, 0, :]  # [B, 4, 9]
        s = torch.tanh(self.s1(seq)) * self.s2(seq)
        return self.head(torch.cat([h.flatten(1), s.flatten(1)], 1))


class Shared(nn.Module):
    """One Linear applied twice: its per-sample gradient is the sum over both calls."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(torch.tanh(self.block(x))))


class Scale(nn.Module):
    """A layer the fast path has no rule for."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, size))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 6)
        self.lstm = nn.LSTM(6, 5, batch_first=True)
        self.scale = Scale(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(self.emb(x))
        return self.head(self.scale(out[:, -1]))


class Tied(nn.Module):
    """Input embedding tied to the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.mix = nn.Linear(4, 4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mix(self.emb(x))).mean(1))


def data(kind: str, batch: int = 7, positions: int = 6, classes: int = 3):
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, classes, (batch,), generator=g)
    if kind == "ids":
        return torch.randint(0, 7, (batch, positions), generator=g), y
    if kind == "image":
        return torch.randn(batch, 4, 9, 9, generator=g), y
    return torch.randn(batch, 6, generator=g), y


# ---------------------------------------------------------------- equality
STYLES = ["all_layer", "layer_wise", "param_wise", "groups"]


@pytest.mark.parametrize("style_name", STYLES)
def test_linear_2d_matches_reference(style_name: str) -> None:
    torch.manual_seed(0)
    check(Mlp(), *data("dense"), style_name)


@pytest.mark.parametrize("style_name", STYLES)
def test_sequence_layers_match_reference(style_name: str) -> None:
    torch.manual_seed(0)
    x, y = data("ids")
    x[:, 0] = 0  # padding_idx positions receive no gradient
    check(SequenceModel(6), x, y, style_name)


@pytest.mark.parametrize("style_name", STYLES)
def test_convolutions_and_group_norm_match_reference(style_name: str) -> None:
    torch.manual_seed(0)
    check(Convs(), *data("image"), style_name)


@pytest.mark.parametrize("style_name", STYLES)
def test_stacked_convolutions_match_reference(style_name: str) -> None:
    torch.manual_seed(0)
    check(Stage(), *data("image"), style_name)


@pytest.mark.parametrize(
    ("style_name", "stacks"),
    [
        ("all_layer", [["a", "b", "c"], ["down", "skip"], ["s1", "s2"]]),
        ("layer_wise", []),  # one layer a group: nothing to stack
        # layer a in a group of its own: b and c still stack
        ("split", [["b", "c"], ["down", "skip"], ["s1", "s2"]]),
    ],
)
def test_convolutions_of_one_geometry_in_one_group_are_measured_and_summed_once(
    monkeypatch: pytest.MonkeyPatch, style_name: str, stacks: list[list[str]]
) -> None:
    """Each stack takes one norm bound (over the maps of one grouped convolution) and one sum."""
    measured: list[list[str]] = []
    norms = ghost_layers.ConvRule.weight_norms

    def spy(self, module: nn.Module, calls) -> object:
        measured.append([n for n, m in model.named_modules() if m is module] or [module.groups])
        return norms(self, module, calls)

    monkeypatch.setattr(ghost_layers.ConvRule, "weight_norms", spy)
    torch.manual_seed(0)
    model = Stage()
    names = [n for n, _ in model.named_parameters()]
    groups = (
        [["a.weight", "a.bias"], [n for n in names if not n.startswith("a.")]]
        if style_name == "split"
        else style(model, style_name)
    )
    formed: list[list[str]] = []
    stack = ghost_clipper._Stack.__init__

    def record(self, layers) -> None:
        formed.append(sorted(layer.name for layer in layers))
        stack(self, layers)

    monkeypatch.setattr(ghost_clipper._Stack, "__init__", record)
    clipped_grad_sum(model, LOSS, *data("image"), groups, abadi(0.5))
    assert sorted(formed) == stacks
    # a stack's one bound is taken on its grouped convolution (G maps), the others on their own
    assert sorted(m for m in measured if isinstance(m[0], int)) == sorted([len(s)] for s in stacks)
    assert len(measured) == 7 - sum(len(s) - 1 for s in stacks)
    norms, sums = clipped_grad_sum(model, LOSS, *data("image"), groups, abadi(0.5))
    ref_norms, ref_sums = reference(model, *data("image"), groups, abadi(0.5), norms)
    assert_bound(norms, ref_norms, "norms")
    for name, value in sums.items():
        assert_close(value, ref_sums[name], name)


def test_stacked_convolutions_match_in_chunks_and_with_instantiated_norms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stacks measured and summed a sample at a time, then with every norm instantiated."""
    torch.manual_seed(0)
    monkeypatch.setattr(ghost_layers, "CHUNK_ELEMENTS", 64)
    check(Stage(), *data("image"), "all_layer")
    monkeypatch.undo()
    monkeypatch.setattr(ghost_layers, "use_ghost", lambda *_: False)
    monkeypatch.setattr(ghost_layers.ConvRule, "keeps_per_sample", lambda *_: False)
    check(Stage(), *data("image"), "all_layer")


def test_chunked_norms_match_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny chunks force every norm to be computed a few samples at a time."""
    monkeypatch.setattr(ghost_layers, "CHUNK_ELEMENTS", 64)
    torch.manual_seed(0)
    check(Convs(), *data("image"), "layer_wise")
    check(SequenceModel(6), *data("ids"), "all_layer")


@pytest.mark.parametrize("ghost", [True, False])
def test_ghost_and_instantiated_norms_both_match(
    monkeypatch: pytest.MonkeyPatch, ghost: bool
) -> None:
    """Each side of the ghost-or-instantiate choice, forced, on every Linear and convolution."""
    monkeypatch.setattr(ghost_layers, "use_ghost", lambda *_: ghost)
    torch.manual_seed(0)
    check(Convs(), *data("image"), "param_wise")
    check(SequenceModel(6), *data("ids"), "layer_wise")
    check(Shared(), *data("dense"), "all_layer")


def test_book_kept_instantiated_conv_norms_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """Convolutions whose instantiated norm is the cheaper one keep their per-sample gradients
    when called once; the book-kept route with instantiated norms (a convolution called
    several times takes it) must still match when every convolution is forced onto it."""
    monkeypatch.setattr(ghost_layers, "use_ghost", lambda *_: False)
    monkeypatch.setattr(ghost_layers.ConvRule, "keeps_per_sample", lambda *_: False)
    torch.manual_seed(0)
    check(Convs(), *data("image"), "param_wise")
    check(Convs(), *data("image"), "all_layer")


def test_convolution_norms_from_pixels_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ghost norms whose patches' Gram matrices come from the pixels', forced on every
    convolution over several positions called once: Conv1d with string padding, dilation and
    groups, Conv2d with padding, and with stride and groups."""
    monkeypatch.setattr(ghost_layers, "use_ghost", lambda *_: True)
    monkeypatch.setattr(
        ghost_layers.ConvRule, "_from_pixels", lambda self, m, calls: len(calls) == 1
    )
    formed = []
    pixel_sq_norms = ghost_layers.ConvRule._pixel_norms

    def spy(self, module: nn.Module, call):
        formed.append(type(module).__name__)
        return pixel_sq_norms(self, module, call)

    monkeypatch.setattr(ghost_layers.ConvRule, "_pixel_norms", spy)
    torch.manual_seed(0)
    for style_name in ("param_wise", "all_layer"):
        check(Convs(), *data("image"), style_name)
    assert sorted(formed) == ["Conv1d", "Conv1d", "Conv2d", "Conv2d", "Conv2d", "Conv2d"]
    monkeypatch.setattr(ghost_layers, "CHUNK_ELEMENTS", 64)  # norms and sums a sample at a time
    check(Convs(), *data("image"), "layer_wise")


@pytest.mark.parametrize(
    ("conv", "size", "chosen"),
    [
        (nn.Conv2d(256, 256, 3, padding=1, bias=False), 8, True),  # resnet18's third stage
        (nn.Conv2d(512, 512, 3, padding=1, bias=False), 4, True),  # its fourth
        (nn.Conv2d(128, 256, 3, stride=2, padding=1, bias=False), 16, False),  # P ≈ 4T
        (nn.Conv2d(64, 64, 3, padding=1, bias=False), 32, False),  # instantiated norm
        (nn.Conv1d(32, 32, 3, padding="same"), 10, True),
    ],
)
def test_pixel_route_is_taken_where_it_costs_less(conv: nn.Module, size: int, chosen: bool) -> None:
    x = torch.randn(2, conv.in_channels, *([size] * (conv.weight.dim() - 2)))
    call = ghost_layers.Call(x, torch.randn_like(conv(x)))
    assert ghost_layers.ConvRule()._from_pixels(conv, [call]) is chosen
    assert ghost_layers.ConvRule()._from_pixels(conv, [call, call]) is False  # a shared layer


def test_gradients_formed_during_backward_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """Norm layers and many-position convolutions form per-sample gradients in the backward
    pass (a hook on their node) or, for a first layer, right after it; a layer whose output is
    unused gets zeros."""
    formed: list[str] = []
    original = ghost_layers.LayerRule.per_sample

    def spy(self, module: nn.Module, call: ghost_layers.Call) -> dict[str, Tensor]:
        formed.append(type(module).__name__)
        return original(self, module, call)

    monkeypatch.setattr(ghost_layers.LayerRule, "per_sample", spy)

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.norm = nn.Conv1d(2, 3, 3), nn.GroupNorm(1, 3)
            self.head = nn.Linear(3 * 7, 3)

        def forward(self, x: Tensor) -> Tensor:
            h = self.conv(x[:, :2, 0])
            self.norm(h)  # computed, never used: its parameters get zero gradients
            return self.head(h.flatten(1))

    torch.manual_seed(0)
    check(Convs(), *data("image"), "param_wise")
    assert {"GroupNorm", "Conv2d"} <= set(formed)
    formed.clear()
    check(Unused(), *data("image"), "layer_wise")
    # the first conv, which the backward pass does not reach (nothing below it), formed its
    # gradients right after it; so did the unused GroupNorm, whose hook never fired, from a
    # zero output gradient
    assert sorted(formed) == ["Conv1d", "GroupNorm"]


class Ungrouped(nn.Module):
    """Ungrouped convolutions whose per-sample gradients are kept: Conv1d with string padding
    and dilation, Conv2d with a non-square kernel, stride, padding and dilation."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(4, 3, 3, padding="same", dilation=2)
        self.c2 = nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2))
        self.head = nn.Linear(3 * 9 + 5 * 5 * 7, 3)

    def forward(self, x: Tensor) -> Tensor:
        a = torch.tanh(self.c1(x[:, :, 0, :])).flatten(1)
        return self.head(torch.cat([a, torch.tanh(self.c2(x[:, :3])).flatten(1)], 1))


@pytest.mark.parametrize("way", ["_grouped_per_sample", "_matmul_per_sample"])
def test_both_ways_of_forming_per_sample_convolution_gradients_match(
    monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """Each way ``ConvRule.weight_per_sample`` may pick, forced on every ungrouped convolution
    (a sample at a time through the matmuls' chunks), against the reference; grouped
    convolutions keep the grouped one."""
    ran: list[int] = []
    forced = getattr(ghost_layers, way)

    def spy(*args):
        ran.append(args[3])  # the convolution's groups
        return forced(*args)

    monkeypatch.setattr(ghost_layers, "_FASTER", {})
    monkeypatch.setattr(ghost_layers, "_Faster", lambda candidates: spy)
    monkeypatch.setattr(ghost_layers, "PATCH_CHUNK", 1)
    torch.manual_seed(0)
    for style_name in ["all_layer", "param_wise"]:
        check(Ungrouped(), *data("image"), style_name)
        check(Convs(), *data("image"), style_name)
    assert ran and set(ran) == {1}


def test_the_faster_way_is_kept_after_each_has_run_its_timed_runs() -> None:
    """The candidates take turns until each has run ``TIMED_RUNS`` times; then the one with the
    least time per sample serves alone. Every call returns what the candidate that ran gave."""
    calls: list[str] = []

    def slow(x: Tensor, *rest) -> Tensor:  # 2 ms a sample
        calls.append("slow")
        time.sleep(0.002 * len(x))
        return x + 1

    def quick(x: Tensor, *rest) -> Tensor:  # 1 ms a sample
        calls.append("quick")
        time.sleep(0.001 * len(x))
        return x + 2

    faster = ghost_layers._Faster([slow, quick])
    runs = ghost_layers.TIMED_RUNS
    # slow gets one sample and quick ten: in all, quick takes longer, but not per sample
    for i in range(2 * runs):
        x = torch.zeros(1 if i % 2 == 0 else 10)
        out = faster(x)
        assert torch.equal(out, x + (1 if calls[-1] == "slow" else 2))
    assert calls == ["slow", "quick"] * runs and faster.chosen is quick
    for _ in range(3):
        assert torch.equal(faster(torch.zeros(4)), torch.full((4,), 2.0))
    assert calls[2 * runs :] == ["quick"] * 3


class TwoDtypes(nn.Module):
    """A float32 layer over positions (per-sample gradients kept) feeding float64 layers (a
    LayerNorm's kept too, a Linear's book-kept): kept gradients of two dtypes in one group."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8).double()
        self.head = nn.Linear(8, 3).double()

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.tanh(self.first(x)).double()
        return self.head(self.norm(hidden).mean(1)).float()


@pytest.mark.parametrize("style_name", STYLES)
def test_parameters_of_two_dtypes_match_and_convert_factors_once_per_group_and_dtype(
    style_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each group's factors are converted to its instantiated gradients' dtype once a step, not
    once per parameter (kernel launches on a GPU), and not at all for float32 ones (the
    LayerNorm's float64 gradients are kept, and so is the head's bias; the book-kept head weight
    scales its output gradients itself)."""
    converted: list[torch.dtype] = []
    convert = ghost_clipper.factors_as

    def counted(coef: Tensor, dtype: torch.dtype) -> Tensor:
        converted.append(dtype)
        return convert(coef, dtype)

    monkeypatch.setattr(ghost_clipper, "factors_as", counted)
    torch.manual_seed(0)
    x = torch.randn(7, 4, 6, generator=torch.Generator().manual_seed(2))
    check(TwoDtypes(), x, data("dense")[1], style_name)
    kept_float64 = sum(
        any(n.startswith("norm.") or n == "head.bias" for n in g)
        for g in style(TwoDtypes(), style_name)
    )
    assert converted == [torch.float64] * kept_float64


def test_shared_layer_sums_its_calls() -> None:
    torch.manual_seed(0)
    check(Shared(), *data("dense"))


def test_matches_general_path() -> None:
    general = pytest.importorskip("workers.dp.grads")
    torch.manual_seed(0)
    for model, (x, y) in [(Convs(), data("image")), (SequenceModel(6), data("ids"))]:
        for style_name in STYLES:
            groups = style(model, style_name)
            norms, sums = clipped_grad_sum(model, LOSS, x, y, groups, abadi(0.5))
            ref_norms, _ = general.clipped_grad_sum(model, LOSS, x, y, groups, abadi(0.5))
            exact, ref_sums = reference(model, x, y, groups, abadi(0.5), norms)
            assert_bound(norms, exact, f"{style_name} norms")
            assert_bound(ref_norms, exact, f"{style_name} general norms")
            for name in ref_sums:
                assert_close(sums[name], ref_sums[name], f"{style_name} {name}")


# ---------------------------------------------------------------- fallbacks
def test_recurrent_and_unknown_layers_fall_back_with_one_warning_each() -> None:
    torch.manual_seed(0)
    x, y = data("ids")
    with pytest.warns(FallbackWarning) as caught:
        check(Recurrent(), x, y, "layer_wise")
    messages = [str(w.message) for w in caught if w.category is FallbackWarning]
    assert len(messages) == 2
    assert any("'lstm' (LSTM)" in m for m in messages)
    assert any("'scale' (Scale)" in m for m in messages)


def test_tied_parameters_fall_back() -> None:
    torch.manual_seed(0)
    x, y = data("ids", classes=5)
    with pytest.warns(FallbackWarning, match="shares a parameter"):
        check(Tied(), x % 5, y, "all_layer")


def test_module_whose_parameters_are_used_directly_falls_back() -> None:
    """nn.MultiheadAttention reads ``out_proj.weight`` without calling ``out_proj``."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.head = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))

    torch.manual_seed(0)
    x = torch.randn(6, 5, 4)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    with pytest.warns(FallbackWarning, match="MultiheadAttention"):
        check(Attention(), x, y, "param_wise")


class NotPerSample(nn.Module):
    """Layers called on inputs without a per-sample batch axis: a Linear on a sequence-first
    view (detectable only when T ≠ B), position ids stored in the model (broadcast over the
    batch), and a Linear whose parameters are used without calling it."""

    def __init__(self, positions: int) -> None:
        super().__init__()
        self.seq_first = nn.Linear(6, 6)
        self.position = nn.Embedding(positions, 6)
        self.register_buffer("ids", torch.arange(positions))
        self.direct = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:  # x [B, T, 6]
        if x.shape[0] == x.shape[1]:
            h = self.seq_first(x)
        else:
            h = self.seq_first(x.transpose(0, 1)).transpose(0, 1)
        h = h + self.position(self.ids)
        return nn.functional.linear(torch.tanh(h).mean(1), self.direct.weight, self.direct.bias)


@pytest.mark.parametrize("positions", [4, 7])  # 7 = the batch size: the buffer check decides
def test_layers_without_per_sample_inputs_fall_back(positions: int) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(7, positions, 6), data("dense")[1]
    with pytest.warns(FallbackWarning) as caught:
        check(NotPerSample(positions), x, y, "layer_wise")
    messages = " ".join(str(w.message) for w in caught)
    assert "'position' (Embedding) is not called on a per-sample batch" in messages
    assert "'direct' (Linear) was never called" in messages
    if positions != 7:
        assert "'seq_first' (Linear) is not called on a per-sample batch" in messages


# ---------------------------------------------------------------- one pass, contract, errors
def test_one_forward_no_weight_gradients_one_coef_call_per_group() -> None:
    """Book-keeping needs one forward and one backward that never forms a weight gradient; each
    group's factors come from one call on that group's norms."""
    torch.manual_seed(0)
    model, (x, y) = Convs(), data("image")
    forwards, coef_calls = [], []
    model.register_forward_hook(lambda *_: forwards.append(1))

    def coef_fn(norms: Tensor) -> Tensor:
        coef_calls.append(norms.shape)
        return abadi(0.5)(norms)

    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        clipped_grad_sum(model, LOSS, x, y, style(model, "layer_wise"), coef_fn)
    assert len(forwards) == 1
    assert coef_calls == [(7, 1)] * len(style(model, "layer_wise"))
    assert all(p.grad is None for p in model.parameters())


class Recording(dict[str, Tensor]):
    """Clipped-sum buffers that note, for each parameter, whether its sum was added while the
    backward pass was still running."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__({n: torch.zeros_like(p) for n, p in model.named_parameters()})
        self.in_backward: dict[str, bool] = {}

    def __getitem__(self, name: str) -> Tensor:
        self.in_backward[name] = torch._C._current_graph_task_id() != -1
        return super().__getitem__(name)


class Deep(nn.Module):
    """Four Linear layers, the first called once, one hidden layer called twice (shared)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.mid, self.shared, self.head = (
            nn.Linear(6, 8),
            nn.Linear(8, 8),
            nn.Linear(8, 8),
            nn.Linear(8, 3),
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.mid(self.first(x).tanh()).tanh()
        return self.head(self.shared(self.shared(h).tanh()).tanh())


@pytest.mark.parametrize("style_name", ["all_layer", "layer_wise", "param_wise"])
def test_groups_finish_during_the_backward_pass(style_name: str) -> None:
    """Paper 002's memory advantage of layer-wise clipping: a group's clipped sums are added to
    the caller's buffer (and its layers' book-keeping dropped) as soon as its norms are known,
    while the backward pass still runs. Under all-layer clipping nothing finishes before the end;
    the first layer (its node never runs) and a shared layer (several calls) finish at the end.
    The sums are the same either way."""
    torch.manual_seed(0)
    model, (x, y) = Deep(), data("flat")
    groups = style(model, style_name)
    out = Recording(model)
    norms, sums = clipped_grad_sum(model, LOSS, x, y, groups, abadi(0.5), out=out)
    assert sums is out
    early = {name for name, during in out.in_backward.items() if during}
    if style_name == "all_layer":
        assert early == set()
    else:
        assert early == {"mid.weight", "mid.bias", "head.weight", "head.bias"}
    ref_norms, ref_sums = reference(model, x, y, groups, abadi(0.5), norms)
    assert_bound(norms, ref_norms, "norms")
    for name, value in ref_sums.items():
        assert_close(dict.__getitem__(out, name), value, name)


def test_empty_batch_gives_zero_sums() -> None:
    model = Mlp()
    norms, sums = clipped_grad_sum(
        model,
        LOSS,
        torch.zeros(0, 6),
        torch.zeros(0, dtype=torch.long),
        style(model, "layer_wise"),
        abadi(1.0),
    )
    assert norms.shape == (0, 2)
    assert all(
        v.shape == p.shape and not v.any()
        for v, p in zip(sums.values(), model.parameters(), strict=True)
    )


def test_bad_groups_are_named() -> None:
    model, (x, y) = Mlp(), data("dense")
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match=r"groups: .*in no group"):
        clipped_grad_sum(model, LOSS, x, y, [names[:-1]], abadi(1.0))
    with pytest.raises(ValueError, match="more than one group"):
        clipped_grad_sum(model, LOSS, x, y, [names, names[:1]], abadi(1.0))
    with pytest.raises(ValueError, match="'nope' is not a trainable"):
        clipped_grad_sum(model, LOSS, x, y, [[*names, "nope"]], abadi(1.0))


def test_mean_loss_is_rejected() -> None:
    model, (x, y) = Mlp(), data("dense")
    with pytest.raises(ValueError, match="loss_fn: must return per-sample losses"):
        clipped_grad_sum(model, nn.CrossEntropyLoss(), x, y, style(model, "all_layer"), abadi(1.0))


def test_batch_norm_in_training_is_rejected() -> None:
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    x, y = data("dense")
    with pytest.raises(ValueError, match="BatchNorm"):
        clipped_grad_sum(model, LOSS, x, y, style(model, "all_layer"), abadi(1.0))
