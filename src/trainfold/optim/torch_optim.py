"""``from_torch``: any ``torch.optim.Optimizer`` as a gradient transformation whose state lives in the ``TrainState``.

torch's optimizers keep their per-parameter state in ``optimizer.state[param]``, created lazily by
their first ``step``. Here that state is a record of tensors (``TorchOptState``) that travels in
the ``TrainState`` and checkpoints like every other tensor (no pickle): each update hands it to a
torch optimizer, lets torch's own ``step`` run, and takes it back. The record's shape is known at
``init`` (a dry ``step`` on meta tensors, or on zeros where an optimizer cannot run on meta);
``started`` says whether torch has initialised it yet, so the first update is torch's own first step.

>>> import torch
>>> opt = from_torch(torch.optim.Adagrad, lr=0.5)
>>> p = {"w": torch.tensor([1.0, 2.0])}
>>> new, state = opt.apply({"w": torch.tensor([1.0, -1.0])}, opt.init(p), p)
>>> new["w"].tolist(), sorted(state.slots["w"]), state.count.item()
([0.5, 2.5], ['step', 'sum'], 1)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from trainfold.core.tree import Tree, check_keys
from trainfold.optim.masks import Mask, resolve_mask
from trainfold.optim.schedules import as_schedule
from trainfold.optim.transform import GradientTransformation, overwrite

__all__ = ["TorchOptState", "TorchOptimizer", "TorchEngine", "from_torch"]


@attrs.frozen(eq=False)
class TorchOptState:
    """A torch optimizer's state as tensors: ``slots[param][key]``, the update count, and whether torch started it."""

    count: Tensor
    started: Tensor
    slots: dict[str, dict[str, Tensor]]


@attrs.define(eq=False)
class TorchEngine:
    """The torch side of a ``TorchOptimizer``: a declared, mutable holder, never a setting and never checkpointed.

    It keeps the ``torch.optim.Optimizer`` that donated updates step, reused while the same tensors
    are lent (``key``: their ids; ``params`` keeps them alive so the ids stay theirs), and ``kinds``:
    the state entries torch keeps as Python numbers (a ``step`` count as ``int``...), stored as
    float64 tensors in ``TorchOptState`` and handed back to torch as their type. All of it is
    rebuilt from the params: a new optimizer when other tensors are lent, the kinds by a dry step
    when a state reaches an engine that has not learnt them (a ``TorchOptimizer`` made afresh).
    """

    key: tuple[int, ...] | None = None
    optimizer: torch.optim.Optimizer | None = None
    params: list[Tensor] = attrs.Factory(list)
    kinds: dict[tuple[str, str], type] = attrs.Factory(dict)
    learnt: bool = False  # whether kinds holds what torch's first step makes

    def lent(self, params: Tree, build: Callable[[], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """Return the optimizer over ``params`` (the lent tensors), built anew when they are other tensors."""
        key = tuple(id(p) for p in params.values())
        if self.optimizer is None or self.key != key:
            self.key, self.optimizer, self.params = key, build(), list(params.values())
        return self.optimizer


@attrs.frozen(eq=False)
class TorchOptimizer(GradientTransformation):
    """``cls(params, **hyperparams)`` run as a transformation (``from_torch`` builds it).

    ``lr`` may be a schedule (``step -> rate``), read at each update's count. ``mask`` picks the
    params that get ``weight_decay`` (the rest: a second param group without it, as HF's Trainer).
    """

    cls: type[torch.optim.Optimizer]
    hyperparams: Mapping[str, Any]
    mask: Mask | None = None
    # the torch side, declared as what it is: a mutable holder of the live optimizer (see TorchEngine)
    engine: TorchEngine = attrs.field(factory=TorchEngine, repr=False, init=False)

    @property
    def name(self) -> str:  # type: ignore[override]
        """``cls``'s name, for error messages."""
        return self.cls.__name__

    def init(self, params: Tree) -> TorchOptState:
        """Return the state before the first update: torch's state keys, shapes and dtypes, as placeholders."""
        slots = {}
        self.engine.learnt = True  # the dry step below tells the kinds
        for name, shaped in self._dry_state(params).items():
            kept = {k: self._placeholder(name, k, v, params[name]) for k, v in shaped.items() if v is not None}
            if kept:
                slots[name] = kept
        zero = torch.zeros((), dtype=torch.int64)
        return TorchOptState(count=zero, started=torch.zeros((), dtype=torch.bool), slots=slots)

    def learning_rate(self, state: Any) -> float:
        rate = self._rate(int(state.count))
        return float("nan") if rate is None else rate

    def _rate(self, count: int) -> float | None:
        lr = self.hyperparams.get("lr")
        return None if lr is None or isinstance(lr, Tensor) else float(as_schedule(lr)(count))

    def update(self, grads: Tree, state: Any, params: Tree) -> tuple[Tree, Any]:
        new_params, new_state = self.apply(grads, state, params)
        return {k: new_params[k] - params[k] for k in params}, new_state

    def apply(self, grads: Tree, state: Any, params: Tree, *, donate: bool = False) -> tuple[Tree, Any]:
        check_keys(grads, params, "grads", "params")
        if bool(state.started) and not self.engine.learnt:  # a state this engine has not seen made: learn the kinds
            self._dry_state(params)
            self.engine.learnt = True
        if donate:  # torch steps the given tensors (the module's Parameters, when lent) and the state in place
            return self._step(params, grads, state, self._lent_engine(params))
        fresh = {k: v.detach().clone() for k, v in params.items()}
        copied = attrs.evolve(state, slots={n: {k: t.clone() for k, t in s.items()} for n, s in state.slots.items()})
        return self._step(fresh, grads, copied, self._new_engine(list(fresh.items())))

    # -- running torch's step --------------------------------------------------------------------------------

    def _step(
        self, params: Tree, grads: Tree, state: TorchOptState, engine: torch.optim.Optimizer
    ) -> tuple[Tree, TorchOptState]:
        order = engine._trainfold_order  # type: ignore[attr-defined]
        named = dict(zip(order, [p for group in engine.param_groups for p in group["params"]]))
        started = bool(state.started)
        for name, p in named.items():
            engine.state[p] = self._torch_state(name, state.slots.get(name, {})) if started else {}
            p.grad = grads[name].to(p.dtype)
        rate = self._rate(int(state.count))
        for group in engine.param_groups:
            if rate is not None:
                group["lr"] = rate
        with torch.no_grad():
            engine.step()
        slots = {}
        for name, p in named.items():
            stored = self._stored(name, engine.state.pop(p, {}))
            if stored:
                slots[name] = overwrite(state.slots.get(name, {}), stored)
            p.grad = None
        new = TorchOptState(count=state.count + 1, started=torch.ones((), dtype=torch.bool), slots=slots)
        return dict(params), new

    def _groups(self, named: list[tuple[str, Tensor]]) -> list[dict[str, Any]]:
        options = dict(self.hyperparams)
        if callable(options.get("lr")):
            options["lr"] = self._rate(0)
        if self.mask is None or not options.get("weight_decay"):
            return [{"params": [p for _, p in named], **options}]
        decayed = resolve_mask(self.mask, dict(named))
        on = [p for n, p in named if decayed.get(n, False)]
        off = [p for n, p in named if not decayed.get(n, False)]
        return [g for g in ({"params": on, **options}, {"params": off, **options, "weight_decay": 0.0}) if g["params"]]

    def _new_engine(self, named: list[tuple[str, Tensor]]) -> torch.optim.Optimizer:
        ordered = self._ordered(named)
        # a subclass takes its defaults as keywords; the stubs give type[Optimizer] the base's (params, defaults)
        engine = self.cls(self._groups(ordered))  # type: ignore[call-arg]
        engine._trainfold_order = [n for n, _ in ordered]  # type: ignore[attr-defined]
        return engine

    def _ordered(self, named: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
        """Return ``named`` in the order of the param groups (decayed first), so that names map to group params."""
        if self.mask is None or not self.hyperparams.get("weight_decay"):
            return named
        decayed = resolve_mask(self.mask, dict(named))
        return [x for x in named if decayed.get(x[0], False)] + [x for x in named if not decayed.get(x[0], False)]

    def _lent_engine(self, params: Tree) -> torch.optim.Optimizer:
        return self.engine.lent(params, lambda: self._new_engine(list(params.items())))

    # -- torch's state <-> tensors ---------------------------------------------------------------------------

    def _dry_state(self, params: Tree) -> dict[str, dict[str, Any]]:
        """Return the state torch's first step makes for ``params`` (run on meta tensors, else on zeros)."""
        for device in ("meta", None):
            try:
                return self._dry_run(params, device)
            except (RuntimeError, NotImplementedError):
                if device is None:
                    raise
        raise AssertionError("unreachable")

    def _dry_run(self, params: Tree, device: str | None) -> dict[str, dict[str, Any]]:
        named = [
            (k, torch.zeros(v.shape, dtype=v.dtype, device=device or v.device).requires_grad_())
            for k, v in params.items()
        ]
        engine = self._new_engine(named)
        for _, p in named:
            p.grad = torch.zeros_like(p)
        engine.step()
        by_id = {id(p): n for n, p in named}
        dry = {by_id[id(p)]: dict(s) for p, s in engine.state.items()}
        for name, entries in dry.items():
            self.engine.kinds.update(
                {(name, k): type(v) for k, v in entries.items() if not isinstance(v, (Tensor, type(None)))}
            )
        return dry

    def _placeholder(self, name: str, key: str, value: Any, param: Tensor) -> Tensor:
        if not isinstance(value, Tensor):
            return torch.zeros((), dtype=torch.float64)
        device = param.device if value.device.type == "meta" else value.device
        return torch.zeros(value.shape, dtype=value.dtype, device=device)

    def _torch_state(self, name: str, slots: Mapping[str, Tensor]) -> dict[str, Any]:
        kinds = self.engine.kinds
        return {k: kinds[(name, k)](v.item()) if (name, k) in kinds else v for k, v in slots.items()}

    def _stored(self, name: str, torch_state: Mapping[str, Any]) -> dict[str, Tensor]:
        out = {}
        for k, v in torch_state.items():
            if v is None:
                continue
            out[k] = v if isinstance(v, Tensor) else torch.tensor(float(v), dtype=torch.float64)
            if not isinstance(v, Tensor):
                self.engine.kinds[(name, k)] = type(v)
        return out


def from_torch(cls: type[torch.optim.Optimizer], *, mask: Mask | None = None, **hyperparams: Any) -> TorchOptimizer:
    """Return ``cls`` (any ``torch.optim.Optimizer``) as a transformation; its state lives in the ``TrainState``.

    ``hyperparams`` are ``cls``'s keyword arguments; ``lr`` may be a schedule (``step -> rate``).
    ``mask`` (``{name: bool}`` or a function of the params) limits ``weight_decay`` to the params it
    marks True. Updates run torch's own ``step`` (bitwise torch's results); the state checkpoints as
    tensors and resumes bitwise. A donated state is stepped in place (the module's Parameters when lent).

    >>> import torch
    >>> opt = from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)
    >>> p = {"w": torch.tensor([1.0])}
    >>> state = opt.init(p)
    >>> for _ in range(2):
    ...     p, state = opt.apply({"w": torch.tensor([1.0])}, state, p)
    >>> round(p["w"].item(), 4), round(state.slots["w"]["momentum_buffer"].item(), 4)
    (0.71, 1.9)
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"from_torch needs a torch.optim.Optimizer class, e.g. torch.optim.Adagrad; got {cls!r}")
    return TorchOptimizer(cls, dict(hyperparams), mask)
