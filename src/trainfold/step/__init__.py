"""The training step: the micro-batch driver, compiled variant, FSDP2 and DDP engines, mixed precision, recomputation.

``make_step`` (``trainfold.step.make``) builds the plan (``plan``) and picks a variant: ``eager`` (which runs
a lent state's module as it is, under DDP (``data_parallel``) or FSDP2 (``fsdp``) across ranks) or
``compiled.compile_step`` (a wrapper around a step); every variant composes the micro-batch driver
(``driver``) and none imports ``make``.
"""

from trainfold.step.compiled import CompileFallbackWarning, compile_step
from trainfold.step.driver import accumulate, next_state, open_step, with_donation
from trainfold.step.eager import eager_step
from trainfold.step.make import Execution, make_step
from trainfold.step.plan import StepPlan, refuse_sharded, step_plan

__all__ = [
    "CompileFallbackWarning",
    "Execution",
    "StepPlan",
    "accumulate",
    "compile_step",
    "eager_step",
    "make_step",
    "next_state",
    "open_step",
    "refuse_sharded",
    "step_plan",
    "with_donation",
]
