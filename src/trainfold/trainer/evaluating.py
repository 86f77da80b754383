"""Evaluation in the HF driver: a run's eval sets and schedule (``EvalPlan``), and ``evaluate``/``predict``.

>>> from trainfold.trainer.args import TrainingArguments
>>> plan = eval_plan_for(TrainingArguments(eval_strategy="steps", eval_steps=2), [{"x": 1}] * 4, list,
...                      total_steps=6, loss=None)
>>> [s.prefix for s in plan.sets], [s for s in range(1, 7) if plan.due(s, total_steps=6, steps_per_epoch=6)]
(['eval'], [2, 4, 6])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, cast

import attrs
import torch
from torch import nn

from trainfold.core.collective import Collective
from trainfold.core.forward import training_flags
from trainfold.core.losses import default_loss_for
from trainfold.core.state import TrainState, resharded, split_module
from trainfold.data import close_loader, eval_loader
from trainfold.data.collate import collate_for, model_pad_collate
from trainfold.data.columns import eval_collate, padded_to_multiple
from trainfold.distributed import GatherCollective, shard
from trainfold.evaluation.evaluation import evaluate_batches, predict_batches
from trainfold.evaluation.metrics import eval_sets
from trainfold.evaluation.schedule import check_eval_schedule, should_evaluate
from trainfold.step.plan import is_fully_sharded
from trainfold.trainer.args import GivenArguments, TrainingArguments
from trainfold.trainer.inputs import columns_of, device_for, eval_labels, own_loss_objective
from trainfold.trainer.validate import refusing_trainer_keywords, trainfold_arguments

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11; the package supports 3.10

__all__ = ["EvalSet", "EvalPlan", "EvalOptions", "eval_plan_for", "eval_loader_for", "evaluate", "predict"]


@attrs.frozen
class EvalSet:
    """One eval set of a run: its metric prefix, its DataLoader, and the collective when it is sharded."""

    prefix: str
    loader: Any
    collective: GatherCollective | None = None


def eval_loader_for(
    dataset: Any, collate: Callable[[list[Any]], Any], args: TrainingArguments, device: torch.device
) -> Any:
    """Return the eval DataLoader in dataset order (never length-grouped), with HF's eval DataLoader settings."""
    return eval_loader(
        dataset,
        collate,
        args.per_device_eval_batch_size,
        dataloader_drop_last=args.dataloader_drop_last,
        dataloader_num_workers=args.dataloader_num_workers,
        dataloader_persistent_workers=args.dataloader_persistent_workers,
        dataloader_prefetch_factor=args.dataloader_prefetch_factor,
        dataloader_pin_memory=args.dataloader_pin_memory and device.type == "cuda",
    )


def _eval_set(
    prefix: str,
    dataset: Any,
    collate: Callable[..., Any],
    args: TrainingArguments,
    device: torch.device,
    collective: Any,
) -> EvalSet:
    """Return an eval set; under several ranks each scores a contiguous slice (sums, counts, predictions merged)."""
    world = getattr(collective, "world_size", 1) if collective is not None else 1
    whole = args.per_device_eval_batch_size * world if args.dataloader_drop_last else 1  # HF: whole global batches
    split = (
        collective is not None
        and world > 1
        and hasattr(dataset, "__getitem__")
        and hasattr(dataset, "__len__")
        and len(dataset) // whole * whole >= world
    )
    if split:
        mine = shard(dataset, collective.rank, world, whole)
        return EvalSet(prefix, eval_loader_for(mine, collate, args, device), collective)
    return EvalSet(prefix, eval_loader_for(dataset, collate, args, device))


@attrs.frozen
class EvalPlan:
    """When a run evaluates (HF's ``eval_strategy``...), on which sets, and how it scores them."""

    sets: tuple[EvalSet, ...]  # empty: the run has no eval_dataset
    strategy: str
    steps: float | None
    logging_steps: float
    delay: float
    on_start: bool
    loss: Callable[..., Any] | None
    objective: Callable[..., Any] | None = None  # the user's: evaluation scores eval batches with it (no NEFTune)
    compute_metrics: Callable[..., Any] | None = None  # None with prediction_loss_only
    preprocess_logits_for_metrics: Callable[..., Any] | None = None
    prediction_loss_only: bool = False
    accumulation_steps: int | None = None
    label_key: str = "labels"
    include_for_metrics: tuple[str, ...] = ()  # ("inputs",): compute_metrics gets EvalPrediction.inputs
    evaluator: Callable[[TrainState], Mapping[str, float]] | None = None  # a StateStream's own evaluation

    @property
    def enabled(self) -> bool:
        """Whether the run has anything to evaluate."""
        return bool(self.sets)

    def due(self, step: int, epoch_end: bool = False, *, total_steps: int, steps_per_epoch: int, last: bool = False):
        """Say whether the run evaluates after ``step`` (``trainfold.evaluation.schedule.should_evaluate``)."""
        return self.enabled and should_evaluate(
            step,
            epoch_end,
            eval_strategy=self.strategy,
            eval_steps=self.steps,
            logging_steps=self.logging_steps,
            eval_delay=self.delay,
            max_steps=total_steps,
            epoch=step / steps_per_epoch,
            last=last,
        )

    def run(self, model: nn.Module, state: TrainState) -> list[dict[str, float]]:
        """Return the metrics of each eval set (one; or each set of a dict, named ``eval_{name}_*``, as HF)."""
        if self.evaluator is not None:
            return [dict(self.evaluator(state))]
        common: dict[str, Any] = dict(
            buffers=state.buffers,
            compute_metrics=self.compute_metrics,
            preprocess_logits_for_metrics=self.preprocess_logits_for_metrics,
            label_key=self.label_key,
            eval_accumulation_steps=self.accumulation_steps,
            prediction_loss_only=self.prediction_loss_only,
            include_for_metrics=self.include_for_metrics,
        )
        if self.objective is not None:  # single process (train refuses a sharded objective evaluation)
            return [
                evaluate_batches(
                    model, state.params, s.loader, objective=self.objective, metric_key_prefix=s.prefix, **common
                )
                for s in self.sets
            ]
        runs: Any = module_forward(model) if is_fully_sharded(model) else model
        assert self.loss is not None  # a run gives eval_plan_for its loss; only an objective run scores without
        results = [
            evaluate_batches(
                runs,
                state.params,
                s.loader,
                collective=s.collective,
                loss=self.loss,
                metric_key_prefix=s.prefix,
                **common,
            )
            for s in self.sets
        ]
        resharded(model)  # FSDP2's root keeps its params gathered after a forward: back on the state's shards
        return results


def module_forward(model: nn.Module) -> Callable[[Any, Mapping[str, Any]], Any]:
    """Return ``forward(params, inputs)`` running ``model`` as it is, in eval mode, without autograd: a
    ``fully_shard`` module (its params the state's, lent), whose hooks cannot run under ``inference_mode``.

    >>> lin = torch.nn.Linear(2, 1)
    >>> with torch.inference_mode():
    ...     module_forward(lin)(None, {"input": torch.ones(1, 2)}).requires_grad
    False
    """
    modules = list(model.modules())

    def forward(params: Any, inputs: Mapping[str, Any]) -> Any:
        with torch.inference_mode(False), torch.no_grad(), training_flags(modules, False):
            return model(**inputs)

    return forward


def eval_plan_for(
    args: TrainingArguments,
    eval_dataset: Any,
    collate: Callable[[list[Any]], Any],
    *,
    total_steps: int,
    loss: Callable[..., Any] | None,
    device: torch.device | None = None,
    collective: Collective | None = None,
    **scoring: Any,
) -> EvalPlan:
    """Return the run's ``EvalPlan`` (``scoring``: ``EvalPlan``'s objective, compute_metrics... fields), checked."""
    check_eval_schedule(
        eval_strategy=args.eval_strategy,
        eval_steps=args.eval_steps,
        logging_steps=args.logging_steps,
        eval_delay=args.eval_delay,
        eval_on_start=args.eval_on_start,
        has_eval_data=eval_dataset is not None,
        max_steps=total_steps,
    )
    if args.eval_strategy != "no" and eval_dataset is None:
        raise ValueError(
            f"eval_strategy={args.eval_strategy!r} needs an eval_dataset; pass one or set eval_strategy='no'"
        )
    device = device or device_for(args)
    sets = tuple(
        _eval_set(prefix, dataset, collate, args, device, collective)
        for prefix, dataset in eval_sets(eval_dataset).items()
    )
    if args.prediction_loss_only:
        scoring = {**scoring, "compute_metrics": None}
    return EvalPlan(
        sets,
        args.eval_strategy,
        args.eval_steps,
        args.logging_steps,
        args.eval_delay,
        args.eval_on_start,
        loss,
        prediction_loss_only=args.prediction_loss_only,
        accumulation_steps=args.eval_accumulation_steps,
        include_for_metrics=args.include_for_metrics,
        **scoring,
    )


# -- evaluate / predict outside a run ---------------------------------------------------------------


class EvalOptions(TypedDict, total=False):
    """The keywords ``evaluate`` and ``predict`` share, each ``None`` by default.

    ``state``: the ``TrainState`` whose params are scored (default: the model's own). ``data_collator``,
    ``compute_loss_func``, ``compute_metrics`` and ``preprocess_logits_for_metrics``: as HF's Trainer.
    ``objective`` (the run's ``dpo_objective``...) scores the batches and adds its metrics, as during ``train``.
    ``processing_class`` (a tokenizer or processor): without ``data_collator``, batches are padded with its pad id.
    """

    state: TrainState | None
    data_collator: Callable[[list[Any]], Any] | None
    compute_loss_func: Callable[..., Any] | None
    compute_metrics: Callable[..., Any] | None
    preprocess_logits_for_metrics: Callable[..., Any] | None
    objective: Callable[..., Any] | None
    processing_class: Any


@refusing_trainer_keywords
def evaluate(
    model: nn.Module,
    args: GivenArguments,
    eval_dataset: Any,
    *,
    metric_key_prefix: str = "eval",
    **options: Unpack[EvalOptions],
) -> dict[str, float]:
    """Evaluate ``state``'s params (default: the model's own) on ``eval_dataset``, in dataset order.

    ``args`` are ``train``'s (a script's ``transformers.TrainingArguments`` converted by ``from_hf``); ``options``
    are :class:`EvalOptions` (``state``, ``data_collator``, ``compute_metrics``, ``objective`` ...). A dict of
    datasets is evaluated set by set, each logged as ``{metric_key_prefix}_{name}_*``, as HF.

    >>> import tempfile, torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> from trainfold.trainer.args import TrainingArguments
    >>> from trainfold.trainer.train import train
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(TinyLMConfig(vocab_size=10, d_model=8, n_layers=1, n_heads=2, max_len=4))
    >>> seqs = {"even": [[0, 2, 4, 6]] * 4, "odd": [[1, 3, 5, 7]] * 4}
    >>> sets = {name: [{"input_ids": s, "labels": s} for s in rows] for name, rows in seqs.items()}
    >>> args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=4, learning_rate=3e-2,
    ...                          report_to="none", save_strategy="no", disable_tqdm=True)
    >>> before = evaluate(model, args, sets)  # a dict of sets: each scored and named on its own, as HF
    >>> after = evaluate(model, args, sets, state=train(model, args, sets["even"]).state)
    >>> after["eval_even_loss"] < before["eval_even_loss"], sorted(k for k in after if k.endswith("_loss"))
    (True, ['eval_even_loss', 'eval_even_token_loss', 'eval_odd_loss', 'eval_odd_token_loss'])
    """
    metrics: dict[str, float] = {}
    args = trainfold_arguments(args)  # a transformers.TrainingArguments: TrainingArguments.from_hf, as train's
    for prefix, dataset in eval_sets(eval_dataset, metric_key_prefix).items():  # a dict: each set, as HF
        params, buffers, batches, settings = _eval_inputs(model, args, dataset, _checked("evaluate", options))
        try:
            metrics.update(
                evaluate_batches(model, params, batches, buffers=buffers, metric_key_prefix=prefix, **settings)
            )
        finally:
            close_loader(batches)  # persistent workers end with the call
    return metrics


@refusing_trainer_keywords
def predict(
    model: nn.Module,
    args: GivenArguments,
    test_dataset: Any,
    *,
    metric_key_prefix: str = "test",
    **options: Unpack[EvalOptions],
) -> Any:
    """Return predictions, labels (dataset order) and metrics of ``state``'s params on ``test_dataset``.

    ``args`` and ``options`` are ``evaluate``'s (:class:`EvalOptions`). With ``prediction_loss_only`` the
    predictions and label ids are ``None`` and only the loss is computed, as HF.

    >>> import tempfile, torch
    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> from trainfold.trainer.args import TrainingArguments
    >>> _ = torch.manual_seed(1)
    >>> model = TinyLM(TinyLMConfig(vocab_size=12, d_model=8, n_layers=1, n_heads=2, max_len=6))
    >>> rows = [{"input_ids": [1, i, 3], "labels": [-100, i, 3]} for i in range(5)]
    >>> args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_eval_batch_size=2, report_to="none")
    >>> out = predict(model, args, rows, metric_key_prefix="heldout")
    >>> out.predictions.shape, out.label_ids.tolist()[4], sorted(out.metrics)[:2]
    ((5, 3, 12), [-100, 4, 3], ['heldout_loss', 'heldout_runtime'])
    """
    if isinstance(test_dataset, dict):
        raise TypeError("predict takes one dataset, not a dict of them (as HF's Trainer.predict); call it per set")
    args = trainfold_arguments(args)  # as evaluate's
    params, buffers, batches, settings = _eval_inputs(model, args, test_dataset, _checked("predict", options))
    try:
        return predict_batches(model, params, batches, buffers=buffers, metric_key_prefix=metric_key_prefix, **settings)
    finally:
        close_loader(batches)  # persistent workers end with the call


def _checked(name: str, options: Mapping[str, object]) -> EvalOptions:
    """Return ``options`` as :class:`EvalOptions`, or refuse a keyword it has not, naming the ones it has."""
    unknown = sorted(set(options) - set(EvalOptions.__annotations__))
    if unknown:
        known = ", ".join(["metric_key_prefix", *EvalOptions.__annotations__])
        raise TypeError(f"{name}() got unexpected keyword arguments {unknown}; it takes {known}")
    return cast(EvalOptions, options)


def _eval_inputs(
    model: nn.Module, args: TrainingArguments, dataset: Any, options: EvalOptions
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any, dict[str, Any]]:
    """Return ``(params, buffers, batches, settings)`` for ``evaluate``/``predict``: the state's tensors or the
    model's, and the ``evaluate_batches`` settings: the objective, or the model's own loss where trainfold has none."""
    loss_func, data_collator, state = (
        options.get("compute_loss_func"),
        options.get("data_collator"),
        options.get("state"),
    )
    device = device_for(args)
    objective = own_loss_objective(model, loss_func, options.get("objective"), evaluation=True)
    if state is None:
        params, buffers = split_module(model)
        state_tensors = ({k: v.to(device) for k, v in params.items()}, {k: v.to(device) for k, v in buffers.items()})
    else:
        state_tensors = (state.params, state.buffers)
    columns = columns_of(model, args, data_collator, objective=objective)  # keeps the columns it reads
    chosen = data_collator if data_collator is not None else collate_for(options.get("processing_class"))
    chosen = chosen if chosen is not None else model_pad_collate(model)  # the model's pad id, or a refusal
    chosen = eval_labels(padded_to_multiple(chosen, args.pad_to_multiple_of), args, data_collator, objective)
    settings = {
        "loss": loss_func or default_loss_for(model, defer=True),
        "objective": objective,
        "label_key": columns.label_key,
        "compute_metrics": None if args.prediction_loss_only else options.get("compute_metrics"),
        "preprocess_logits_for_metrics": options.get("preprocess_logits_for_metrics"),
        "eval_accumulation_steps": args.eval_accumulation_steps,
        "prediction_loss_only": args.prediction_loss_only,  # as HF: predictions and label_ids None, only the loss
        "include_for_metrics": args.include_for_metrics,
    }
    batches = eval_loader_for(dataset, eval_collate(chosen, columns), args, device)
    return (*state_tensors, batches, settings)
