"""The training state: one immutable record that a checkpoint snapshots and a resume restores.

>>> import torch
>>> from trainfold.optim import sgd
>>> state = init_state(torch.nn.Linear(2, 1), sgd(0.1), seed=3)
>>> sorted(state.params), state.step.item(), state.seed.item()
(['bias', 'weight'], 0, 3)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.rng import derive_seed
from trainfold.core.tree import check_keys, register_record

__all__ = [
    "Cursor",
    "SAMPLES",
    "sample_certificate",
    "TrainState",
    "init_state",
    "scalar",
    "METRIC_KEYS",
    "DonatedStateError",
    "invalidate",
    "is_donated",
    "check_live",
    "lend",
    "counters",
    "refuse_vmapped",
    "with_aliases",
]

# What every step reports about itself; present from the first state so the record's
# structure never changes (a checkpoint loads into the template of a fresh state).
METRIC_KEYS = ("loss", "grad_norm", "learning_rate", "num_items")


def scalar(value: float | int, dtype: torch.dtype = torch.int64) -> Tensor:
    """Return a 0-d CPU tensor: the form counters take in a state record.

    >>> scalar(5).dtype, scalar(0.5, torch.float64).item()
    (torch.int64, 0.5)
    """
    return torch.tensor(value, dtype=dtype)


def initial_metrics() -> dict[str, Tensor]:
    """Return the metrics of a state before its first step (zeros; the learning rate in float64)."""
    return {k: scalar(0.0, torch.float64 if k == "learning_rate" else torch.float32) for k in METRIC_KEYS}


@register_record
@attrs.frozen(eq=False)
class Cursor:
    """Where the data stream stands: the epoch, and optimizer steps consumed within it.

    ``streams`` is ``None`` except for a streaming source (``trainfold.data.files``): then an int64
    tensor of shape ``(sources, 2)``, each row a source's absolute row position (before filters) and
    its fingerprint, so a resume seeks each source to where it stood and refuses changed shards.

    >>> Cursor().as_tuple(), Cursor(epoch=scalar(1), position=scalar(4)).as_tuple()
    ((0, 0), (1, 4))
    """

    epoch: Tensor = attrs.field(factory=lambda: scalar(0))
    position: Tensor = attrs.field(factory=lambda: scalar(0))
    streams: Tensor | None = None

    def as_tuple(self) -> tuple[int, int]:
        """Return ``(epoch, position)`` as Python ints.

        >>> Cursor(scalar(2), scalar(5)).as_tuple()
        (2, 5)
        """
        return int(self.epoch), int(self.position)


SAMPLES = derive_seed(int.from_bytes(b"samples", "big"))  # marks the cursor's row holding the sample certificate


def sample_certificate(cursor: Cursor) -> int | None:
    """Return the cursor's rolling hash of every step's sample ids so far (``None``: a cursor without one).

    Written by a streaming source (``trainfold.data.mixture``) in the cursor's last row, marked ``SAMPLES``.
    Step ``k``'s value is ``roll(value at k - 1, the ids of step k's rows in batch order)``: two runs' values
    first differ at the first step whose samples differ (a row's id names its shard's contents and its row
    there, so a changed shard shows at the first step that reads it).
    """
    streams = cursor.streams
    if streams is None or not len(streams) or int(streams[-1, 1]) != SAMPLES:
        return None
    return int(streams[-1, 0])


@register_record
@attrs.frozen(eq=False)
class TrainState:
    """Everything that changes during training, and nothing that configures it.

    ``params`` are the trainable tensors; ``buffers`` the module buffers and frozen parameters.
    ``step`` counts optimizer updates done. ``metrics`` holds what the last step reports
    (``loss``, pre-clip ``grad_norm``, ``learning_rate``, ``num_items``) as 0-d tensors,
    ``loss_total`` the float64 sum of all finite step losses, so any logging window's mean is exact,
    and ``nonfinite_losses`` the count of steps whose loss was inf or NaN (left out of the sum, so
    one overflowing float16 step does not turn every later window's mean into inf).
    ``extras`` carries named records owned by higher layers (logging marks, best-model and
    early-stopping counters) so they survive a resume.

    >>> import torch
    >>> s = TrainState(params={"w": torch.zeros(2)}, buffers={}, opt_state=None)
    >>> s.step.item(), s.cursor.as_tuple(), sorted(s.metrics)
    (0, (0, 0), ['grad_norm', 'learning_rate', 'loss', 'num_items'])
    """

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    opt_state: Any
    step: Tensor = attrs.field(factory=lambda: scalar(0))
    seed: Tensor = attrs.field(factory=lambda: scalar(0))
    cursor: Cursor = attrs.field(factory=Cursor)
    metrics: dict[str, Tensor] = attrs.field(factory=lambda: initial_metrics())
    loss_total: Tensor = attrs.field(factory=lambda: scalar(0.0, torch.float64))
    nonfinite_losses: Tensor = attrs.field(factory=lambda: scalar(0))
    extras: dict[str, Any] = attrs.field(factory=dict)


def refuse_vmapped(state: TrainState) -> None:
    """Raise ``TypeError`` when ``state`` is being traced by ``torch.func.vmap`` (a step cannot run batched).

    A step reads its counters as Python numbers (the step and seed choose the dropout draws, an empty
    step is skipped), which a vmapped tensor cannot give. ``make_ensemble_step`` is the batched step.

    >>> refuse_vmapped(TrainState(params={"w": torch.zeros(2)}, buffers={}, opt_state=None)) is None
    True
    """
    is_batched = torch._C._functorch.is_batchedtensor
    if isinstance(state.step, Tensor) and is_batched(state.step):
        raise TypeError(
            "a trainfold step cannot run under torch.func.vmap: it reads the state's step and seed as Python "
            "numbers (they choose each micro-batch's random draws) and skips steps without items, which a "
            "vmapped state cannot give. To train K stacked states in one step use "
            "trainfold.make_ensemble_step(model, loss, optimizer) on trainfold.init_ensemble_state(...) (it vmaps "
            "the forward pass over the members' params); to vmap your own function, map over state.params"
        )


# -- donation ---------------------------------------------------------------------------------------

_DONATED = ("params", "buffers", "opt_state")  # what a donating step updates in place


class DonatedStateError(RuntimeError):
    """A ``TrainState`` was used after it was donated to a step (its tensors were updated in place).

    >>> issubclass(DonatedStateError, RuntimeError)
    True
    """


class _Donated:
    """Stands in a donated state's ``params``, ``buffers`` and ``opt_state``: any use raises."""

    __slots__ = ("_field", "_step")

    def __init__(self, field: str, step: int) -> None:
        object.__setattr__(self, "_field", field)
        object.__setattr__(self, "_step", step)

    def _refuse(self, *positional: Any, **kwargs: Any) -> Any:
        raise DonatedStateError(
            f"this TrainState was donated to step {self._step}: its {self._field} were updated in place and now "
            "belong to the state that step returned; use the state the step returned (or call the step with "
            "donate=False to keep this one)"
        )

    def __getattr__(self, name: str) -> Any:
        return self._refuse()

    __getitem__ = __iter__ = __len__ = __contains__ = __bool__ = __setattr__ = _refuse

    def __repr__(self) -> str:
        return f"<{self._field} donated to step {self._step}>"


def invalidate(state: TrainState, step: int | None = None) -> None:
    """Mark ``state`` donated (to ``step``, default its own step + 1): its params, buffers and optimizer state raise.

    A donating step calls this on the state it was given; counters, cursor, metrics and extras stay readable
    (the step does not change them in place).

    >>> s = TrainState(params={"w": torch.zeros(1)}, buffers={}, opt_state=None)
    >>> invalidate(s)
    >>> is_donated(s), s.step.item()
    (True, 0)
    >>> s.params["w"]
    Traceback (most recent call last):
    ...
    trainfold.core.state.DonatedStateError: this TrainState was donated to step 1: its params were updated in place ...
    """
    n = int(state.step) + 1 if step is None else step
    for name in _DONATED:
        if not isinstance(getattr(state, name), _Donated):
            object.__setattr__(state, name, _Donated(name, n))  # the record is frozen to everyone else


def is_donated(state: Any) -> bool:
    """Say whether ``state`` was donated to a step (and so must not be used).

    >>> is_donated(TrainState(params={}, buffers={}, opt_state=None))
    False
    """
    return any(isinstance(getattr(state, name, None), _Donated) for name in _DONATED)


def check_live(state: Any) -> None:
    """Raise ``DonatedStateError`` if ``state`` was donated (before a step reads anything from it)."""
    for name in _DONATED:
        value = getattr(state, name, None)
        if isinstance(value, _Donated):
            value._refuse()


def resharded(model: nn.Module) -> nn.Module:
    """Put every FSDP2 module of ``model`` back on its shards (``FSDPModule.reshard``) and return ``model``.

    After a forward without backward (evaluation), the root of a ``fully_shard`` model keeps its
    parameters gathered (torch's default for the root); its registered parameters are then the
    gathered tensors, not the DTensor shards a lent state holds. Other modules are left as they are.

    >>> import torch
    >>> lin = torch.nn.Linear(2, 1)
    >>> resharded(lin) is lin
    True
    """
    for module in model.modules():
        if any(c.__name__ == "FSDPModule" for c in type(module).__mro__):
            module.reshard()  # type: ignore[operator]  # FSDPModule.reshard (torch.distributed.fsdp)
    return model


def split_module(model: nn.Module, *, copy: bool = True) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Return ``(params, buffers)`` of ``model`` as detached copies (``copy=False``: the module's own tensors).

    Trainable parameters go to ``params``; frozen parameters and buffers to ``buffers``. Tied
    parameters appear once, under their first name.

    >>> import torch
    >>> m = torch.nn.BatchNorm1d(2)
    >>> p, b = split_module(m)
    >>> sorted(p), sorted(b)
    (['bias', 'weight'], ['num_batches_tracked', 'running_mean', 'running_var'])
    """
    params: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    resharded(model)
    for name, p in model.named_parameters():
        (params if p.requires_grad else buffers)[name] = p.detach().clone() if copy else p
    for name, b in model.named_buffers():
        buffers[name] = b.detach().clone() if copy else b
    return params, buffers


def with_aliases(model: nn.Module, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return ``weights`` (``model``'s ``state_dict`` names, a shared tensor once) with each other name of a shared
    tensor bound to the same tensor.

    A tensor several modules hold (VeRA's shared projections, tied embeddings) has a ``state_dict`` name
    in each; the state keeps it once, under the first, while ``peft`` looks it up under another.

    >>> lin = torch.nn.Linear(1, 1)
    >>> sorted(with_aliases(torch.nn.Sequential(lin, lin), {"0.weight": torch.zeros(1, 1)}))
    ['0.weight', '1.weight']
    """
    first: dict[int, str] = {}
    names = {k: first.setdefault(id(v), k) for k, v in model.state_dict(keep_vars=True).items()}
    return {**weights, **{k: weights[f] for k, f in names.items() if f in weights}}


def init_state(
    model: nn.Module,
    optimizer: Any,
    *,
    seed: int = 0,
    extras: Mapping[str, Any] | None = None,
    params: Mapping[str, Tensor] | None = None,
    copy: bool = True,
) -> TrainState:
    """Return the first state of a run: copies of the model's tensors and a fresh optimizer state.

    ``params`` starts from other trainable tensors than the model's own (e.g. an SFT result before
    DPO); they must have the model's parameter names. The model itself is never changed here.
    ``copy=False`` *lends* the model to the state: its params are the module's own ``Parameter``
    objects (and its buffers the module's buffers), one copy of the weights. A step that never
    donates leaves them alone; a *donating* step (``fit``, ``step(state, batch, donate=True)``) runs
    the module as it is, gradients arriving in ``.grad`` through ``backward``, and updates the
    Parameters in place, as ``train`` does (so torch's engines, DDP and ``fully_shard``, work unchanged).

    >>> import torch
    >>> from trainfold.optim import sgd
    >>> lin = torch.nn.Linear(2, 1)
    >>> init_state(lin, sgd(0.1), copy=False).params["weight"] is lin.weight
    True

    >>> s = init_state(
    ...     torch.nn.Linear(2, 1), sgd(0.1), seed=7, params={"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
    ... )
    >>> s.params["weight"].tolist(), s.seed.item(), s.step.item()
    ([[1.0, 1.0]], 7, 0)
    """
    own, buffers = split_module(model, copy=copy)
    if params is not None:
        check_keys(params, own, "params", f"{type(model).__name__}'s trainable parameters")
        own = {k: v.detach().clone() for k, v in params.items()}
    params = own
    if not params:
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters: every parameter has "
            "requires_grad=False; unfreeze at least one parameter to train it"
        )
    return TrainState(
        params=params,
        buffers=buffers,
        opt_state=optimizer.init(params),
        seed=scalar(seed),
        extras=dict(extras or {}),
    )


def lend(model: nn.Module, state: TrainState) -> TrainState:
    """Return ``state`` holding ``model``'s own tensors (its ``Parameter`` objects): each value is copied into them.

    After a checkpoint is loaded (fresh tensors), this puts the run back on one copy of the weights:
    a donating step then trains the module's storage. Tensors the module keeps on another device,
    dtype or shape stay the state's own.

    >>> import torch
    >>> from trainfold.optim import sgd
    >>> lin = torch.nn.Linear(2, 1)
    >>> s = init_state(torch.nn.Linear(2, 1), sgd(0.1))
    >>> lent = lend(lin, s)
    >>> lent.params["weight"] is lin.weight, torch.equal(lin.weight, s.params["weight"])
    (True, True)
    """
    own = {**dict(model.named_buffers()), **dict(model.named_parameters())}

    def lent(tree: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {}
        for name, value in tree.items():
            target = own.get(name)
            placement = (value.device, value.dtype, value.shape)
            if target is None or (target.device, target.dtype, target.shape) != placement:
                out[name] = value
                continue
            if target.data_ptr() != value.data_ptr():
                with torch.no_grad():
                    target.copy_(value)
            out[name] = target
        return out

    return attrs.evolve(state, params=lent(state.params), buffers=lent(state.buffers))


def counters(state: TrainState) -> TrainState:
    """Return a record of ``state``'s step, loss total and non-finite count only: no params, no optimizer state.

    What a run keeps of its start for its summary, so that no second copy of the weights stays alive.

    >>> s = counters(TrainState(params={"w": torch.zeros(3)}, buffers={}, opt_state=None, step=scalar(4)))
    >>> s.params, s.step.item()
    ({}, 4)
    """
    return TrainState(
        params={},
        buffers={},
        opt_state=None,
        step=state.step,
        seed=state.seed,
        cursor=state.cursor,
        loss_total=state.loss_total,
        nonfinite_losses=state.nonfinite_losses,
    )
