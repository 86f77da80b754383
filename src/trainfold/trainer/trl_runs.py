"""What the TRL runs share (``trainfold.sft/dpo/kto/reward.train``): one signature and one path to ``trainfold.train``.

Each algorithm is a :class:`TRLRun`: its Arguments class and its ``prepare`` (model, rows, collator, objective
from what the run was given, a :class:`TRLInputs`). The run checks the arguments, hands ``prepare`` the
inputs and the algorithm's own keywords (TRL's names: ``ref_model``, ``data_collator``, ``formatting_func``),
and trains what it returns with ``trainfold.train``; the other keywords go to ``trainfold.train``.
The preference runs (DPO, KTO) share the policy they train (:func:`policy_model`) and their reference's
parameters (:func:`reference_params`).

>>> from trainfold.trainer.args import TrainingArguments
>>> check_arguments(TrainingArguments(bf16=False), TrainingArguments, "sft") is None
True
>>> list(PreparedStream([{"x": 1}, {"x": 2}], lambda rows: [{"y": row["x"] * 10} for row in rows]))
[{'y': 10}, {'y': 20}]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch
from torch import Tensor, nn

from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.model_source import model_from, without_dropout
from trainfold.trainer.train import TrainResult
from trainfold.trainer.train import train as train_run

__all__ = [
    "PolicySettings",
    "PreparedStream",
    "TRLInputs",
    "TRLRun",
    "TRLPrepared",
    "check_arguments",
    "policy_model",
    "reference_params",
]


def check_arguments(args: object, expected: type[TrainingArguments], package: str) -> None:
    """Refuse ``args`` unless it is an ``expected`` (the Arguments of ``trainfold.<package>.train``), naming the fix."""
    if not isinstance(args, expected):
        config = expected.__name__.replace("Arguments", "Config")
        raise TypeError(
            f"trainfold.{package}.train takes {expected.__name__} (TRL's {config} names), not {type(args).__name__}; "
            f"convert a trl.{config} with {expected.__name__}.from_hf(config)"
        )


class PreparedStream(torch.utils.data.IterableDataset):
    """A dataset without a length (``datasets.IterableDataset``, streaming) prepared row by row as it is read."""

    def __init__(
        self, rows: Iterable[Mapping[str, Any]], prepare: Callable[[list[Mapping[str, Any]]], Iterable[Any]]
    ) -> None:
        self.rows, self.prepare = rows, prepare

    def __iter__(self) -> Iterator[Any]:
        for row in self.rows:
            yield from self.prepare([row])


class PolicySettings(Protocol):
    """What building the trained policy reads: DPO's and KTO's arguments both have it (read-only: frozen records)."""

    @property
    def model_init_kwargs(self) -> dict[str, Any] | None: ...
    @property
    def seed(self) -> int: ...
    @property
    def disable_dropout(self) -> bool: ...


def policy_model(model: nn.Module | str, args: PolicySettings, peft_config: Any = None) -> nn.Module:
    """Return the model DPO (and KTO) trains: loaded by name, wrapped by PEFT, its dropout off with
    ``disable_dropout`` (``args``: ``DPOArguments`` or ``KTOArguments``)."""
    built = model_from(model, args.model_init_kwargs, peft_config, seed=args.seed)
    # TRL's default: no dropout in the policy (nor, thereby, in its reference)
    return without_dropout(built) if args.disable_dropout else built


def reference_params(model: nn.Module, ref_model: nn.Module | None, *, precomputed: bool) -> dict[str, Tensor] | None:
    """Return the reference's params as TRL takes them: all of ``ref_model``'s, else the trainable params of
    ``model`` as it is now; None when the reference log-probs are ``precomputed`` from the model itself (it is
    scored before training and needs no copy)."""
    if ref_model is not None:
        return dict(ref_model.named_parameters())
    return None if precomputed else {k: v for k, v in model.named_parameters() if v.requires_grad}


@attrs.frozen
class TRLInputs:
    """What a TRL run was given: the model (a module, or a name to load), its arguments, the datasets, the
    tokenizer (None: the one saved with the model), the PEFT config, the objective a caller fixed (None: the
    algorithm's own) and the algorithm's own keywords (``own``: only those given)."""

    model: nn.Module | str
    args: TrainingArguments
    train_dataset: Any
    eval_dataset: Any
    processing_class: Any
    peft_config: Any
    objective: Any
    own: Mapping[str, Any]


@attrs.frozen
class TRLPrepared:
    """What a TRL run trains with ``trainfold.train``: the model, the arguments, the rows, the collator, and the
    run's keywords (``objective`` or ``compute_loss_func``, ``processing_class``; a caller's own win)."""

    model: nn.Module
    args: TrainingArguments
    train_rows: Any
    eval_rows: Any
    collate: Any
    keywords: Mapping[str, Any]


@attrs.frozen
class TRLRun:
    """One TRL trainer as a trainfold run (``trainfold.<package>.train``): its Arguments, its own keywords
    (TRL's names) and ``prepare``, which makes the model, rows, collator and objective from a :class:`TRLInputs`."""

    arguments: type[TrainingArguments]
    package: str
    prepare: Callable[[TRLInputs], TRLPrepared]
    own: tuple[str, ...] = ()

    def __call__(
        self,
        model: nn.Module | str,
        args: TrainingArguments,
        train_dataset: Any,
        eval_dataset: Any = None,
        processing_class: Any = None,
        *,
        peft_config: Any = None,
        callbacks: Sequence[Any] = (),
        **kwargs: Any,
    ) -> TrainResult:
        """Train ``model`` on ``train_dataset`` as the TRL trainer of ``trainfold.<package>`` does; return the record.

        Without ``processing_class`` the tokenizer saved with the model is loaded, as TRL does (the rest is by
        keyword: the runs' own keywords differ, so none is taken by its position); ``peft_config``
        wraps the model with PEFT. The algorithm's own keywords (``own``) go to its ``prepare``; the rest to
        ``trainfold.train`` (``compute_metrics``, ``observers``, ``resume_from_checkpoint``, ``objective``...).
        """
        check_arguments(args, self.arguments, self.package)
        own = {k: kwargs.pop(k) for k in self.own if k in kwargs}
        objective = kwargs.pop("objective", None)
        given = TRLInputs(model, args, train_dataset, eval_dataset, processing_class, peft_config, objective, own)
        run = self.prepare(given)
        keywords = {**run.keywords, **kwargs, "callbacks": callbacks}
        return train_run(run.model, run.args, run.train_rows, run.eval_rows, run.collate, **keywords)
