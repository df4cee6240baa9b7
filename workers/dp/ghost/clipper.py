"""The fast clipper: per-sample norms and clipped sums from one forward and one backward pass.

Paper 002, Algorithm 1 (book-keeping, Bu et al. 2022c): the forward pass records each supported
layer's input ``a``; one backward pass computes only the output gradients ``∂L/∂s`` of those
layers (``torch.autograd.grad`` on their outputs' gradient edges, so autograd never forms a
weight gradient); the per-sample norms of every layer follow from ``a`` and ``∂L/∂s``
(``layers.py``), the clip factors ``C = coef_fn(norms)`` follow group by group, and each clipped
sum is ``aᵀ · diag(C) · ∂L/∂s`` — no second backward pass for any clipping style.

Groups finish as early as they can (paper 002: layer-wise and group-wise clipping need not hold
every layer's book-keeping until the backward pass ends). A hook on each layer's output node
captures ``∂L/∂s`` when the backward pass reaches it; once every parameter of a group has its
norm, the group's factors are computed, its clipped sums added into the caller's buffer and the
tensors they came from dropped. Under all-layer clipping the one group is complete only at the
end, so everything is held until then (Fact 6.1's peak); under layer-wise clipping each layer is
finished while the backward pass goes on. Layers called several times, and layers whose node
the backward pass does not run (the first layer: nothing book-kept lies below it), get their
``∂L/∂s`` from the backward pass's result at the end.

Layers whose per-sample gradients are worth holding instead of ``a`` and ``∂L/∂s`` (norm layers,
convolutions over many positions: see ``LayerRule.keeps_per_sample``) form them from the captured
``∂L/∂s`` and drop ``a`` and ``∂L/∂s``. Norms and sums then come from the very same per-sample
tensors, so they agree in any precision.

A group's instantiated per-sample gradients (kept ones, biases and affine norm parameters, the
``torch.func`` ones) are clipped together as one flat buffer [B, D]
(``workers.dp.clipping.FlatRows``): one norm bound, one zeroing of hostile rows, one product for
all their clipped sums and one operation that adds them into the buffer, a handful of
operations (kernel launches on a GPU) a group however many tensors it has; large ones
(``FLAT_ELEMENTS``) and book-kept weights add a bound and a sum each. On CPU, where an
operation costs little beyond its arithmetic and the copy into the buffer a pass over memory,
each tensor is clipped alone (``flat_limit``).

Book-kept weights stack likewise: layers of one geometry called once on inputs of one shape
(``LayerRule.stack_key``: resnet18's same-shaped convolutions of a stage), whose weights are in
one group, are measured and summed as the maps of one layer (``_Stack``): their inputs and
output gradients concatenated once, then one norm bound over all of them (which is what the
group's norm adds up anyway) and one clipped sum, split back into their buffers. The bound over
the maps is the rule's own (a grouped convolution's), so the guard of ``layers.py`` holds for
each map's rows as it does for each conv group's.

Hostile records (docs/design.md, invariant 9): norms are float32 upper bounds
(``workers.dp.bounds``; ``layers.py`` explains the guard that keeps norms over several positions
an upper bound on what is summed); an example gets clip factor 0 in a group where its bound is
not finite, and its rows of the group's per-sample gradients and of a book-kept weight's ``a``
and ``∂L/∂s`` are zeroed (``masked_fill``: branch-free, no step waits on the host to see them)
before any product (0·NaN = NaN) for that group. Its bound there covers the very rows (or the
book-kept tensors) summed, so where it is finite they are finite.

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
import math
import warnings
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.func import functional_call, grad, vmap

from workers.dp import bounds
from workers.dp.bounds import Bound
from workers.dp.clipping import CoefFn, FlatRows, clip_factors, factors_as, zero_rows
from workers.dp.ghost.layers import RULES, Call, LayerRule

LossFn = Callable[[Tensor, Tensor], Tensor]


#: ``rows`` of ``add_sums``: examples ``part`` (all by default) of a tensor, dropped ones zeroed
Rows = Callable[..., Tensor]
#: the most bytes of a layer's book-kept inputs zeroed at once (``_Layer.add_sums``)
MASK_CHUNK_BYTES = 1 << 19
#: on an accelerator, per-sample gradients of at least this many values a sample are clipped
#: alone (a norm, a zeroing copy, an ``addmv_``), not copied into their group's flat buffer:
#: that copy of B·n values would double them in memory for a few launches saved
FLAT_ELEMENTS = 1 << 14

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
    saved: list[object] = field(default_factory=list)  # what its calls' forward left for the rule
    calls: list[Call] = field(default_factory=list)  # book-kept (a, ∂L/∂s), once known
    kept: dict[str, Tensor] | None = None  # or its per-sample gradients instead

    @property
    def names(self) -> list[str]:
        return list(self.params.values())

    @property
    def book_kept(self) -> str | None:
        """The full name of its weight where its sum is book-kept (formed from ``a`` and
        ``∂L/∂s``, not from per-sample gradients), else None."""
        return self.params.get("weight") if self.calls and self.rule.has_weight_matrix else None

    def stack_key(self, group_of: Mapping[str, int]) -> Hashable | None:
        """Where its weight is book-kept: its group and its rule's ``stack_key`` (None: it is
        measured alone)."""
        name = self.book_kept
        if name is None:
            return None
        key = self.rule.stack_key(self.module, self.calls)
        return None if key is None else (group_of[name], type(self.rule), key)

    def bounds(self) -> dict[str, Bound]:
        """A bound on the per-sample norm of its book-kept weight, by full name."""
        name = self.book_kept
        return {} if name is None else {name: self.rule.weight_norms(self.module, self.calls)}

    def per_sample(self) -> dict[str, Tensor]:
        """Its instantiated per-sample gradients [B, *shape] by full name, handed over (dropped
        here): all its parameters' where it keeps them, else its small ones (biases, affine
        norm parameters)."""
        kept = self.kept if self.kept is not None else self.rule.small(self.module, self.calls)
        self.kept = None
        return {self.params[attr]: g for attr, g in kept.items()}

    def add_sums(self, coef: Tensor, rows: Rows, out: Mapping[str, Tensor]) -> None:
        """Add the clipped sum of its book-kept weight into its buffer in ``out``, for factors
        ``coef``, from its tensors passed through ``rows`` (which zeroes dropped examples).

        Zeroing copies what it zeroes, so a rank-one layer's book-kept inputs of more than
        ``MASK_CHUNK_BYTES`` (logreg's and the mlp's wide first layer, whose one product is
        otherwise its only transient) are zeroed and summed a slice of examples at a time: a
        clipped sum is a sum over examples. Other layers' own temporaries (patches, positions)
        outweigh the copy, and slicing them would only add operations (kernel launches)."""
        batch = self.calls[0].grad.shape[0]
        size = sum(c.activation.numel() * c.activation.element_size() for c in self.calls)
        flat = all(c.activation.dim() == 2 for c in self.calls)
        step = (
            batch
            if not flat or size <= MASK_CHUNK_BYTES
            else max(1, batch * MASK_CHUNK_BYTES // size)
        )
        name = self.book_kept
        assert name is not None
        for start in range(0, batch, step):
            part = slice(start, start + step)
            self.rule.add_weight_sum(
                self.module,
                [Call(rows(c.activation, part), rows(c.grad, part)) for c in self.calls],
                coef[part],
                out[name],
            )

    def release(self) -> None:
        self.inputs.clear()
        self.saved.clear()
        self.calls.clear()
        self.kept = None


class _Stack:
    """Book-kept layers of one rule's ``stack_key`` whose weights are in one group, measured and
    summed as the maps of one layer (``LayerRule.stacked``): one norm bound over all their
    weights (the group's norm takes the bounds' squares added, which a bound over the maps
    already is) and one clipped sum, split back into their buffers."""

    def __init__(self, layers: list[_Layer]) -> None:
        first = layers[0]
        self.layers, self.rule = layers, first.rule
        self.module, call = first.rule.stacked(
            [layer.module for layer in layers], [layer.calls[0] for layer in layers]
        )
        self.calls = [call]
        self.weights = [name for layer in layers if (name := layer.book_kept) is not None]
        self.book_kept = first.book_kept

    def bounds(self) -> dict[str, Bound]:
        assert self.book_kept is not None
        return {self.book_kept: self.rule.weight_norms(self.module, self.calls)}

    def per_sample(self) -> dict[str, Tensor]:
        """Its layers' small per-sample gradients (biases), handed over; their own ``a`` and
        ``∂L/∂s`` are dropped (the stacked copies stay for the sum)."""
        rows = {name: g for layer in self.layers for name, g in layer.per_sample().items()}
        for layer in self.layers:
            layer.release()
        return rows

    def add_sums(self, coef: Tensor, rows: Rows, out: Mapping[str, Tensor]) -> None:
        """One clipped sum over the maps, its G parts added into the layers' buffers."""
        (call,) = self.calls
        total = self.rule.weight_sum(
            self.module, [Call(rows(call.activation), rows(call.grad))], coef
        )
        parts = total.chunk(len(self.layers))
        torch._foreach_add_([out[name] for name in self.weights], parts)

    def release(self) -> None:
        self.calls.clear()


def _stacked(units: list[_Layer | _Fallback], group_of: dict[str, int]) -> list[_Unit]:
    """``units`` with the book-kept layers that share a rule's ``stack_key`` and their weight's
    group replaced by one ``_Stack`` each."""
    stacks: dict[Hashable, list[_Layer]] = {}
    alone: list[_Unit] = []
    for unit in units:
        key = unit.stack_key(group_of) if isinstance(unit, _Layer) else None
        if key is None:
            alone.append(unit)
        else:
            assert isinstance(unit, _Layer)
            stacks.setdefault(key, []).append(unit)
    return alone + [layers[0] if len(layers) == 1 else _Stack(layers) for layers in stacks.values()]


class _Fallback:
    """The ``torch.func`` per-sample gradients of the parameters no rule handles."""

    book_kept = None

    def __init__(self, grads: dict[str, Tensor]) -> None:
        self.grads, self.names = grads, list(grads)

    def bounds(self) -> dict[str, Bound]:
        return {}

    def per_sample(self) -> dict[str, Tensor]:
        grads, self.grads = self.grads, {}
        return grads

    def release(self) -> None:
        self.grads.clear()


#: what a group measures: a layer, a stack of layers, or the fallback's parameters
_Unit = _Layer | _Stack | _Fallback


class _Groups:
    """Clips each group as soon as every unit (a layer, or the fallback) holding its parameters
    has arrived, and adds each clipped sum into ``out`` as soon as its group is clipped, then
    frees the tensors it came from.

    A group's instantiated per-sample gradients are clipped together, as one flat buffer
    (``workers.dp.clipping.FlatRows``); each book-kept weight (a layer's ``a`` and ``∂L/∂s``)
    adds a bound of its own. A unit's norms are taken only once one of its groups is complete:
    work done earlier would add its transients to the backward pass's peak without freeing
    anything before the end.
    """

    def __init__(
        self,
        groups: list[list[str]],
        group_of: dict[str, int],
        coef_fn: CoefFn,
        out: Mapping[str, Tensor],
    ) -> None:
        self.group_of, self.coef_fn, self.out = group_of, coef_fn, out
        self.bounds: list[list[Bound]] = [[] for _ in groups]  # by group: norm bounds taken
        #: by group: its instantiated per-sample gradients by name, by dtype
        self.rows: list[dict[torch.dtype, dict[str, Tensor]]] = [{} for _ in groups]
        self.norms: dict[int, Tensor] = {}  # by group, once it is clipped: its norms [B]
        self.missing = [len(group) for group in groups]  # parameters whose unit is yet to come
        self.coef: dict[int, Tensor] = {}
        self.converted: dict[tuple[int, torch.dtype], Tensor] = {}  # ``factors``, by dtype
        self.dropped: dict[int, Tensor] = {}  # ``_drop``, by group
        self.arrived: list[_Layer | _Fallback] = []  # norms not taken yet
        self.measured: list[_Layer | _Stack] = []  # book-kept weights measured, sums not added yet

    def _groups(self, unit: _Layer | _Fallback) -> set[int]:
        return {self.group_of[name] for name in unit.names}

    def add(self, unit: _Layer | _Fallback) -> None:
        self.arrived.append(unit)
        for name in unit.names:
            self.missing[self.group_of[name]] -= 1
        complete = {m for m in self._groups(unit) if not self.missing[m]}
        if not complete:
            return
        ready = [u for u in self.arrived if self._groups(u) & complete]
        self.arrived = [u for u in self.arrived if not self._groups(u) & complete]
        for other in _stacked(ready, self.group_of):
            self._measure(other)
        for m in complete:
            self._clip(m)
        self.measured = [u for u in self.measured if not self._sum(u)]

    def _measure(self, unit: _Unit) -> None:
        """Take ``unit``'s book-kept bounds and its instantiated per-sample gradients."""
        for name, bound in unit.bounds().items():
            self.bounds[self.group_of[name]].append(bound)
        for name, g in unit.per_sample().items():
            self.rows[self.group_of[name]].setdefault(g.dtype, {})[name] = g
        if unit.book_kept is None:
            unit.release()
        else:
            assert not isinstance(unit, _Fallback)
            self.measured.append(unit)

    def _clip(self, m: int) -> None:
        """Group ``m``'s norm bounds (``workers.dp.bounds.group_norms``) and clip factors, then
        the clipped sums of its instantiated per-sample gradients."""
        flats = [flat for rows in self.rows[m].values() for flat in _flats(rows)]
        self.rows[m].clear()
        parts = self.bounds[m] + [flat.bounds() for flat, _ in flats]
        norms = bounds.group_norms(parts)
        self.bounds[m].clear()
        self.norms[m] = norms
        self.coef[m] = clip_factors(self.coef_fn, norms.unsqueeze(1))[:, 0]
        for flat, names in flats:
            coef = self.factors(m, flat.rows.dtype)
            flat.add_to([self.out[name] for name in names], coef, self._drop(m))

    def factors(self, m: int, dtype: torch.dtype) -> Tensor:
        """Group ``m``'s clip factors in ``dtype`` (``factors_as``), converted once a clipper
        call (a micro-batch)."""
        if dtype == self.coef[m].dtype:
            return self.coef[m]  # finite (``clip_factors``): nothing to convert or clamp
        if (m, dtype) not in self.converted:
            self.converted[m, dtype] = factors_as(self.coef[m], dtype)
        return self.converted[m, dtype]

    def _sum(self, unit: _Layer | _Stack) -> bool:
        """Add ``unit``'s book-kept weight sums to ``out`` if their group is clipped."""
        name = unit.book_kept
        assert name is not None
        m = self.group_of[name]
        if m not in self.coef:
            return False
        unit.add_sums(self.coef[m], _zeroing(self._drop(m)), self.out)
        unit.release()
        return True

    def _drop(self, m: int) -> Tensor:
        """Which examples contribute nothing to group ``m`` [B] (bool): those of clip factor 0,
        every one whose norm is not finite (NaN included, ``clip_factors``) among them; formed
        once a call. Their rows are zeroed before any product for the group (0·NaN = NaN); a
        kept one's norm is finite, and it bounds the very rows or book-kept tensors summed, so
        they are finite. A finite row of factor 0 adds 0 either way."""
        if m not in self.dropped:
            self.dropped[m] = self.coef[m] == 0
        return self.dropped[m]

    def done(self) -> Tensor:
        """The norms [B, M], once every unit is added."""
        assert not self.arrived and not self.measured, "a group was never clipped"
        if len(self.bounds) == 1:
            return self.norms[0].unsqueeze(1)
        return torch.stack([self.norms[m] for m in range(len(self.bounds))], 1)


def flat_limit(device: torch.device) -> int:
    """Per-sample gradients of fewer values a sample than this join their group's flat buffer:
    :data:`FLAT_ELEMENTS` on an accelerator, where the buffer saves kernel launches; none on
    CPU, where its copy cost the cnn's and the transformer's steps more than the operations it
    saved (docs/performance.md, "CPU step")."""
    return 0 if device.type == "cpu" else FLAT_ELEMENTS


def _flats(rows: dict[str, Tensor]) -> list[tuple[FlatRows, list[str]]]:
    """Per-sample gradients of one dtype by name as flat buffers and their names: one buffer of
    the small ones, each large one alone (:func:`flat_limit`)."""
    large = [name for name, g in rows.items() if math.prod(g.shape[1:]) >= flat_limit(g.device)]
    small = [name for name in rows if name not in large]
    flats = [(FlatRows([rows[name]]), [name]) for name in large]
    if small:
        flats.append((FlatRows([rows[name] for name in small]), small))
    return flats


def _zeroing(drop: Tensor) -> Rows:
    """``rows`` of a unit's ``add_sums``: examples ``part`` of a tensor, the dropped zeroed."""

    def rows(x: Tensor, part: slice = slice(None)) -> Tensor:
        return zero_rows(x[part], drop[part])

    return rows


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
        layer.saved.append(layer.rule.saved(x, output))

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


def _hooked(layers: list[_Layer]) -> list[_Layer]:
    """The layers whose ``∂L/∂s`` a hook on their output node captures during the backward pass:
    those called once whose node the backward pass runs, i.e. that lead to the output of another
    layer below them (whose gradient is captured or computed). Layers are visited bottom-up
    (forward order), so that set is complete when a layer is decided."""
    hooked = []
    below: set[Node] = set()
    dead_ends: set[Node] = set()
    for layer in sorted(layers, key=lambda item: item.order):
        if len(layer.outputs) == 1 and _reaches(layer.outputs[0][0].node, below, dead_ends):
            hooked.append(layer)
        below.update(out[0].node for out in layer.outputs)
    return hooked


def _ready(layer: _Layer, calls: list[Call], groups: _Groups) -> None:
    """Give ``layer`` its calls — or the per-sample gradients formed from its one call, where its
    rule keeps them — drop its recorded inputs, and hand it to ``groups``."""
    if _keeps(layer):
        layer.kept = layer.rule.per_sample(layer.module, calls[0])
    else:
        layer.calls = calls
    layer.inputs.clear()
    layer.saved.clear()
    groups.add(layer)


def _backward(losses: Tensor, layers: list[_Layer], groups: _Groups) -> None:
    """The one backward pass: hooks capture the hooked layers' output gradients and hand each
    layer to ``groups`` as the pass goes; the pass itself computes the other layers' output
    gradients (none of the weights), handed over at its end."""
    hooked = _hooked(layers)
    rest = [layer for layer in layers if all(layer is not h for h in hooked)]

    def capture(layer: _Layer, output_nr: int, grad_outputs: tuple[Tensor | None, ...]) -> None:
        g = grad_outputs[output_nr]
        if g is not None:
            _ready(layer, [Call(layer.inputs[0], g, layer.saved[0])], groups)

    handles = [
        layer.outputs[0][0].node.register_prehook(
            functools.partial(capture, layer, layer.outputs[0][0].output_nr)
        )
        for layer in hooked
    ]
    recorded = [
        (layer, x, out, saved)
        for layer in rest
        for x, out, saved in zip(layer.inputs, layer.outputs, layer.saved, strict=True)
    ]
    try:
        grads = (
            torch.autograd.grad(
                losses.sum(), [out[0] for _, _, out, _ in recorded], allow_unused=True
            )
            if recorded
            else ()
        )
    finally:
        for handle in handles:
            handle.remove()
    calls: dict[str, list[Call]] = {layer.name: [] for layer in rest}
    for (layer, x, out, saved), g in zip(recorded, grads, strict=True):
        calls[layer.name].append(_call(x, g, out, saved))
    del recorded, grads
    for layer in rest:
        _ready(layer, calls.pop(layer.name), groups)
    for layer in hooked:
        if layer.inputs:  # its output did not reach the loss: the hook never ran
            _ready(layer, [_call(layer.inputs[0], None, layer.outputs[0], layer.saved[0])], groups)


def _call(
    x: Tensor, g: Tensor | None, out: tuple[GradientEdge, torch.Size, torch.dtype], saved: object
) -> Call:
    """One call's input and output gradient; zero if its output did not reach the loss."""
    if g is None:
        _, shape, dtype = out
        g = torch.zeros(shape, dtype=dtype, device=x.device)
    return Call(x, g, saved)


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
    out: Mapping[str, Tensor] | None = None,
) -> tuple[Tensor, Mapping[str, Tensor]]:
    """The clipper seam, fast path: ``(norms [B, M], {name: Σ_i coef[i, m(name)] · g_i[name]})``,
    the sums added into ``out`` when given (``workers.dp.engine.Clipper``).

    Same contract and results as the general ``torch.func`` path (``workers/dp/grads.py``);
    norms are float32 upper bounds, and an example adds nothing to a group where its bound is not
    finite.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    group_of = _group_index(groups, params)
    sums = out if out is not None else {n: torch.zeros_like(p) for n, p in params.items()}
    batch = inputs.shape[0]
    if batch == 0:  # an empty Poisson batch: zero sums, and coef_fn sees it as on the general path
        norms = torch.zeros(
            0, len(groups), dtype=torch.float32, device=next(iter(params.values())).device
        )
        coef_fn(norms)
        return norms, sums
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
    clipping = _Groups(groups, group_of, coef_fn, sums)
    _backward(losses, layers, clipping)
    del losses
    if fallback:
        clipping.add(_Fallback(_per_sample_grads(model, loss_fn, inputs, targets, fallback)))
    return clipping.done(), sums
