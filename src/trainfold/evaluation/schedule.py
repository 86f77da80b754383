"""The eval schedule under the HF names: when to evaluate, and which settings cannot work together.

>>> [s for s in range(1, 11) if should_evaluate(s, s % 5 == 0, eval_strategy="steps", eval_steps=5, max_steps=10)]
[5, 10]
"""

from __future__ import annotations

from typing import Any

from trainfold.core.fold import steps_interval

__all__ = ["EVAL_STRATEGIES", "check_eval_schedule", "resolve_eval_steps", "should_evaluate"]

EVAL_STRATEGIES = ("no", "steps", "epoch")


def _strategy(value: Any) -> str:
    return str(getattr(value, "value", value))


def resolve_eval_steps(eval_steps: float | None, logging_steps: float = 500, max_steps: int | None = None) -> int:
    """Return the eval interval in steps: ``eval_steps``, else ``logging_steps``.

    A value below 1 is a share of ``max_steps`` (``steps_interval``).

    >>> resolve_eval_steps(None, logging_steps=50), resolve_eval_steps(0.25, max_steps=10)
    (50, 3)
    """
    value = logging_steps if eval_steps is None or eval_steps == 0 else eval_steps
    return steps_interval(value, max_steps, "eval_steps")


def should_evaluate(
    step: int,
    epoch_end: bool = False,
    *,
    eval_strategy: str = "no",
    eval_steps: float | None = None,
    logging_steps: float = 500,
    eval_delay: float = 0,
    max_steps: int | None = None,
    epoch: float | None = None,
    last: bool = False,
) -> bool:
    """Decide whether to evaluate after optimizer step ``step`` (HF's ``eval_strategy`` rules).

    ``"steps"``: when ``step`` is a multiple of ``eval_steps`` (default ``logging_steps``), and at
    the run's last step (``last``, or ``step >= max_steps``) if that is not a multiple, epoch end
    or not; ``"epoch"``: at each epoch end (``epoch_end=True``, ``epoch`` the epochs done) and at
    the last step, also when it ends an epoch early (HF ends the epoch there). Nothing happens
    before ``eval_delay`` steps (or epochs for ``"epoch"``). Call it once per step: it answers for
    HF's ``on_step_end`` and ``on_epoch_end`` together, which never both evaluate the same step.

    >>> [s for s in range(1, 8) if should_evaluate(s, s % 4 == 0, eval_strategy="steps", eval_steps=4, max_steps=7)]
    [4, 7]
    >>> [s for s in range(1, 7) if should_evaluate(s, s % 4 == 0, eval_strategy="epoch", max_steps=6)]
    [4, 6]
    >>> should_evaluate(4, True, eval_strategy="epoch", epoch=2.0, eval_delay=3)
    False
    """
    strategy = _strategy(eval_strategy)
    if strategy not in EVAL_STRATEGIES:
        raise ValueError(f"eval_strategy must be one of {list(EVAL_STRATEGIES)}, got {eval_strategy!r}")
    last = last or (max_steps is not None and step >= max_steps)
    if strategy == "epoch":
        return (epoch_end or last) and (eval_delay == 0 or eval_delay <= _need_epoch(epoch))
    if strategy == "no":
        return False
    every = resolve_eval_steps(eval_steps, logging_steps, max_steps)
    return step > 0 and (step % every == 0 or last) and eval_delay <= step


def _need_epoch(epoch: float | None) -> float:
    if epoch is None:
        raise ValueError("should_evaluate with eval_strategy='epoch' and eval_delay > 0 needs epoch= (epochs done)")
    return epoch


def check_eval_schedule(
    *,
    eval_strategy: str = "no",
    eval_steps: float | None = None,
    logging_steps: float = 500,
    eval_delay: float = 0,
    eval_on_start: bool = False,
    has_eval_data: bool = False,
    max_steps: int | None = None,
) -> None:
    """Raise one ``ValueError`` listing every problem with the eval settings, or return ``None``.

    >>> check_eval_schedule(eval_strategy="steps", eval_steps=10, has_eval_data=True)
    """
    strategy = _strategy(eval_strategy)
    errors = []
    if strategy not in EVAL_STRATEGIES:
        errors.append(f"eval_strategy must be one of {list(EVAL_STRATEGIES)}, got {eval_strategy!r}")
    if strategy != "no" and not has_eval_data:
        errors.append(f"eval_strategy={strategy!r} needs an eval dataset; pass eval data or set eval_strategy='no'")
    if eval_on_start and strategy == "no":
        errors.append("eval_on_start=True needs eval_strategy 'steps' or 'epoch', not 'no'")
    if eval_on_start and not has_eval_data:
        errors.append("eval_on_start=True needs an eval dataset; pass eval data or set eval_on_start=False")
    if isinstance(eval_delay, bool) or not isinstance(eval_delay, (int, float)) or eval_delay < 0:
        errors.append(f"eval_delay must be a number >= 0, got {eval_delay!r}")
    if strategy == "steps":
        try:
            resolve_eval_steps(eval_steps, logging_steps, max_steps)
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ValueError("invalid eval settings: " + "; ".join(errors))
