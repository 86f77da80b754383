"""The configuration a step closes over (``StepPlan``), built and checked once by ``step_plan``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, cast

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.collective import Collective
from trainfold.core.forward import Objective, cache_configs
from trainfold.core.losses import counter_for, default_loss_for
from trainfold.optim import GradientTransformation
from trainfold.step.amp import LossScaling
from trainfold.step.recompute import own_blocks, own_checkpointing, own_off, recomputing

__all__ = [
    "StepPlan",
    "collective_of",
    "default_counter",
    "is_fully_sharded",
    "refuse_data_parallel",
    "refuse_forward_regularizer",
    "refuse_sharded",
    "step_plan",
]


@attrs.frozen
class StepPlan:
    """The configuration a step closes over; every step variant (eager, compiled, differentiable) reads it.

    >>> import torch
    >>> from trainfold.optim import sgd
    >>> from trainfold.core.losses import cross_entropy
    >>> plan = step_plan(torch.nn.Linear(2, 1), cross_entropy, sgd(0.1))
    >>> plan.label_key, plan.recompute, plan.count_items({"labels": torch.tensor([0, -100, 1])}).item()
    ('labels', 0, 2)
    """

    model: nn.Module
    optimizer: GradientTransformation
    loss: Callable[..., Tensor]
    objective: Objective | None
    count_items: Callable[[Mapping[str, Tensor]], Tensor]
    label_key: str
    collective: Collective | None
    autocast: torch.dtype | None
    recompute: int = 0  # 0: off; n: checkpoint every n-th block
    loss_scaling: LossScaling | None = None
    cache_configs: tuple[Any, ...] = ()  # configs whose KV cache the step turns off (core.forward.cache_off)

    def autocast_scope(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """Return the ``torch.autocast`` scope of the forward pass (a no-op scope without ``autocast``)."""
        return (
            torch.autocast(device_type, dtype=self.autocast) if self.autocast is not None else contextlib.nullcontext()
        )

    def recompute_scope(self, modules: list[nn.Module]) -> contextlib.AbstractContextManager[Any]:
        """Return the activation-checkpointing scope of the step (``recompute.recomputing``; a no-op when off).

        A model whose own checkpointing is on (``model.gradient_checkpointing_enable()``) is checkpointed here
        instead, on the same blocks, with its own switched off for the step: see ``recompute.own_checkpointing``
        (a model without blocks to checkpoint then runs whole).
        """
        own = own_checkpointing(modules)
        if not (self.recompute or own):
            return contextlib.nullcontext()
        blocks = None if self.recompute else own_blocks(own, modules)
        if blocks == []:
            return own_off(own)
        every = self.recompute or 1
        return recomputing(self.model, blocks, every, modules=modules, configs=self.cache_configs, own=own)


def step_plan(
    model: nn.Module,
    loss: Callable[..., Tensor] | None = None,
    optimizer: GradientTransformation | None = None,
    *,
    objective: Objective | None = None,
    count_items: Callable[[Mapping[str, Tensor]], Tensor] | None = None,
    label_key: str = "labels",
    collective: Collective | None = None,
    autocast: torch.dtype | None = None,
    gradient_checkpointing: bool | int = False,
    loss_scaling: LossScaling | None = None,
) -> StepPlan:
    """Return the ``StepPlan`` of ``make_step``'s arguments (same names and defaults), refusing what cannot train.

    FSDP2 (``fully_shard``) modules are allowed: they step on a lent, donated state.
    """
    if optimizer is None:
        raise TypeError("make_step needs an optimizer, e.g. optimizer=trainfold.adamw(1e-3)")
    refuse_sharded(model, fully_shard=True)
    refuse_data_parallel(model)
    if collective is None:  # a fully_shard module sums its gradients over its mesh: count the items there too
        collective = collective_of(model)
    if objective is None:
        refuse_forward_regularizer(model)
    elif (reduction := getattr(objective, "aux_reduction", "mean")) not in ("mean", "sum", "micro_batch"):
        raise ValueError(
            f"objective.aux_reduction is {reduction!r}; set 'mean' (its aux are each micro-batch's "
            "means: the step logs their mean weighted by items), 'micro_batch' (each micro-batch's own values: the "
            "logs average them over the micro-batches, unweighted, as TRL's) or 'sum' (they are divided by "
            "num_items_in_batch, as the loss: the step sums them)"
        )
    if loss is None:
        loss = default_loss_for(model, defer=objective is not None)
    return StepPlan(
        model=model,
        optimizer=optimizer,
        loss=loss,
        objective=objective,
        count_items=count_items or default_counter(loss, objective, label_key),
        label_key=label_key,
        collective=collective,
        autocast=autocast,
        recompute=int(gradient_checkpointing),
        loss_scaling=loss_scaling,
        cache_configs=tuple(cache_configs(model.modules())),
    )


def collective_of(model: nn.Module) -> Collective | None:
    """Return the collective of the process group an FSDP2 (``fully_shard``) ``model`` is sharded over, when it
    spans several ranks; else None.

    FSDP sums the ranks' gradients, so a step without ``collective=`` must count ``num_items_in_batch`` over the
    same ranks: counted on each rank alone, the gradients came out world-size times too large.

    >>> collective_of(torch.nn.Linear(2, 2)) is None
    True
    """
    import torch.distributed as dist

    if not (is_fully_sharded(model) and dist.is_available() and dist.is_initialized()):
        return None
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    if mesh is None:
        return None
    group = mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD
    if mesh.ndim != 1 and mesh.size() != dist.get_world_size():
        raise ValueError(
            f"{type(model).__name__} is sharded over a {mesh.ndim}-D mesh of {mesh.size()} of the "
            f"{dist.get_world_size()} ranks: pass make_step(collective=...) over the ranks that share its batch "
            "(trainfold.distributed.distributed.process_group_collective(group))"
        )
    if dist.get_world_size(group) < 2:
        return None
    from trainfold.distributed.distributed import process_group_collective

    return cast(Collective, process_group_collective(group))  # frozen attrs: its rank reads as the protocol's


def refuse_data_parallel(model: nn.Module) -> None:
    """Raise ``TypeError`` for a module the user wrapped with ``DistributedDataParallel``: DDP averages the ranks'
    gradients, while the step divides each loss by the item count of every rank (or, without a collective, of its
    own): the gradients would be the one-process ones divided by the world size (or mixed per-rank means).

    >>> refuse_data_parallel(torch.nn.Linear(2, 2)) is None
    True
    """
    for name, module in model.named_modules():
        if any(c.__name__ == "DistributedDataParallel" for c in type(module).__mro__):
            where = f"its submodule {name!r} is" if name else "it is"
            raise TypeError(
                f"cannot train {type(model).__name__}: {where} wrapped with DistributedDataParallel, which averages "
                "the ranks' gradients while trainfold's loss is already divided by the items of all ranks; pass the "
                "module it wraps (ddp.module) with make_step(..., collective=trainfold.distributed.distributed."
                "process_group_collective()) and step a lent, donated state (init_state(module, optimizer, "
                "copy=False); step(state, batch, donate=True)): trainfold runs it under DistributedDataParallel "
                "itself, summing the gradients (train(...) under torchrun does all this)"
            )


def refuse_forward_regularizer(model: nn.Module) -> None:
    """Raise ``ValueError`` for a model whose forward adds a term to ``outputs.loss``: a PEFT AdaLoRA adapter's
    orthogonal regularizer, a mixture of experts' router loss (``config.output_router_logits``).

    The step's loss is computed from the outputs without ``labels`` reaching the model, so that term (which
    ``transformers.Trainer`` trains with) would be dropped without a word.

    >>> refuse_forward_regularizer(torch.nn.Linear(2, 1)) is None
    True
    """
    config: Any = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False) is True and getattr(config, "router_aux_loss_coef", None):
        raise ValueError(
            f"{type(model).__name__} has config.output_router_logits=True: its forward adds router_aux_loss_coef "
            f"({config.router_aux_loss_coef}) times the experts' load-balancing loss to outputs.loss, which the step "
            "does not use (the loss comes from the logits), so it would be silently dropped; set "
            "config.output_router_logits=False, or pass an objective that adds outputs.aux_loss"
        )
    configs = getattr(model, "peft_config", None)
    for name, config in configs.items() if isinstance(configs, Mapping) else ():
        if getattr(config, "orth_reg_weight", 0) and str(getattr(config, "peft_type", "")).endswith("ADALORA"):
            raise ValueError(
                f"the AdaLoRA adapter {name!r} has orth_reg_weight={config.orth_reg_weight}: its forward adds that "
                "regularizer to outputs.loss, which the step does not use (the loss comes from the logits), so it "
                "would be silently dropped; set AdaLoraConfig(orth_reg_weight=0.0), or pass an objective that "
                "adds it (peft computes it when labels reach the forward)"
            )


def default_counter(
    loss: Callable[..., Tensor], objective: Any, label_key: str
) -> Callable[[Mapping[str, Tensor]], Tensor]:
    """Return how a step counts a micro-batch's items: the objective's ``count_items``, else the loss's count of
    the labels, else (no labels) its rows.

    >>> import torch
    >>> from trainfold.core.losses import causal_lm
    >>> count = default_counter(causal_lm, None, "labels")
    >>> count({"labels": torch.tensor([[5, 6, -100]])}).item(), count({"x": torch.ones(3, 2)}).item()
    (1, 3)
    """
    if objective is not None and hasattr(objective, "count_items"):
        return objective.count_items
    count_labels = counter_for(loss)

    def count(micro: Mapping[str, Tensor]) -> Tensor:
        if label_key in micro:
            return count_labels(micro[label_key])
        first = next(iter(micro.values()))
        return torch.tensor(first.shape[0])

    return count


def _sharded_kind(cls: type) -> str | None:
    names = {c.__name__ for c in cls.__mro__}
    if "FSDPModule" in names:
        return "an FSDP2 module (torch.distributed.fsdp.fully_shard)"
    if "FullyShardedDataParallel" in names:
        return "an FSDP module (FullyShardedDataParallel)"
    return None


def is_fully_sharded(model: nn.Module) -> bool:
    """Say whether ``model`` (or a submodule) was wrapped with FSDP2's ``fully_shard``.

    >>> is_fully_sharded(torch.nn.Linear(2, 2))
    False
    """
    return any(any(c.__name__ == "FSDPModule" for c in type(m).__mro__) for m in model.modules())


def refuse_sharded(model: nn.Module, fully_shard: bool = False) -> None:
    """Raise ``TypeError`` when ``model`` is FSDP-wrapped or holds DTensor parameters.

    ``fully_shard`` allows FSDP2 modules (``torch.distributed.fsdp.fully_shard``): the eager step
    runs them as they are on a lent, donated state (``init_state(model, optimizer, copy=False)``),
    their params the state's DTensor shards. Everything else that keeps its parameters elsewhere
    (FSDP1, DTensor parameters without FSDP2) would see no gradient, so it is refused.

    >>> import torch
    >>> refuse_sharded(torch.nn.Linear(2, 2)) is None
    True
    """
    fix = (
        "wrap the module with torch.distributed.fsdp.fully_shard (FSDP2, per block then the root) and step a "
        "lent state (init_state(model, optimizer, copy=False), donated), or pass the unwrapped module with "
        "TrainingArguments(fsdp='full_shard') under torchrun"
    )
    fsdp2 = fully_shard and is_fully_sharded(model)
    for name, module in model.named_modules():
        kind = _sharded_kind(type(module))
        if kind is not None and not (fsdp2 and "FSDP2" in kind):
            where = f"its submodule {name!r}" if name else "it"
            raise TypeError(f"cannot train {type(model).__name__}: {where} is {kind}; {fix}")
    for name, p in [] if fsdp2 else model.named_parameters():
        if any(c.__name__ == "DTensor" for c in type(p).__mro__):
            raise TypeError(
                f"cannot train {type(model).__name__}: parameter {name!r} is a DTensor "
                "(sharded by torch.distributed.tensor); " + fix
            )
