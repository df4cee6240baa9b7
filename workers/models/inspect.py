"""Whether DP-SGD may train a model, and on which per-sample path: checked before any data is
read, on a public dummy batch (random inputs of the dataset's registered shape).

Per-example clipping bounds one example's influence on a step only if each example's gradient
depends on that example alone, and the noise covers what is released only if nothing else of
the data reaches the weights. So a model is refused when

- a module normalises over the batch (any BatchNorm, SyncBatchNorm included) or an example's
  output changes with the rest of the batch (checked on the batch for layers this module does
  not know by name), or a batch of one example cannot be run (the general path runs each
  example alone);
- it is random: dropout, or a forward pass that gives different outputs for the same batch. The
  general path's ``vmap`` refuses random operations, and the built-in models have none either,
  so that an example's per-sample gradient is a function of the parameters;
- its state other than the trainable parameters (a buffer, a frozen parameter, any other
  ``state_dict`` entry) changes in a training step, or an entry appears: the model's own code
  writes it, perhaps from the data (running statistics). The release resets such state to its
  initial value whatever happens (``workers.release``); refusing it here tells the operator
  early that it would not be released as trained;
- a module is lazy (its parameters appear only in the first forward pass, after the optimizer
  and the clipping groups were built), or nothing is trainable;
- its output is not finite logits [B, num_classes];
- the job's per-sample path fails on it or disagrees with each example's own gradient
  (autograd on the example alone): every parameter's per-sample norm and clipped sum are
  compared. On the fast path a layer called on something that is not a per-sample batch is
  refused outright: the fast path tells such a call apart only by its leading size, so a batch
  that happens to have that size would be clipped by wrong norms (``workers.dp.ghost``).

These checks catch an honest mistake in the operator's code, not a hostile factory: the trust
boundary is the allow-list of modules jobs may name.
"""

from __future__ import annotations

import logging
import threading
import warnings

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from core.config import LayerRoute, ModelReport, PerSamplePath, StateTensor
from workers.dp import get_clipper
from workers.dp.clipping import clip_factors, coefficient_fn
from workers.dp.ghost import NOT_PER_SAMPLE, FallbackWarning
from workers.release import InitialState

log = logging.getLogger("dptune.inspect")

Shape = tuple[int, ...]

#: examples in the dummy batch (more than one, so that examples can mix)
BATCH = 4
#: relative tolerance of outputs and gradients computed two ways in float32
RTOL = 1e-3
#: how far above an example's own gradient norm the clipper's bound may be: its float32 ghost
#: norms' rounding guard raises norms over many positions by up to a few per cent
BOUND_MARGIN = 1.1
_LOSS = nn.CrossEntropyLoss(reduction="none")
#: ``warnings.catch_warnings`` swaps process-wide state: one inspection at a time
_CAPTURE = threading.Lock()

Refusals = list[LayerRoute]


def inspect_model(
    model: nn.Module, input_shape: Shape, num_classes: int, per_sample: PerSamplePath
) -> ModelReport:
    """Inspect ``model`` (built for ``input_shape`` and ``num_classes``) for the job's
    per-sample path. The report's ``refused`` lists what makes it unfit (empty: accepted).
    The model's parameters are left as they were."""
    model.train()
    layout = _layout(model)
    refused = _structure(model)
    fast: list[LayerRoute] = []
    general: list[LayerRoute] = []
    if not refused:
        x, y = _dummy_batch(input_shape, num_classes)
        state = InitialState.capture(model).untrained
        refused = _outputs(model, x, num_classes)
        if not refused:
            fast, general, refused = _gradients(model, x, y, per_sample)
        refused += _changed_state(model, layout, state)
    params = [p for p in model.parameters() if not is_lazy(p)]
    return ModelReport(
        input_shape=list(input_shape),
        num_classes=num_classes,
        per_sample=per_sample,
        parameters=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        fast=fast,
        general=general,
        refused=refused,
        state=layout,
    )


def _layout(model: nn.Module) -> dict[str, StateTensor]:
    """The ``state_dict`` as built, before any forward pass: what a release holds."""
    return {
        name: StateTensor(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))
        for name, t in model.state_dict().items()
        if not is_lazy(t)
    }


def _route(model: nn.Module, module: str, reason: str | None = None) -> LayerRoute:
    return LayerRoute(module=module, type=type(model.get_submodule(module)).__name__, reason=reason)


def _unfit(module: nn.Module) -> str | None:
    """Why a module of this kind cannot be trained with per-example clipping, if it cannot."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return (
            "BatchNorm normalises over the batch, so an example's gradient depends on the other "
            "examples; use GroupNorm or LayerNorm"
        )
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        return (
            "tracks running statistics of the data, which would be released with the weights "
            "without noise; set track_running_stats=False"
        )
    if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
        return (
            "dropout makes an example's gradient random; the general per-sample path refuses "
            "random operations: remove it (DP noise regularises already)"
        )
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        return "lazy module: its parameters must exist when the factory returns; give its sizes"
    return None


def _structure(model: nn.Module) -> Refusals:
    refused = [
        _route(model, name, reason)
        for name, module in model.named_modules()
        if (reason := _unfit(module)) is not None
    ]
    if not refused and not any(p.requires_grad for p in model.parameters()):
        refused.append(_route(model, "", "has no trainable parameters"))
    return refused


def _dummy_batch(input_shape: Shape, num_classes: int) -> tuple[Tensor, Tensor]:
    """Public random inputs (a fixed seed: nothing private to protect) and every label."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, *input_shape, generator=generator)
    return x, torch.arange(BATCH) % num_classes


def _failure(model: nn.Module, what: str, error: Exception) -> Refusals:
    """The refusal names the exception's type only: its text is the model's code's, which may
    quote what that code can read; the operator finds it in the log."""
    log.warning("%s failed", what, exc_info=error)
    return [_route(model, "", f"{what} failed: {type(error).__name__} (see the operator's log)")]


@torch.no_grad()
def _outputs(model: nn.Module, x: Tensor, num_classes: int) -> Refusals:
    """Finite logits [B, K], the same twice, and each example's as when it is alone."""
    try:
        out = model(x)
    except Exception as error:
        return _failure(model, f"the forward pass on a batch {list(x.shape)}", error)
    expected = [len(x), num_classes]
    if not isinstance(out, Tensor) or list(out.shape) != expected:
        got = list(out.shape) if isinstance(out, Tensor) else type(out).__name__
        return [_route(model, "", f"output is {got}, expected logits {expected}")]
    if not out.is_floating_point() or not out.isfinite().all():
        return [_route(model, "", "output is not finite floating-point logits")]
    if not torch.allclose(model(x), out, rtol=1e-5, atol=1e-6):
        return [
            _route(model, "", "the same batch gave two different outputs: the forward is random")
        ]
    try:
        alone = torch.cat([model(x[i : i + 1]) for i in range(len(x))])
    except Exception as error:
        return _failure(model, "the forward pass on one example", error)
    if not torch.allclose(alone, out, rtol=RTOL, atol=RTOL * float(out.abs().max())):
        return [
            _route(
                model,
                "",
                "an example's output changes with the rest of the batch: some layer mixes the "
                "examples (batch statistics?)",
            )
        ]
    return []


def _gradients(
    model: nn.Module, x: Tensor, y: Tensor, per_sample: PerSamplePath
) -> tuple[list[LayerRoute], list[LayerRoute], Refusals]:
    """Run the job's clipper (one clipping group per parameter) and compare each parameter's
    per-sample norms and clipped sum with each example's own gradient; say which modules'
    parameters took which path."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    try:
        own = _own_gradients(model, x, y, names)
    except Exception as error:
        return [], [], _failure(model, "the backward pass of one example", error)
    own_norms = torch.stack([g.flatten(1).double().square().sum(1) for g in own.values()], 1).sqrt()
    if not own_norms.isfinite().all():
        return [], [], [_route(model, "", "gradients are not finite on a dummy batch")]
    threshold = float(own_norms.square().sum(1).sqrt().median()) or 1.0  # some get clipped
    coef_fn = coefficient_fn("abadi", threshold, len(names))
    with _CAPTURE, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        try:
            clipper = get_clipper(per_sample)
            norms, sums = clipper(model, _LOSS, x, y, [[n] for n in names], coef_fn)
        except Exception as error:
            return [], [], _failure(model, f"the {per_sample} per-sample path", error)
    fell_back = {
        w.message.module: w.message.reason for w in caught if isinstance(w.message, FallbackWarning)
    }
    refused = [
        _route(
            model,
            m,
            f"{r}: a batch of its input's leading size would be clipped by wrong "
            "per-sample norms; give it per-example inputs or set method.per_sample to 'general'",
        )
        for m, r in fell_back.items()
        if r == NOT_PER_SAMPLE
    ]
    coef = clip_factors(coef_fn, norms.double())  # the clipper's factors, of its norm bounds
    for m, name in enumerate(names):
        expected = torch.tensordot(coef[:, m].to(own[name].dtype), own[name], dims=1)
        if not (_bounds(norms[:, m], own_norms[:, m]) and _close(sums[name], expected)):
            refused.append(
                _route(
                    model,
                    name.rpartition(".")[0],
                    f"the {per_sample} path's per-sample gradient of {name!r} differs from each "
                    "example's own gradient: the layer mixes examples or is not called on a "
                    "per-sample batch",
                )
            )
    fast, general = _paths(model, per_sample, fell_back)
    return fast, general, refused


def _own_gradients(model: nn.Module, x: Tensor, y: Tensor, names: list[str]) -> dict[str, Tensor]:
    """Each example's gradient from a backward pass on that example alone, [B, *param]."""
    params = dict(model.named_parameters())
    rows: list[tuple[Tensor, ...]] = []
    for i in range(len(x)):
        loss = _LOSS(model(x[i : i + 1]), y[i : i + 1]).sum()
        grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
        rows.append(
            tuple(
                torch.zeros_like(params[n]) if g is None else g
                for n, g in zip(names, grads, strict=True)
            )
        )
    return {n: torch.stack([row[k] for row in rows]) for k, n in enumerate(names)}


def _bounds(norms: Tensor, own: Tensor) -> bool:
    """Whether the clipper's per-sample norms are upper bounds on the examples' own (float32:
    ``workers.dp.bounds``, within ``BOUND_MARGIN`` above them) up to ``RTOL``."""
    norms = norms.to(own.dtype)
    scale = float(own.abs().max()) if own.numel() else 0.0
    atol = RTOL * scale + 1e-12
    return bool(
        (norms >= own * (1 - RTOL) - atol).all() and (norms <= own * BOUND_MARGIN + atol).all()
    )


def _close(value: Tensor, expected: Tensor) -> bool:
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    return bool(
        torch.allclose(value.to(expected.dtype), expected, rtol=RTOL, atol=RTOL * scale + 1e-12)
    )


def _paths(
    model: nn.Module, per_sample: PerSamplePath, fell_back: dict[str, str]
) -> tuple[list[LayerRoute], list[LayerRoute]]:
    """The modules that own trainable parameters, split by the path their parameters took."""
    fast, general = [], []
    for name, module in model.named_modules():
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        if per_sample == "general":
            general.append(_route(model, name, "method.per_sample is 'general'"))
        elif name in fell_back:
            general.append(_route(model, name, fell_back[name]))
        else:
            fast.append(_route(model, name))
    return fast, general


def _changed_state(
    model: nn.Module, layout: dict[str, StateTensor], before: dict[str, Tensor]
) -> Refusals:
    """What of the state the model writes itself: an untrained tensor that changed, or an
    entry (a parameter too) that appeared or vanished since the model was built."""
    after = model.state_dict()
    verbs = (
        {n: "vanishes" for n in layout if n not in after}
        | {n: "changes" for n, t in before.items() if n in after and not _same(after[n], t)}
        | {n: "appears" for n in after if n not in layout}
    )
    return [
        _route(
            model,
            _owner(model, name),
            f"{_kind(model, name)} {name!r} {verb} in a training step: the model writes it, not "
            "the DP optimizer, so it may hold statistics of the data, and a release would reset "
            "it to its initial value",
        )
        for name, verb in verbs.items()
    ]


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _kind(model: nn.Module, name: str) -> str:
    if name in dict(model.named_buffers(remove_duplicate=False)):
        return "buffer"
    param = dict(model.named_parameters(remove_duplicate=False)).get(name)
    if param is None:
        return "state entry"
    return "parameter" if param.requires_grad else "frozen parameter"


def _owner(model: nn.Module, name: str) -> str:
    """The module an entry belongs to ("": the model, also for a name no module has now)."""
    module = name.rpartition(".")[0]
    return module if module in dict(model.named_modules()) else ""
