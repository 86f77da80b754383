"""When the compiled step cannot run: the settings it refuses up front, and the warning that it runs eagerly."""

from __future__ import annotations

import warnings

from trainfold.step.plan import StepPlan

__all__ = ["CompileFallbackWarning", "fall_back", "refuse_uncompilable"]


class CompileFallbackWarning(UserWarning):
    """``compile=True`` could not compile the step and runs the eager step instead.

    Turn the fallback into an error with ``warnings.simplefilter("error", CompileFallbackWarning)``.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warnings.warn("no compiler here", CompileFallbackWarning)
    >>> [(w.category.__name__, issubclass(w.category, UserWarning)) for w in caught]
    [('CompileFallbackWarning', True)]
    """


def fall_back(reason: str) -> None:
    """Warn (``CompileFallbackWarning``) that ``make_step(compile=True)`` runs the eager step, and why."""
    warnings.warn(
        f"make_step(compile=True): {reason}; running the eager step instead (same results, no compile speed-up)",
        CompileFallbackWarning,
        stacklevel=3,
    )


def refuse_uncompilable(plan: StepPlan) -> None:
    """Raise ``ValueError`` for the settings the compiled step does not support yet (it names the alternative)."""
    if plan.recompute:
        raise ValueError("gradient_checkpointing with compile is not supported yet; choose one of the two")
    if plan.loss_scaling is not None:
        raise ValueError("loss_scaling (fp16) with compile is not supported yet; use bf16 autocast, or the eager step")
