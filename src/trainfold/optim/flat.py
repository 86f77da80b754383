"""Transitional: what ``step/sharded_update.py`` imports until the sharded step is deleted (then delete this file).

There is no element-wise AdamW plan any more: ``optimizer_plan`` refuses every optimizer, so the
sharded step takes its generic path, ``optimizer.apply`` (torch's kernels run on the DTensors).
"""

from __future__ import annotations

from typing import Any

__all__: list[str] = []

OptimizerPlan = Any


def optimizer_plan(optimizer: Any) -> Any:
    """Refuse: no optimizer has an element-wise plan (the sharded step then applies it as it is)."""
    raise TypeError(f"{getattr(optimizer, 'name', optimizer)} has no element-wise plan")
