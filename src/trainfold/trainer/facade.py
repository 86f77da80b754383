"""``Trainer``: ``transformers.Trainer``'s shape over ``trainfold.train``/``evaluate``/``predict``, for moving scripts.

It exists so that an existing script moves by changing its imports: ``Trainer(model, args, ...)`` takes
the peer's keywords (``args`` a trainfold ``TrainingArguments`` or the script's own
``transformers.TrainingArguments``, converted with ``from_hf``), and its methods are the functional API's:
``train`` is ``trainfold.train``, ``evaluate``/``predict`` are ``trainfold.evaluate``/``predict``,
``save_model``, ``log_metrics``, ``save_metrics``, ``save_state``, ``create_model_card`` and
``is_world_process_zero`` are ``trainfold.trainer.trainer_methods``. It has no logic of its own: new code calls
the functions, which stay the documented path. What it cannot honour (``model_init``, ``optimizers``,
``push_to_hub``, ``hyperparameter_search``...) is refused by name with the functional alternative.

A script's own ``transformers.TrainingArguments`` (what its ``HfArgumentParser`` made) is taken as it is:

>>> import tempfile, torch, transformers
>>> from trainfold.core.models import TinyLM, TinyLMConfig
>>> _ = torch.manual_seed(0)
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
>>> rows = [{"input_ids": [i, i + 1, i + 2, i + 3], "labels": [i, i + 1, i + 2, i + 3]} for i in range(8)]
>>> training_args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=2, use_cpu=True,
...     per_device_train_batch_size=4, report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=1)
>>> trainer = Trainer(model, training_args, train_dataset=rows, eval_dataset=rows)
>>> out = trainer.train()
>>> out.global_step, len(trainer.state.log_history), sorted(trainer.evaluate())[:2]
(2, 3, ['epoch', 'eval_loss'])
>>> type(trainer.args).__name__, trainer.args.learning_rate  # converted by TrainingArguments.from_hf
('TrainingArguments', 5e-05)
"""

from __future__ import annotations

import inspect
import os
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, NamedTuple, NoReturn, Protocol, TypeVar

import attrs
from torch import nn

from trainfold.core.rng import seed_global_rng
from trainfold.trainer import trainer_methods as methods
from trainfold.trainer.args import GivenArguments, TrainingArguments
from trainfold.trainer.evaluating import evaluate, predict
from trainfold.trainer.model_source import model_from, processing_class_for
from trainfold.trainer.train import TrainResult, train

__all__ = [
    "Trainer",
    "PeerTrainer",
    "ReferenceTrainer",
    "peer_keywords",
    "TrainOutput",
    "FacadeState",
    "Console",
    "arguments_for",
    "model_name_of",
    "refuse",
    "refused_keywords",
]


class TrainOutput(NamedTuple):
    """What ``Trainer.train`` returns, as ``transformers.trainer_utils.TrainOutput``: unpacks the same way."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


@attrs.frozen
class FacadeState:
    """``trainer.state``: the run's step, epoch, best checkpoint and log history (evaluations included), read-only."""

    global_step: int = 0
    epoch: float | None = None
    log_history: list[dict[str, Any]] = attrs.field(factory=list)
    best_checkpoint: Path | None = None

    @property
    def best_model_checkpoint(self) -> str | None:
        """HF's name for ``best_checkpoint``, as a string."""
        return None if self.best_checkpoint is None else str(self.best_checkpoint)


class Console:
    """``trainer.accelerator`` as TRL's scripts use it: ``print`` on the world's rank 0, ``is_main_process``."""

    @property
    def is_main_process(self) -> bool:
        """Whether this process is the world's rank 0."""
        return methods.is_world_process_zero()

    def print(self, *positional: Any, **kwargs: Any) -> None:
        """Print on the world's rank 0 only, as ``accelerate.Accelerator.print``."""
        if self.is_main_process:
            print(*positional, **kwargs)


_A = TypeVar("_A", bound=TrainingArguments)  # the Arguments class a trainer takes
Collate = Callable[[list[Any]], Any]


def init_kwargs(model: Any, given: GivenArguments | None, field: Any) -> dict[str, Any] | None:
    """Return the ``from_pretrained`` keywords for ``model`` when it is a name or path: the given arguments' value of
    ``field`` (the Arguments class's ``model_init_kwargs`` field; a TRL config's value included, which ``from_hf``
    leaves to the script), else ``None``."""
    return dict(getattr(given, field.name, None) or {}) if isinstance(model, str) else None


def model_name_of(model: Any) -> str:
    """Return the last part of a model's name or path, as TRL names its default ``output_dir`` (``{name}-SFT``)."""
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return name.rstrip("/").split("/")[-1] or type(model).__name__


def refuse(what: str, instead: str) -> NoReturn:
    """Raise ``TypeError`` saying that the facade cannot honour ``what``, and what to call instead."""
    raise TypeError(f"{what} is not supported by trainfold's Trainer-shaped facade; {instead}")


def arguments_for(args: GivenArguments | None, cls: type[_A], default_output_dir: str) -> _A:
    """Return ``args`` as ``cls``: as given, built from a peer's config (``cls.from_hf``: a
    ``transformers.TrainingArguments`` or TRL config), or ``cls`` at its defaults for ``None``.

    Another trainfold arguments class is refused: which of its values stand for the TRL settings it lacks
    cannot be told apart from its defaults (TRL's ``SFTConfig(**args.to_dict())`` has no such fields).
    """
    if args is None:
        return cls(output_dir=default_output_dir)
    if isinstance(args, cls):
        return args
    if isinstance(args, TrainingArguments):
        raise TypeError(
            f"this trainer takes {cls.__name__} (or the peer's own config object), not {type(args).__name__}: "
            f"build {cls.__name__}(...) with the same settings"
        )
    return cls.from_hf(args)


_REFUSED_INIT = {
    "model_init": "build the model yourself and pass it as model (trainfold runs no hyperparameter search)",
    "optimizers": "pass a trainfold optimizer to trainfold.train(..., optimizer=chain(clip_by_global_norm(1.0), "
    "adamw(...))), or set optim/lr_scheduler_type in the arguments",
    "optimizer_cls_and_kwargs": "pass trainfold.train(..., optimizer=trainfold.optim.from_torch(cls, **kwargs))",
    "quantization_config": "load the quantized model yourself and pass the module",
    "reward_processing_classes": "tokenize inside a reward function reward(prompts, completions, **kwargs)",
    "tools": "tool calling is not supported; call tools inside a reward function",
    "rollout_func": "generation is trainfold.grpo's own (GRPORun.complete); run your own loop with trainfold.loop.run",
    "environment_factory": "environments are not supported; score completions with reward functions",
}


def refused_keywords(given: dict[str, Any]) -> None:
    """Refuse, all at once, every keyword given a value the facade cannot honour."""
    bad = [k for k, v in given.items() if v not in (None, (None, None))]
    if bad:
        refuse(", ".join(f"{k}=" for k in bad), "; ".join(f"{k}: {_REFUSED_INIT.get(k, 'drop it')}" for k in bad))


_SCORING_KEYWORDS = (  # the keywords of train, evaluate and predict that a Trainer holds
    "data_collator",
    "compute_loss_func",
    "compute_metrics",
    "preprocess_logits_for_metrics",
    "processing_class",
)


class Trainer:
    """``transformers.Trainer``'s constructor and methods over ``trainfold.train`` (see the module doc).

    For moving an existing script; new code calls ``trainfold.train``, ``evaluate``, ``predict``.
    """

    arguments_class: type[TrainingArguments] = TrainingArguments

    def __init__(
        self,
        model: nn.Module | None = None,
        args: GivenArguments | None = None,
        data_collator: Collate | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Any = None,
        compute_loss_func: Callable[..., Any] | None = None,
        compute_metrics: Callable[..., Any] | None = None,
        callbacks: Sequence[Any] | None = None,
        optimizers: Any = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Callable[..., Any] | None = None,
    ) -> None:
        refused_keywords(
            dict(model_init=model_init, optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs)
        )
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer needs model= a torch module, got {type(model).__name__}; load it yourself first")
        self.args = arguments_for(args, self.arguments_class, "trainer_output")
        seed_global_rng(self.args.seed)  # as HF's Trainer(...): a collator drawing from them draws as under HF's
        self.model, self.processing_class = model, processing_class
        self.data_collator, self.train_dataset, self.eval_dataset = data_collator, train_dataset, eval_dataset
        self.compute_loss_func, self.compute_metrics = compute_loss_func, compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.callbacks = list(callbacks or ())
        self.result: TrainResult | None = None  # what the last train returned
        self._evaluations: list[dict[str, Any]] = []  # HF logs each evaluate() into state.log_history

    # -- the run -------------------------------------------------------------------------------------------

    def _run(self, resume_from_checkpoint: Any) -> TrainResult:
        """Return ``trainfold.train`` of this trainer's values (the TRL facades call their recipe's run)."""
        given = {**self._scoring(), "callbacks": self.callbacks, "resume_from_checkpoint": resume_from_checkpoint}
        return train(self.model, self.args, self.train_dataset, self.eval_dataset, **given)

    def _scoring(self) -> dict[str, Any]:
        """Return the keywords ``trainfold.evaluate``/``predict`` (and ``train``) score this trainer's data with."""
        return {name: getattr(self, name) for name in _SCORING_KEYWORDS}

    def _eval_rows(self, dataset: Any) -> Any:
        """Return ``dataset`` as ``evaluate``/``predict`` read it (the TRL facades prepare it as their run does)."""
        return dataset

    def train(
        self, resume_from_checkpoint: bool | str | os.PathLike | None = None, trial: Any = None, **kwargs: Any
    ) -> TrainOutput:
        """Train as ``trainfold.train`` does; return HF's ``TrainOutput`` (``self.result`` holds trainfold's record)."""
        if trial is not None:
            refuse("train(trial=...)", "trainfold runs no hyperparameter search; loop over settings yourself")
        if kwargs.get("ignore_keys_for_eval") is not None or set(kwargs) - {"ignore_keys_for_eval"}:
            refuse(f"train({', '.join(f'{k}=' for k in kwargs)})", "call trainfold.train with the keywords it takes")
        self.result = self._run(resume_from_checkpoint)
        self._evaluations = []
        return TrainOutput(self.result.global_step, self.result.metrics.get("train_loss", 0.0), self.result.metrics)

    @property
    def state(self) -> FacadeState:
        """Return the run's state as HF's ``trainer.state`` reads it (``log_history``, ``global_step``...)."""
        if self.result is None:
            return FacadeState(log_history=list(self._evaluations))
        history = list(self.result.log_history)
        epochs = [e["epoch"] for e in history if "epoch" in e]
        epoch = epochs[-1] if epochs else None
        best = self.result.best_checkpoint
        return FacadeState(self.result.global_step, epoch, history + self._evaluations, best)

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Evaluate the model as ``trainfold.evaluate``; the metrics are logged into ``state.log_history``, as HF's."""
        if ignore_keys is not None:
            refuse("evaluate(ignore_keys=...)", "drop the keys in compute_metrics or preprocess_logits_for_metrics")
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset; pass one here or to the Trainer")
        metrics = evaluate(
            self.model, self.args, self._eval_rows(dataset), metric_key_prefix=metric_key_prefix, **self._scoring()
        )
        state = self.state
        if state.epoch is not None:
            metrics["epoch"] = state.epoch  # HF's evaluate returns the dict it logged, the epoch added
        self._evaluations.append({**metrics, "step": state.global_step})
        return metrics

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test") -> Any:
        """Return predictions, label ids and metrics as ``trainfold.predict``."""
        if ignore_keys is not None:
            refuse("predict(ignore_keys=...)", "drop the keys in preprocess_logits_for_metrics")
        rows = self._eval_rows(test_dataset)
        return predict(self.model, self.args, rows, metric_key_prefix=metric_key_prefix, **self._scoring())

    # -- after training: trainfold.trainer.trainer_methods ------------------------------------------------------------

    def save_model(self, output_dir: str | os.PathLike | None = None, _internal_call: bool = False) -> None:
        """Save the model (a PEFT model: its adapter) and the tokenizer for ``from_pretrained``."""
        methods.save_model(self.model, output_dir or self.args.output_dir, self.processing_class)

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` as ``Trainer.log_metrics``."""
        methods.log_metrics(split, metrics)

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """Write ``{split}_results.json`` (and ``all_results.json``) into ``args.output_dir``."""
        methods.save_metrics(split, metrics, self.args.output_dir, combined)

    def save_state(self) -> None:
        """Write ``trainer_state.json`` into ``args.output_dir``."""
        methods.save_state(self.state, self.args)

    def create_model_card(self, **kwargs: Any) -> None:
        """Write ``README.md`` into ``args.output_dir``; takes HF's keywords (``tasks``, ``license``...)."""
        methods.create_model_card(self.args.output_dir, self.args, self.result, **kwargs)

    def is_world_process_zero(self) -> bool:
        """Whether this process is the world's rank 0."""
        return methods.is_world_process_zero()

    def is_local_process_zero(self) -> bool:
        """Whether this process is its machine's rank 0."""
        return int(os.environ.get("LOCAL_RANK", "0")) == 0

    def add_callback(self, callback: Any) -> None:
        """Add a ``TrainerCallback`` (or its class) for the next ``train``."""
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    @property
    def accelerator(self) -> Console:
        """What TRL's scripts call ``trainer.accelerator.print`` on (trainfold runs no accelerate)."""
        return Console()

    def end(self) -> None:
        """Do nothing: ``train`` closes its reporters and process group itself (``Trainer.end``, transformers 5.18)."""

    def push_to_hub(self, *positional: Any, **kwargs: Any) -> None:
        """Refused: trainfold never uploads."""
        refuse("push_to_hub", "save_model(output_dir), then upload it yourself (model.push_to_hub or huggingface_hub)")

    def hyperparameter_search(self, *positional: Any, **kwargs: Any) -> None:
        """Refused: trainfold runs no hyperparameter search."""
        refuse("hyperparameter_search", "loop over settings yourself, calling trainfold.train for each")


_TRAINER_KEYWORDS = (  # the keywords a TRL trainer passes on to transformers.Trainer
    "data_collator",
    "train_dataset",
    "eval_dataset",
    "compute_loss_func",
    "compute_metrics",
    "callbacks",
    "preprocess_logits_for_metrics",
)
_RUN_KEYWORDS = ("data_collator", "compute_loss_func", "compute_metrics", "preprocess_logits_for_metrics", "objective")


_HF_KEYWORDS = (  # transformers.Trainer's constructor after model, in order
    "args",
    "data_collator",
    "train_dataset",
    "eval_dataset",
    "processing_class",
    "compute_loss_func",
    "compute_metrics",
    "callbacks",
    "optimizers",
    "optimizer_cls_and_kwargs",
    "preprocess_logits_for_metrics",
)


def peer_keywords(
    *, before_args: tuple[str, ...] = (), without: tuple[str, ...] = (), extra: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """Return a TRL trainer's constructor keywords, in order, as they differ from ``transformers.Trainer``'s:
    ``before_args`` follow ``model``, ``without`` are dropped, and ``quantization_config``, ``peft_config``
    and ``extra`` come last."""
    kept = tuple(k for k in _HF_KEYWORDS if k not in without)
    return ("model", *before_args, *kept, "quantization_config", "peft_config", *extra)


class LoadSettings(Protocol):
    """What loading a model given by name reads of a TRL run's arguments (read-only: frozen records)."""

    @property
    def model_init_kwargs(self) -> dict[str, Any] | None: ...
    @property
    def seed(self) -> int: ...


def _load(model: nn.Module | str, args: LoadSettings, peft_config: Any) -> nn.Module:
    """Return ``model`` as a module: loaded by name with ``args.model_init_kwargs``, wrapped by ``peft_config``."""
    return model_from(model, args.model_init_kwargs, peft_config, seed=args.seed)


def declared_arguments(cls: type) -> type[TrainingArguments] | None:
    """Return the Arguments class a trainer class is declared for: ``class SFTTrainer(PeerTrainer[SFTArguments])``."""
    for base in vars(cls).get("__orig_bases__", ()):  # its own bases (a subclass of SFTTrainer inherits the class)
        for arg in typing.get_args(base):
            if isinstance(arg, type) and issubclass(arg, TrainingArguments):
                return arg
    return None


class PeerTrainer(Trainer, Generic[_A]):
    """A TRL trainer's constructor over its trainfold run, declared as data by each subclass.

    A subclass names its Arguments class (``PeerTrainer[SFTArguments]``; its name, less ``Arguments``, is the
    default ``output_dir``'s suffix, as TRL's config names are: ``{model}-SFT``), its peer's constructor keywords
    in order (``keywords``; ``required`` have no default, ``optimizers`` defaults to ``(None, None)``, the rest to
    ``None``), the ones it refuses (``refused``), its run (``run``) and how it loads a model given by name
    (``load_model``). Building one is the same for all: refuse, convert ``args``, load the model with the
    arguments' ``model_init_kwargs``, take the tokenizer saved with it, then ``_finish`` with what is left.
    """

    arguments_class: type[_A]
    args: _A
    keywords: ClassVar[tuple[str, ...]] = ()
    required: ClassVar[tuple[str, ...]] = ("model",)
    refused: ClassVar[tuple[str, ...]] = ("optimizers", "optimizer_cls_and_kwargs", "quantization_config")
    own_collator: ClassVar[str | None] = None  # why data_collator= is refused, where the run pads rows itself
    run: ClassVar[Callable[..., TrainResult]]
    load_model: ClassVar[Callable[[Any, Any, Any], nn.Module]] = staticmethod(_load)
    run_extras: ClassVar[tuple[str, ...]] = ()  # the peer's own keywords the run takes too

    def loaded(self, args: _A) -> _A:
        """The arguments the run gets: building the trainer loaded the model, so its keywords are spent."""
        return args.replace(model_init_kwargs=None)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = declared_arguments(cls)
        if declared is not None and "arguments_class" not in vars(cls):  # one set in the class body wins
            cls.arguments_class = typing.cast("type[_A]", declared)
        P = inspect.Parameter

        def default(name: str) -> Any:
            return P.empty if name in cls.required else (None, None) if name == "optimizers" else None

        params = [P(name, P.POSITIONAL_OR_KEYWORD, default=default(name), annotation=Any) for name in cls.keywords]
        cls.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]

    def __init__(self, *positional: Any, **keywords: Any) -> None:
        bound = type(self).__signature__.bind(*positional, **keywords)  # type: ignore[attr-defined]
        bound.apply_defaults()
        values = dict(bound.arguments)
        refused_keywords({k: values.pop(k) for k in self.refused if k in values})
        if self.own_collator is not None and values.get("data_collator") is not None:
            refuse(f"{type(self).__name__}(data_collator=...)", self.own_collator)
        model, given, peft_config = values.pop("model"), values.pop("args"), values.pop("peft_config", None)
        run_name = self.arguments_class.__name__.removesuffix("Arguments")  # as TRL's: SFTConfig -> {model}-SFT
        args = arguments_for(given, self.arguments_class, f"{model_name_of(model)}-{run_name}")
        module = type(self).load_model(model, self._loading(args, model, given), peft_config)
        tok = processing_class_for(module, values.pop("processing_class"))  # as TRL: the tokenizer saved with the model
        common = {k: values.pop(k) for k in _TRAINER_KEYWORDS if k in values}
        common["data_collator"] = self._collator(module, tok, args, common.get("data_collator"))
        super().__init__(module, args, processing_class=tok, **common)
        self._finish(given, **values)

    def _loading(self, args: _A, model: nn.Module | str, given: GivenArguments | None) -> _A:
        """Return ``args`` with the ``model_init_kwargs`` that load ``model`` (given as a name) from ``given``."""
        field = attrs.fields(self.arguments_class).model_init_kwargs
        return args.replace(model_init_kwargs=init_kwargs(model, given, field))

    def _collator(self, model: nn.Module, processing_class: Any, args: _A, given: Collate | None) -> Collate | None:
        """Return the collator the trainer keeps: the one given (a subclass may build its run's own)."""
        return given

    def _finish(self, given: GivenArguments | None, **rest: Any) -> None:
        """Keep the peer's own keywords (``formatting_func``, ``reward_funcs``...) as attributes."""
        for name, value in rest.items():
            setattr(self, name, value)

    def _run(self, resume_from_checkpoint: Any) -> TrainResult:
        named = {k: getattr(self, k, None) for k in (*_RUN_KEYWORDS, *self.run_extras)}
        return type(self).run(
            self.model,
            self.loaded(self.args),
            train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset,
            processing_class=self.processing_class,
            callbacks=self.callbacks,
            resume_from_checkpoint=resume_from_checkpoint,
            **{k: v for k, v in named.items() if v is not None},  # None: the run's own (SFT's loss, DPO's reference)
        )


class ReferenceTrainer(PeerTrainer[_A]):
    """A TRL preference trainer whose reference is fixed when it is built (``DPOTrainer``, ``KTOTrainer``).

    ``ref_model`` (a module, a name loaded as the policy is, or ``None``: the policy as given) makes the run's
    objective once (``reference_objective(model, args, ref_model)``), so ``evaluate`` after ``train`` scores
    against it, as TRL's. ``evaluate``/``predict`` read rows prepared as the run prepares them (``prepare``)
    and collated by the run's collator (``scoring_collator``).
    """

    keywords = peer_keywords(
        before_args=("ref_model",),
        without=("compute_loss_func", "optimizer_cls_and_kwargs", "preprocess_logits_for_metrics"),
    )
    reference_objective: ClassVar[Callable[..., Any]]  # (model, args, ref_model) -> objective
    prepare: ClassVar[Callable[..., Any]]  # (dataset, processing_class, args) -> rows
    scoring_collator: ClassVar[Callable[..., Any]]  # (model, args, processing_class) -> collate

    def _finish(self, given: GivenArguments | None, **rest: Any) -> None:
        ref_model = rest["ref_model"]
        if isinstance(ref_model, str):
            ref_model = type(self).load_model(ref_model, self._loading(self.args, ref_model, given), None)
        self.ref_model = ref_model
        self.objective = type(self).reference_objective(self.model, self.args, ref_model)

    def _eval_rows(self, dataset: Any) -> Any:
        return type(self).prepare(dataset, self.processing_class, self.args)

    def _scoring(self) -> dict[str, Any]:
        collate = type(self).scoring_collator(self.model, self.args, self.processing_class)
        return {**super()._scoring(), "data_collator": collate, "objective": self.objective}
