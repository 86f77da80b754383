"""GRPO's generation schedule, counted as TRL 1.16's ``GRPOTrainer`` counts it: the core of the loop and the run.

``steps_per_generation`` counts **micro-steps** (micro-batches): one generation holds the completions of
``steps_per_generation`` micro-batches and is trained on ``num_iterations`` times over; micro-step ``k``
generates when ``k % (steps_per_generation × num_iterations) == 0`` and trains on slice
``k % steps_per_generation`` (:class:`GenerationSchedule`). :func:`schedule_step` applies it to one optimizer
step's micro-steps: the run's stream (``trainfold.grpo.schedule``, a buffer held in the state) calls it.

>>> s = GenerationSchedule(steps_per_generation=3, num_iterations=2, gradient_accumulation_steps=2)
>>> [(k, s.generates(k), s.part(k)) for k in range(7)][:4], s.records_old_logps
([(0, True, 0), (1, False, 1), (2, False, 2), (3, False, 0)], True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs

__all__ = ["GenerationSchedule", "Sampling", "schedule_step"]

B = TypeVar("B")  # a generation, as the driver holds it
M = TypeVar("M")  # a training micro-batch


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"GenerationSchedule {attribute.name}={value!r} must be an int >= 1")


@attrs.frozen
class GenerationSchedule:
    """When GRPO generates and which slice each micro-step trains on, in TRL's units (micro-steps).

    ``steps_per_generation``: micro-batches one generation feeds (TRL's default is
    ``gradient_accumulation_steps``); ``num_iterations``: passes over each generation (TRL's μ).
    """

    steps_per_generation: int = attrs.field(validator=_positive)
    num_iterations: int = attrs.field(default=1, validator=_positive)
    gradient_accumulation_steps: int = attrs.field(default=1, validator=_positive)

    @property
    def block(self) -> int:
        """Micro-steps between two generations (TRL's ``generate_every``)."""
        return self.steps_per_generation * self.num_iterations

    def generates(self, micro_step: int) -> bool:
        """Whether ``micro_step`` starts with a new generation."""
        return micro_step % self.block == 0

    def generation(self, micro_step: int) -> int:
        """The number of the generation ``micro_step`` trains on."""
        return micro_step // self.block

    def part(self, micro_step: int) -> int:
        """The slice of its generation that ``micro_step`` trains on."""
        return micro_step % self.steps_per_generation

    @property
    def records_old_logps(self) -> bool:
        """Whether a generation outlives the optimizer step that made it (TRL's rule: ``GA % block != 0``),
        so the sampling policy's log-probs must be kept."""
        return self.gradient_accumulation_steps % self.block != 0


@attrs.frozen
class Sampling:
    """What one generation is: ``num_generations`` completions per prompt of at most ``max_completion_length``
    tokens, sampled at ``temperature``, and how their rewards become advantages (``trainfold.grpo.rewards``:
    ``reward_weights``, ``scale_rewards``, ``multi_objective_aggregation``).

    >>> Sampling(num_generations=4, max_completion_length=8).scale_rewards
    'group'
    """

    num_generations: int
    max_completion_length: int
    temperature: float = 1.0
    reward_weights: tuple[float, ...] | None = None
    scale_rewards: str = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    rng: str = "keyed"  # GRPOArguments.generation_rng: "keyed" or "global" (trainfold.grpo.global_rng)


def schedule_step(
    schedule: GenerationSchedule,
    generation: B,
    micro_steps: Iterable[int],
    generate: Callable[[int], B],
    part: Callable[[B, int], M],
) -> tuple[B, list[M], int]:
    """Return one optimizer step by ``schedule``: the generation it ends with, its micro-batches, how many it made.

    ``micro_steps`` are the step's micro-step numbers; at each that :meth:`GenerationSchedule.generates`,
    ``generate(number)`` makes the next generation (call it with the state the step starts from); every
    micro-step trains on ``part(generation, slice)``.

    >>> s = GenerationSchedule(steps_per_generation=2)
    >>> schedule_step(s, None, [0, 1, 2], lambda g: f"g{g}", lambda gen, i: (gen, i))
    ('g1', [('g0', 0), ('g0', 1), ('g1', 0)], 2)
    """
    micro, made = [], 0
    for k in micro_steps:
        if schedule.generates(k):
            generation, made = generate(schedule.generation(k)), made + 1
        micro.append(part(generation, schedule.part(k)))
    return generation, micro, made
