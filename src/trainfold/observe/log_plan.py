"""When to log: the Hugging Face logging settings resolved into a ``LoggingPlan``, and ``should_log``.

>>> plan = logging_plan("steps", 0.25, logging_first_step=True, total_steps=8)
>>> [s for s in range(1, 9) if should_log(plan, s, s - 1)]
[1, 2, 4, 6, 8]
"""

from __future__ import annotations

import attrs

from trainfold.core.fold import steps_interval

__all__ = ["LOGGING_STRATEGIES", "LoggingPlan", "logging_plan", "should_log"]

LOGGING_STRATEGIES = ("no", "steps", "epoch")  # HF's logging_strategy values


@attrs.frozen
class LoggingPlan:
    """When to log: ``strategy`` (``no``/``steps``/``epoch``), every ``steps`` steps, and at step 1.

    >>> plan = LoggingPlan("steps", 2, first_step=True)
    >>> [s for s in range(1, 7) if should_log(plan, s, s - 1)]
    [1, 2, 4, 6]
    """

    strategy: str = attrs.field(default="steps", validator=attrs.validators.in_(LOGGING_STRATEGIES))
    steps: int = attrs.field(default=500, validator=attrs.validators.ge(1))
    first_step: bool = False


def logging_plan(
    logging_strategy: str = "steps",
    logging_steps: int | float = 500,
    logging_first_step: bool = False,
    total_steps: int | None = None,
) -> LoggingPlan:
    """Resolve the Hugging Face logging settings into a ``LoggingPlan``.

    A ``logging_steps`` below 1 is a ratio of ``total_steps``, rounded up (as in HF).

    >>> logging_plan("steps", 0.1, total_steps=95).steps
    10
    >>> logging_plan("epoch").strategy
    'epoch'
    """
    errors = []
    if logging_strategy not in LOGGING_STRATEGIES:
        errors.append(f"logging_strategy={logging_strategy!r} is not one of {list(LOGGING_STRATEGIES)}")
    steps = 0
    try:
        steps = steps_interval(logging_steps, total_steps, "logging_steps")  # the save and eval schedules' rule
    except ValueError as e:
        errors.append(str(e))
    if errors:
        raise ValueError("invalid logging settings:\n  " + "\n  ".join(errors))
    return LoggingPlan(strategy=logging_strategy, steps=steps, first_step=bool(logging_first_step))


def should_log(plan: LoggingPlan, step: int, last_logged: int, *, epoch_end: bool = False, last: bool = False) -> bool:
    """Say whether to log after ``step`` optimizer updates, the last log having been at ``last_logged``.

    Logs on multiples of ``plan.steps`` (strategy ``steps``), at epoch ends (``epoch``), at step 1
    with ``first_step`` (whatever the strategy, even ``no``, as HF does), and at the ``last`` step of
    a run so its final partial window is not lost (HF drops it). Never twice for the same step.

    >>> plan = LoggingPlan("steps", 3)
    >>> [s for s in range(1, 10) if should_log(plan, s, 0)]
    [3, 6, 9]
    >>> should_log(plan, 7, 6, last=True), should_log(plan, 6, 6, last=True)
    (True, False)
    >>> [s for s in range(1, 4) if should_log(LoggingPlan("no", 1, first_step=True), s, 0, last=s == 3)]
    [1]
    """
    if step <= last_logged:
        return False
    if plan.first_step and step == 1:
        return True
    if plan.strategy == "no":
        return False
    if last:
        return True
    if plan.strategy == "epoch":
        return epoch_end
    return step % plan.steps == 0
