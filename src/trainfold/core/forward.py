"""A module as a function of its tensors: ``make_forward``, ``train_mode``, ``cache_off``; the step's type aliases."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = [
    "Batch",
    "Forward",
    "LossAux",
    "ModelInputsObjective",
    "Objective",
    "Tensors",
    "cache_configs",
    "cache_off",
    "make_forward",
    "train_mode",
    "training_flags",
]

Batch = Sequence[Mapping[str, Tensor]]
Forward = Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], Any]
# objective(forward, params, micro_batch, num_items_in_batch, key) -> (loss, aux)
# loss: the micro-batch's summed loss / num_items_in_batch (summed over micro-batches); aux: the micro-batch's
# means (the step's: their item-weighted mean), or, with objective.aux_reduction = "sum", normalised as the loss,
# or, with "micro_batch", the micro-batch's own values (averaged unweighted: core.losses.count_key)
Objective = Callable[
    [Forward, Mapping[str, Tensor], Mapping[str, Tensor], Tensor, torch.Generator], tuple[Tensor, Mapping[str, Tensor]]
]

Tensors = Mapping[str, Tensor]
LossAux = tuple[Tensor, dict[str, Tensor]]


class ModelInputsObjective:
    """An ``Objective`` that draws no randomness (``key`` unused) and whose model sees only ``model_keys`` of a
    micro-batch: calling it hands ``loss_of`` the forward, the parameters, those inputs, the whole micro-batch
    and the step's item count. The preference, GRPO, KTO and reward objectives are such."""

    __slots__ = ()
    model_keys: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask")

    def __call__(
        self,
        forward: Forward,
        params: Tensors,
        micro_batch: Tensors,
        num_items_in_batch: Tensor,
        key: torch.Generator | None = None,
    ) -> LossAux:
        inputs = {k: micro_batch[k] for k in self.model_keys if k in micro_batch}
        return self.loss_of(forward, params, inputs, micro_batch, num_items_in_batch)

    def loss_of(self, forward: Forward, params: Tensors, inputs: Tensors, micro: Tensors, n: Tensor) -> LossAux:
        """Return the micro-batch's loss over ``n`` (the step's items) and its aux metrics."""
        raise NotImplementedError


@contextlib.contextmanager
def train_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Set ``model.training`` for the duration, and restore every submodule's flag afterwards.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Dropout(0.5))
    >>> with train_mode(model, False):
    ...     inside = model[0].training
    >>> inside, model[0].training
    (False, True)
    """
    with training_flags(list(model.modules()), training):
        yield


@contextlib.contextmanager
def training_flags(modules: list[nn.Module], training: bool) -> Iterator[None]:
    flags = [m.training for m in modules]
    if all(f == training for f in flags):
        yield
        return
    try:
        modules[0].train(training)  # the root: modules that override train() see the call
        yield
    finally:
        for m, f in zip(modules, flags):
            m.training = f


def cache_configs(modules: Iterable[nn.Module]) -> list[Any]:
    """Return the distinct configs (transformers' ``module.config``) of ``modules`` that have a ``use_cache``.

    >>> import types, torch
    >>> lin = torch.nn.Linear(1, 1)
    >>> lin.config = types.SimpleNamespace(use_cache=True)
    >>> len(cache_configs([lin, torch.nn.Linear(1, 1)]))
    1
    """
    found = {id(c): c for m in modules if (c := m.__dict__.get("config")) is not None}  # blocks share one config
    return [c for c in found.values() if hasattr(c, "use_cache")]


@contextlib.contextmanager
def cache_off(configs: Sequence[Any]) -> Iterator[list[Any]]:
    """Set ``use_cache=False`` on ``configs`` (from :func:`cache_configs`) for the duration; yield those changed.

    Training never reads a KV cache; the step runs inside this scope with or without
    checkpointing, so both compute the same thing.

    >>> import types, torch
    >>> lin = torch.nn.Linear(1, 1)
    >>> lin.config = types.SimpleNamespace(use_cache=True)
    >>> with cache_off(cache_configs([lin])) as changed:
    ...     inside = lin.config.use_cache
    >>> inside, lin.config.use_cache, len(changed)
    (False, True, 1)
    """
    changed = [c for c in configs if getattr(c, "use_cache", None) is True]
    try:
        for config in changed:
            _set_use_cache(config, False)
        yield changed
    finally:
        for config in changed:
            _set_use_cache(config, True)


def _set_use_cache(config: Any, value: bool) -> None:
    # transformers' configs validate every setattr (about 10 us); a plain field is written directly.
    if "use_cache" in getattr(config, "__dict__", {}):
        config.__dict__["use_cache"] = value
    else:
        config.use_cache = value


def make_forward(model: nn.Module, buffers: Mapping[str, Tensor]) -> Forward:
    """Return ``forward(params, inputs)``: the model's forward pass on the given tensors.

    It runs in whatever mode the module is in (a fresh module trains: dropout on); wrap calls in
    ``train_mode(model, False)`` to evaluate, as ``evaluation.evaluate_batches`` does.

    >>> import torch
    >>> forward = make_forward(torch.nn.Linear(2, 1), {})
    >>> params = {"weight": torch.tensor([[1.0, 2.0]]), "bias": torch.tensor([0.5])}
    >>> forward(params, {"input": torch.tensor([[1.0, 1.0]])}).tolist()
    [[3.5]]
    """

    def forward(params: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> Any:
        trees = (_as_dict(params), _as_dict(buffers))
        return functional_call(model, trees, args=(), kwargs=dict(inputs), strict=True)

    return forward


def _as_dict(tree: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return ``tree`` itself when it is a dict (``functional_call`` takes only dicts), else a dict copy."""
    return tree if isinstance(tree, dict) else dict(tree)
