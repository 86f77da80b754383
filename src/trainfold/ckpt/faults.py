"""Crash points: a hook that tests set to crash a checkpoint writer at each step of a save, rotation or replace."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["fault_hook", "point"]

# Tests set this to a function of a label ("replace:exchanged", "rotate:renamed", ...) to crash a
# writer at each point of a save, a rotation or a replace in turn. None in normal use.
fault_hook: Callable[[str], None] | None = None


def point(label: str) -> None:
    """Mark the crash point ``label`` of a checkpoint write: call ``fault_hook(label)`` if a test set one."""
    if fault_hook is not None:
        fault_hook(label)
