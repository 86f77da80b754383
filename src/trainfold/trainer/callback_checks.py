"""The checks and settings around HF callbacks: refused hooks, ``EarlyStoppingCallback``, observers, verbosity."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from trainfold.observe.reporters import LOG_LEVELS
from trainfold.trainer.args import TrainingArguments

__all__ = [
    "REFUSED_HOOKS",
    "refused_hooks",
    "transformers_module",
    "check_callbacks",
    "check_observers",
    "split_early_stopping",
    "by_epoch",
    "set_transformers_verbosity",
]

# hook -> why a trainfold run cannot call it
REFUSED_HOOKS: dict[str, str] = {
    "on_pre_optimizer_step": "it runs between clipping and the optimizer update, to change gradients in place",
    "on_optimizer_step": "it runs right after the optimizer update, to change parameters or optimizer state",
    "on_substep_end": "it runs between the micro-batches of one step, which is a pure function here",
    "on_prediction_step": "it runs inside evaluation, for each batch",
}


def refused_hooks(callback: Any) -> list[str]:
    """Return the hooks of ``REFUSED_HOOKS`` that ``callback`` overrides (compared with ``TrainerCallback``).

    >>> import transformers
    >>> class Clip(transformers.TrainerCallback):
    ...     def on_pre_optimizer_step(self, args, state, control, **kwargs):
    ...         pass
    >>> refused_hooks(Clip()), refused_hooks(transformers.EarlyStoppingCallback())
    (['on_pre_optimizer_step'], [])
    """
    base = transformers_module().TrainerCallback if _has_transformers() else None
    if base is None or not isinstance(callback, base):
        return []
    return [h for h in REFUSED_HOOKS if getattr(type(callback), h, None) is not getattr(base, h)]


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def transformers_module() -> Any:
    """Return ``transformers`` (imported only when callbacks are given)."""
    import transformers

    return transformers


def check_callbacks(callbacks: Sequence[Any]) -> list[Any]:
    """Return the callbacks as a list of instances (a class is instantiated, as in HF), or raise naming each problem.

    >>> check_callbacks([])
    []
    >>> try:
    ...     check_callbacks([print])
    ... except TypeError as err:
    ...     print(str(err).replace("; ", ";\\n"))
    callbacks take transformers.TrainerCallback objects;
    got builtin_function_or_method print (a function (state, logs) -> None is an observer: pass it as observers=[...])
    """
    out: list[Any] = []
    problems: list[str] = []
    if not callbacks:
        return out
    for cb in callbacks:
        if not _has_transformers():
            raise ImportError(
                "callbacks= takes transformers.TrainerCallback objects, which needs transformers: "
                "pip install 'trainfold[hf]'"
            )
        base = transformers_module().TrainerCallback
        cb = cb() if isinstance(cb, type) and issubclass(cb, base) else cb
        if not isinstance(cb, base):
            name = getattr(cb, "__name__", repr(cb))
            problems.append(
                f"callbacks take transformers.TrainerCallback objects; got {type(cb).__name__} {name}"
                + (
                    " (a function (state, logs) -> None is an observer: pass it as observers=[...])"
                    if callable(cb)
                    else ""
                )
            )
            continue
        for hook in refused_hooks(cb):
            problems.append(
                f"{type(cb).__name__} overrides {hook}, which trainfold cannot call: "
                f"{REFUSED_HOOKS[hook]}. Express the change as a GradientTransformation "
                "(optimizer=chain(...)) or an objective"
            )
        out.append(cb)
    if problems:
        raise TypeError("\n".join(problems))
    return out


def split_early_stopping(
    callbacks: Sequence[Any], args: TrainingArguments, early_stopping: Any
) -> tuple[list[Any], Any]:
    """Return ``(other_callbacks, early_stopping)``: an ``EarlyStoppingCallback`` becomes trainfold's record.

    It needs ``metric_for_best_model`` and an ``eval_strategy`` (HF asserts both), and cannot be combined
    with an ``early_stopping=`` argument.
    """
    from trainfold.ckpt.best import greater_is_better_for
    from trainfold.observe.stopping import early_stopping as make_early_stopping

    callbacks = check_callbacks(callbacks)
    stoppers = [cb for cb in callbacks if isinstance(cb, transformers_module().EarlyStoppingCallback)]
    if not stoppers:
        return callbacks, early_stopping
    problems = []
    if len(stoppers) > 1 or early_stopping is not None:
        problems.append("give early stopping once: one EarlyStoppingCallback, or early_stopping=, not both")
    if args.metric_key is None:
        problems.append("EarlyStoppingCallback needs metric_for_best_model (e.g. 'loss'), as in HF")
    if args.eval_strategy == "no":
        problems.append("EarlyStoppingCallback needs eval_strategy 'steps' or 'epoch', as in HF")
    if problems:
        raise ValueError("\n".join(problems))
    (cb,) = stoppers
    metric = args.metric_key
    assert metric is not None  # refused above
    stopper = make_early_stopping(
        metric,
        patience=int(cb.early_stopping_patience),
        threshold=float(cb.early_stopping_threshold or 0.0),
        greater_is_better=greater_is_better_for(metric, args.greater_is_better),
    )
    return [c for c in callbacks if c is not cb], stopper


_LEVELS = dict(zip(LOG_LEVELS, (10, 20, 30, 40, 50, -1), strict=True))  # passive: keep the current level


def set_transformers_verbosity(log_level: str, *, main_process: bool = True) -> int | None:
    """Set the ``transformers`` logger's level from ``log_level`` as the HF Trainer does; return the level set.

    Only when ``transformers`` is already imported (trainfold never imports it for this). ``passive``
    keeps the current level; a process other than the main one takes HF's ``log_level_replica``
    default, ``warning``. Like the Trainer (``logging.set_verbosity`` in its ``__init__``), the level stays.

    >>> set_transformers_verbosity("passive") is None
    True
    """
    if log_level not in _LEVELS:
        raise ValueError(f"log_level={log_level!r} is not one of {list(_LEVELS)}")
    logging = sys.modules.get("transformers.utils.logging")  # there once transformers is imported
    level = _LEVELS[log_level] if main_process else _LEVELS["warning"]
    if logging is None or level == -1:
        return None
    logging.set_verbosity(level)
    return level


def by_epoch(logging: str, evaluation: str, saving: str) -> dict[str, bool]:
    """Say which of a step's log, evaluation and save HF makes after ``on_epoch_end`` (by epoch), not before, from
    the logging, eval and save strategies.

    >>> by_epoch("steps", "epoch", "best")
    {'log': False, 'eval': True, 'save': True}
    """
    evaluate = evaluation == "epoch"
    return {"log": logging == "epoch", "eval": evaluate, "save": saving == "epoch" or (saving == "best" and evaluate)}


def check_observers(observers: Sequence[Any]) -> None:
    """Refuse an observer that is not callable, naming ``callbacks=`` for a ``TrainerCallback``.

    >>> check_observers([lambda state, logs: None])
    >>> class MyCallback:  # stands for a transformers.TrainerCallback subclass
    ...     on_log = None
    >>> try:
    ...     check_observers([MyCallback()])
    ... except TypeError as err:
    ...     print(str(err).replace("; ", ";\\n"))
    observers are functions (state, logs) -> None;
    MyCallback is not callable (a transformers.TrainerCallback goes in callbacks=[...])
    """
    bad = [o for o in observers if not callable(o)]
    if bad:
        names = ", ".join(type(o).__name__ for o in bad)
        raise TypeError(
            f"observers are functions (state, logs) -> None; {names} is not callable "
            "(a transformers.TrainerCallback goes in callbacks=[...])"
        )
