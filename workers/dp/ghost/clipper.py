"""The fast clipper: per-sample norms and clipped sums from one forward and one backward pass.

Paper 002, Algorithm 1 (book-keeping, Bu et al. 2022c): the forward pass records each supported
layer's input ``a``; one backward pass computes only the output gradients ``∂L/∂s`` of those
layers (``torch.autograd.grad`` on their outputs' gradient edges, so autograd never forms a
weight gradient); the per-sample norms of every layer follow from ``a`` and ``∂L/∂s``
(``layers.py``), the clip factors ``C = coef_fn(norms)`` are computed once for all groups, and
each clipped sum is ``aᵀ · diag(C) · ∂L/∂s`` — no second backward pass for any clipping style.

Hostile records (docs/design.md, invariant 9): norms are float64 (``layers.py`` explains the
guard that keeps norms over several positions an upper bound on what is summed); an example with a
non-finite norm gets clip factor 0 and its rows of ``a``, ``∂L/∂s``, kept per-sample gradients
and ``torch.func`` gradients are zeroed before any product (0·NaN = NaN), one layer at a time.

The seam gives ``coef_fn`` the whole [B, M] matrix at once (adaptive rules need every norm), so
``a`` and ``∂L/∂s`` are book-kept until the end of the backward pass: the peak memory of paper
002's all-layer style (Fact 6.1) for every style. Layers whose per-sample gradients are worth
holding instead of ``a`` and ``∂L/∂s`` (norm layers, convolutions over many positions: see
``LayerRule.keeps_per_sample``) instead form them in
the backward pass, from a hook on their output's autograd node, and drop ``a`` and ``∂L/∂s``;
one the backward pass does not run (the first layer: nothing book-kept lies below it) forms
them from its captured ``∂L/∂s`` right after. Norms and sums then come from the very same
per-sample tensors, so they agree in any precision.

Parameters of any other module (recurrent layers, attention modules using raw parameters, layers
that share a parameter, modules whose parameters are used without calling them) get exact
per-sample gradients from ``torch.func`` (``vmap(grad(...))`` over the batch, for those
parameters only), with one ``FallbackWarning`` naming the module — never silently skipped.

Requirements, as for any per-sample clipping: samples are independent through the model (no
BatchNorm in training mode) and supported layers see the batch on their first axis. A layer
called on something else falls back when that is detectable (leading size ≠ B, or an input the
model stores such as broadcast position ids); a layer fed a [T, ...] tensor with T = B that
is *not* per-sample cannot be told apart — the built-in models are tested for this.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.func import functional_call, grad, vmap

from workers.dp.clipping import (
    CoefFn,
    clip_factors,
    factors_as,
    finite_examples,
    sq_norms,
    zero_rows,
)
from workers.dp.ghost.layers import RULES, Call, LayerRule

LossFn = Callable[[Tensor, Tensor], Tensor]


#: the fallback reason of a layer called on something other than a per-sample batch: detected
#: only when its leading size differs from B (see the module docstring)
NOT_PER_SAMPLE = "is not called on a per-sample batch"


class FallbackWarning(UserWarning):
    """A module's parameters take the slower torch.func path instead of the fast path;
    ``module`` is its dotted name (``""``: the model itself) and ``reason`` says why."""

    def __init__(self, module: str, kind: str, reason: str) -> None:
        super().__init__(
            f"fast per-sample path: module {module or '<root>'!r} ({kind}) {reason}; "
            "its parameters use the torch.func path"
        )
        self.module, self.reason = module, reason


@dataclass
class _Layer:
    """A supported module, the full names of its trainable parameters, and its recorded calls."""

    name: str
    module: nn.Module
    rule: LayerRule
    params: dict[str, str]  # attribute -> full parameter name
    shared: bool = False  # some call saw no per-sample input
    order: int = -1  # position of its first call in the forward pass
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[tuple[GradientEdge, torch.Size, torch.dtype]] = field(default_factory=list)
    kept: dict[str, Tensor] | None = None  # per-sample gradients formed during the backward


def _fall_back(module_name: str, module: nn.Module, reason: str) -> None:
    warnings.warn(FallbackWarning(module_name, type(module).__name__, reason), stacklevel=4)


def _plan(model: nn.Module, params: dict[str, nn.Parameter]) -> tuple[list[_Layer], list[str]]:
    """Split the trainable parameters into supported layers and fallback parameter names."""
    full_name = {id(p): n for n, p in params.items()}
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    layers: list[_Layer] = []
    fallback: dict[str, None] = {}  # ordered set: a tied parameter has several owners
    for module_name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            raise ValueError(
                f"model: module {module_name!r} is a BatchNorm in training mode, which mixes "
                "samples; per-sample clipping needs e.g. GroupNorm"
            )
        own = {
            a: full_name[id(p)]
            for a, p in module.named_parameters(recurse=False)
            if id(p) in full_name
        }
        if not own:
            continue
        rule = RULES.get(type(module))
        reason = "has no fast rule" if rule is None else rule.fallback_reason(module)
        if reason is None and any(owners[id(params[n])] > 1 for n in own.values()):
            reason = "shares a parameter with another module"
        if reason is None:
            assert rule is not None
            layers.append(_Layer(module_name, module, rule, own))
        else:
            _fall_back(module_name, module, reason)
            fallback.update(dict.fromkeys(own.values()))
    return layers, list(fallback)


def _record(model: nn.Module, layers: list[_Layer], inputs: Tensor) -> Tensor:
    """Run the forward pass, recording each supported layer's input and output gradient edge.

    A call whose input is not a per-sample batch (leading size other than B, or a tensor the
    model stores, like position ids broadcast over the batch) marks its layer ``shared``.
    """
    batch = inputs.shape[0]
    stored = {id(t) for t in (*model.buffers(), *model.parameters())}
    order: list[_Layer] = []

    def hook(layer: _Layer, module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> None:
        x = args[0] if args else next(iter(kwargs.values()))
        if x.dim() == 0 or x.shape[0] != batch or id(x) in stored:
            layer.shared = True
        if not layer.inputs:
            layer.order = len(order)
            order.append(layer)
        layer.inputs.append(x.detach())
        # The edge is taken before any in-place op on the output, so the gradient read there is
        # ∂L/∂s of this layer's own output.
        layer.outputs.append((get_gradient_edge(output), output.shape, output.dtype))

    handles = [
        layer.module.register_forward_hook(
            lambda m, a, k, o, layer=layer: hook(layer, m, a, k, o), with_kwargs=True
        )
        for layer in layers
    ]
    try:
        return model(inputs)
    finally:
        for handle in handles:
            handle.remove()


def _reaches(start: Node, targets: set[Node], dead_ends: set[Node]) -> bool:
    """Whether the backward pass from ``start`` leads to one of ``targets`` (so computing the
    gradients at ``targets`` executes ``start``). ``dead_ends`` caches nodes that reach none
    (still true as targets grow: later targets are never below earlier-visited nodes)."""
    todo = [n for n, _ in start.next_functions if n is not None]
    seen: set[Node] = set()
    while todo:
        node = todo.pop()
        if node in targets:
            return True
        if node in seen or node in dead_ends:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions if n is not None)
    dead_ends.update(seen)
    return False


def _keeps(layer: _Layer) -> bool:
    """Whether ``layer`` holds per-sample gradients instead of ``a`` and ``∂L/∂s`` (its rule's
    ``keeps_per_sample``; only for a layer called once)."""
    return len(layer.inputs) == 1 and layer.rule.keeps_per_sample(
        layer.module, layer.inputs[0], layer.outputs[0][1]
    )


def _split_kept(layers: list[_Layer]) -> tuple[list[_Layer], list[_Layer]]:
    """Layers whose per-sample gradients are formed in the backward pass, and the others.

    A layer can keep per-sample gradients only if its node runs in the backward pass, i.e. if
    it leads to the output of a book-kept layer below it; layers are visited bottom-up (forward
    order) so that set is complete when a layer is decided. A layer that would keep them but
    is not reached (typically the first layer) forms them right after the backward pass.
    """
    kept, booked = [], []
    targets: set[Node] = set()
    dead_ends: set[Node] = set()
    for layer in sorted(layers, key=lambda item: item.order):
        if _keeps(layer) and _reaches(layer.outputs[0][0].node, targets, dead_ends):
            kept.append(layer)
        else:
            booked.append(layer)
            targets.update(out[0].node for out in layer.outputs)
    return kept, booked


def _backward(losses: Tensor, layers: list[_Layer]) -> dict[str, list[Call]]:
    """The one backward pass: output gradients of the book-kept layers' calls (none of the
    weights), while hooks form the per-sample gradients of the other layers."""
    kept, booked = _split_kept(layers)

    def keep(layer: _Layer, output_nr: int, grad_outputs: tuple[Tensor | None, ...]) -> None:
        if grad_outputs[output_nr] is not None:
            layer.kept = layer.rule.per_sample(
                layer.module, Call(layer.inputs[0], grad_outputs[output_nr])
            )
            layer.inputs.clear()  # a is no longer needed: free it as the backward goes

    handles = [
        layer.outputs[0][0].node.register_prehook(
            functools.partial(keep, layer, layer.outputs[0][0].output_nr)
        )
        for layer in kept
    ]
    recorded = [
        (layer, x, out)
        for layer in booked
        for x, out in zip(layer.inputs, layer.outputs, strict=True)
    ]
    try:
        grads = (
            torch.autograd.grad(losses.sum(), [out[0] for _, _, out in recorded], allow_unused=True)
            if recorded
            else ()
        )
    finally:
        for handle in handles:
            handle.remove()
    calls: dict[str, list[Call]] = {layer.name: [] for layer in booked}
    for (layer, x, (_, shape, dtype)), g in zip(recorded, grads, strict=True):
        if g is None:  # this call's output did not reach the loss
            g = torch.zeros(shape, dtype=dtype, device=x.device)
        calls[layer.name].append(Call(x, g))
    del recorded, grads
    for layer in booked:
        if _keeps(layer):  # not reached by the backward pass: form them now, drop a and ∂L/∂s
            layer.kept = layer.rule.per_sample(layer.module, calls.pop(layer.name)[0])
            layer.inputs.clear()
            kept.append(layer)
    for layer in kept:
        if layer.kept is None:  # its output did not reach the loss
            layer.kept = {
                attr: (p := getattr(layer.module, attr)).new_zeros(len(losses), *p.shape)
                for attr in layer.params
            }
    return calls


def _per_sample_grads(
    model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, names: list[str]
) -> dict[str, Tensor]:
    """Per-sample gradients [B, *shape] of the named parameters by ``vmap(grad(...))``."""
    state = {**dict(model.named_buffers()), **{n: p.detach() for n, p in model.named_parameters()}}
    chosen = {n: state.pop(n) for n in names}

    def loss_one(chosen: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        out = functional_call(model, (chosen, state), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0)).sum()

    return vmap(grad(loss_one), in_dims=(None, 0, 0), randomness="different")(
        chosen, inputs, targets
    )


def _group_index(groups: list[list[str]], params: dict[str, nn.Parameter]) -> dict[str, int]:
    index: dict[str, int] = {}
    for m, group in enumerate(groups):
        for name in group:
            if name not in params:
                raise ValueError(f"groups: {name!r} is not a trainable parameter of the model")
            if name in index:
                raise ValueError(f"groups: parameter {name!r} is in more than one group")
            index[name] = m
    missing = [n for n in params if n not in index]
    if missing:
        raise ValueError(f"groups: parameters {missing} are in no group")
    return index


def clipped_grad_sum(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Tensor,
    targets: Tensor,
    groups: list[list[str]],
    coef_fn: CoefFn,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipper seam, fast path: ``(norms [B, M], {name: Σ_i coef[i, m(name)] · g_i[name]})``.

    Same contract and results as the general ``torch.func`` path (``workers/dp/grads.py``);
    norms are float64, and an example with a non-finite norm adds nothing to any sum.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    group_of = _group_index(groups, params)
    batch = inputs.shape[0]
    first = next(iter(params.values()))
    if batch == 0:  # an empty Poisson batch: zero sums, and coef_fn sees it as on the general path
        norms = torch.zeros(0, len(groups), dtype=torch.float64, device=first.device)
        coef_fn(norms)
        return norms, {n: torch.zeros_like(p) for n, p in params.items()}
    layers, fallback = _plan(model, params)

    losses = loss_fn(_record(model, layers, inputs), targets)
    if losses.shape != (batch,):
        raise ValueError(
            f"loss_fn: must return per-sample losses of shape ({batch},), got {tuple(losses.shape)}"
        )
    for layer in layers:
        if not layer.inputs or layer.shared:
            reason = (
                NOT_PER_SAMPLE
                if layer.shared
                else ("was never called as a module (its parameters are used directly)")
            )
            _fall_back(layer.name, layer.module, reason)
            fallback += layer.params.values()
    layers = [layer for layer in layers if layer.inputs and not layer.shared]
    calls = _backward(losses, layers)
    del losses
    fallback_grads = (
        _per_sample_grads(model, loss_fn, inputs, targets, fallback) if fallback else {}
    )

    squares = {n: sq_norms(g) for n, g in fallback_grads.items()}
    for layer in layers:
        if layer.kept is not None:
            layer_sq = {k: sq_norms(v) for k, v in layer.kept.items()}
        else:
            layer_sq = layer.rule.sq_norms(layer.module, calls[layer.name])
        squares.update({layer.params[attr]: value for attr, value in layer_sq.items()})
    norms = torch.zeros(batch, len(groups), dtype=torch.float64, device=first.device)
    for name, value in squares.items():
        norms[:, group_of[name]] += value
    norms = norms.sqrt()

    coef = clip_factors(coef_fn, norms)
    keep = finite_examples(norms)
    clean = bool(keep.all())

    def rows(x: Tensor) -> Tensor:
        """``x`` without the rows of examples whose norm is not finite (ids stay as they are)."""
        return x if clean or not x.is_floating_point() else zero_rows(x, keep)

    def clipped(m: int, g: Tensor) -> Tensor:
        return torch.tensordot(factors_as(coef[:, m], g.dtype), rows(g), dims=1)

    sums = {n: clipped(group_of[n], g) for n, g in fallback_grads.items()}
    for layer in layers:
        if layer.kept is not None:
            layer_sums = {k: clipped(group_of[layer.params[k]], v) for k, v in layer.kept.items()}
        else:
            layer_calls = [Call(rows(c.activation), rows(c.grad)) for c in calls[layer.name]]
            layer_coef = {attr: coef[:, group_of[n]] for attr, n in layer.params.items()}
            layer_sums = layer.rule.sums(layer.module, layer_calls, layer_coef)
        sums.update({layer.params[attr]: value for attr, value in layer_sums.items()})
    return norms, {n: sums[n] for n in params}
