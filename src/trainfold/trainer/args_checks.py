"""The checks of ``TrainingArguments``: each field's own (declared on the field, read by ``setting_problems``),
then the ones that read several settings together (``TrainingArguments.combined_checks``, in ``args``).

The functions and words here are what the fields' declarations name (``check=``, ``refuse=``, ``only=``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import attrs

from trainfold.observe.reporters import REPORTERS
from trainfold.trainer.optimizer import REFUSED, refused_optimizer
from trainfold.trainer.setting import default_of, setting_problems

__all__ = [
    "Arguments",
    "COMPILE_MODES",
    "NAN_INF_FILTER",
    "REFUSED_OPTIMIZERS",
    "SEED_MAX",
    "WRAPPED",
    "finite_values",
    "interval_steps",
    "known_reporters",
    "metrics_inputs",
    "not_empty",
    "problems",
]

SEED_MAX = 2**63 - 1  # the seed is a 64-bit counter in the state (torch.Generator takes the same range)
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's
REFUSED_OPTIMIZERS = {name: refused_optimizer(name) or "" for name in REFUSED}
NAN_INF_FILTER = (
    "logged means always leave out inf/NaN step losses (state.nonfinite_losses counts them; "
    "state.metrics['loss'] holds each step's own value)"
)
WRAPPED = (
    "it cuts documents at row ends, so a document's tail would be trained without its start; use 'bfd' "
    "(truncate long documents) or 'bfd_split' (split them)"
)


def interval_steps(name: str, value: float | None) -> str | None:
    """Return why ``value`` is no step interval (a positive int, or a float < 1: a share of the total steps)."""
    if value is None or (value > 0 and (value < 1 or value == int(value))):
        return None
    return f"{name} must be a positive int, or a float < 1 (a ratio of total steps), got {value}"


def finite_values(name: str, value: dict[str, Any] | None) -> str | None:
    """Return which numbers of the mapping ``value`` are inf or NaN."""
    bad = [f"{k}={v}" for k, v in (value or {}).items() if isinstance(v, float) and not math.isfinite(v)]
    return f"{name} {', '.join(bad)} is not a finite number" if bad else None


def not_empty(name: str, value: tuple[str, ...]) -> str | None:
    """Return why an empty tuple of names is refused."""
    return None if value else f"{name} must name at least one key, e.g. ('labels',)"


def known_reporters(name: str, value: str | tuple[str, ...]) -> str | None:
    """Return which of ``report_to``'s reporters trainfold does not have."""
    bad = [r for r in ((value,) if isinstance(value, str) else value) if r not in (*REPORTERS, "all", "none")]
    return f"{name} has unknown reporters {bad}; choose from {list(REPORTERS)}, 'all' or 'none'" if bad else None


def metrics_inputs(name: str, value: tuple[str, ...]) -> str | None:
    """Return why ``include_for_metrics`` names something but ``"inputs"``."""
    out = []
    for item in sorted(set(value) - {"inputs"}):
        out.append(
            f"{name} has {item!r}; it takes 'inputs' (EvalPrediction.inputs, as HF)"
            + (
                ": HF's 'loss' gives each sample its batch's mean loss, which trainfold does not make; compute a "
                "per-sample loss in compute_metrics, or use trainfold.evaluation.evaluate_batches(include_for_metrics="
                "['loss']) for each sample's own"
                if item == "loss"
                else ""
            )
        )
    return "\n  - ".join(out) or None


class Arguments(attrs.AttrsInstance, Protocol):
    """An arguments record (``TrainingArguments`` or a subclass): attrs fields, and its checks of fields together."""

    @classmethod
    def combined_checks(cls) -> tuple[Callable[[Any], list[str]], ...]: ...


_A = TypeVar("_A", bound=Arguments)


def _with_defaults_for_bad_types(args: _A, bad: set[str]) -> _A:
    """Return a copy whose wrongly typed fields hold their defaults, so other checks can still run."""
    cls = type(args)
    copy = object.__new__(cls)
    for f in attrs.fields(cls):
        object.__setattr__(copy, f.name, default_of(f, copy) if f.name in bad else getattr(args, f.name))
    return copy


def problems(args: Arguments) -> list[str]:
    """Return every problem of ``args`` (a ``TrainingArguments`` or a subclass), each naming the setting and fix.

    Each field's own checks come first (``setting_problems``), then the class's checks of settings together
    (``type(args).combined_checks()``), run on the settings with wrongly typed ones at their defaults.
    """
    out, bad = setting_problems(args)
    args = _with_defaults_for_bad_types(args, bad)
    for check in type(args).combined_checks():
        out += check(args)
    return out
