"""GRPO's generation schedule, counted as TRL 1.16's ``GRPOTrainer`` counts it: the core of the loop and the run.

``steps_per_generation`` counts **micro-steps** (micro-batches): one generation holds the completions of
``steps_per_generation`` micro-batches and is trained on ``num_iterations`` times over; micro-step ``k``
generates when ``k % (steps_per_generation × num_iterations) == 0`` and trains on slice
``k % steps_per_generation`` (:class:`GenerationSchedule`). :func:`schedule_step` applies it to one optimizer
step's micro-steps. Both GRPO drivers are this schedule: the run (``trainfold.grpo.schedule``, a buffer held
in the state) calls :func:`schedule_step`, and the hand loop (``grpo_loop.grpo_trajectory``) reads a prompt
stream through :func:`generation_batches`, which calls it per generation.

>>> s = GenerationSchedule(steps_per_generation=3, num_iterations=2, gradient_accumulation_steps=2)
>>> [(k, s.generates(k), s.part(k)) for k in range(7)][:4], s.records_old_logps
([(0, True, 0), (1, False, 1), (2, False, 2), (3, False, 0)], True)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs
from torch import Tensor

from trainfold.data import StepBatch

__all__ = ["GenerationSchedule", "generation_batches", "schedule_step"]

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


# -- the hand loop's stream -------------------------------------------------------------------


def _repeat_rows(micro: Any, times: int) -> Any:
    if times == 1:
        return micro
    if isinstance(micro, Mapping):
        return {k: _repeat_rows(v, times) for k, v in micro.items()}
    if isinstance(micro, Tensor):
        return micro.repeat_interleave(times, dim=0)
    if isinstance(micro, (list, tuple)):  # each repeat its own object: a reward function may change one
        return type(micro)(copy.deepcopy(x) for x in micro for _ in range(times))
    raise TypeError(f"cannot repeat rows of a {type(micro).__name__}; prompts must be dicts, tensors or lists")


@attrs.frozen(eq=False)
class _Micro:
    """One micro-step of the loop: its micro-batch, its prompt step, and whether it ends an optimizer step."""

    batch: Any
    step: Any
    index: int
    ends_step: bool


def _realigns(step: Any, accumulation: int, steps_per_generation: int) -> bool:
    """Whether a generation ends after prompt step ``step``: at an epoch end, or at a block boundary of the
    stream's positions (so a stream resumed from a cursor re-forms the same generations)."""
    cursor = getattr(step, "cursor", None)
    if cursor is None:
        return False
    position = int(cursor.position)
    return position == 0 or (position * accumulation) % steps_per_generation == 0


def _generation_micro_steps(
    block: list[tuple[Any, Any, int]],
    generate: Callable[[list[Any]], Sequence[Any]],
    num_generations: int,
    num_iterations: int,
    accumulation: int,
    short: bool,
) -> Iterator[_Micro]:
    prompts = [_repeat_rows(mb, num_generations) for mb, _, _ in block]
    generated = list(generate(prompts))
    if len(generated) != len(prompts):
        raise ValueError(
            f"generate returned {len(generated)} micro-batches for {len(prompts)} prompt micro-batches; "
            "it must return one generated micro-batch per prompt micro-batch, in order"
        )
    schedule = GenerationSchedule(len(block), num_iterations)
    for k in range(schedule.block):
        _, step, i = block[schedule.part(k)]
        ends = (i == len(step) - 1 and len(step) < accumulation) or (short and k == schedule.block - 1)
        yield _Micro(generated[schedule.part(k)], step, i, ends)


def _loop_micro_steps(
    prompt_stream: Iterable[Sequence[Any]],
    generate: Callable[[list[Any]], Sequence[Any]],
    steps_per_generation: int | None,
    optimizer_steps_per_generation: int | None,
    num_generations: int,
    num_iterations: int,
    accumulation: list[int],
) -> Iterator[_Micro]:
    block: list[tuple[Any, Any, int]] = []
    for step in prompt_stream:
        accumulation[:] = accumulation or [len(step)]  # micro-steps per optimizer step: the first prompt step's
        ga = accumulation[0]
        spg = steps_per_generation or optimizer_steps_per_generation * ga  # type: ignore[operator]
        for i, mb in enumerate(step):
            block.append((mb, step, i))
            if len(block) == spg:
                yield from _generation_micro_steps(block, generate, num_generations, num_iterations, ga, False)
                block = []
        if block and _realigns(step, ga, spg):
            yield from _generation_micro_steps(block, generate, num_generations, num_iterations, ga, True)
            block = []
    if block:
        yield from _generation_micro_steps(block, generate, num_generations, num_iterations, accumulation[0], True)


def generation_batches(
    prompt_stream: Iterable[Sequence[Any]],
    generate: Callable[[list[Any]], Sequence[Any]],
    optimizer_steps_per_generation: int | None = None,
    num_generations: int = 1,
    num_iterations: int = 1,
    *,
    steps_per_generation: int | None = None,
) -> Iterator[tuple[Any, ...]]:
    """Yield optimizer steps of generated data by TRL's schedule, calling ``generate`` once per generation.

    ``prompt_stream`` yields optimizer steps of prompt micro-batches (e.g. ``data.stream``); its first
    step's length is the accumulation. A generation gathers the next ``steps_per_generation`` prompt
    micro-batches (TRL's micro-steps; or ``optimizer_steps_per_generation`` × the accumulation), rows
    repeated ``num_generations`` times consecutively, calls ``generate(micro_batches)`` once on them (it
    returns one generated micro-batch per prompt micro-batch), and feeds ``num_iterations`` passes over
    them to the micro-steps (:class:`GenerationSchedule`), grouped into optimizer steps of the
    accumulation's size. ``generate`` runs only when the step that needs it is asked for, so it sees
    the state every earlier step made. Each step is a StepBatch with the cursor of its last micro-batch's
    prompt step and its micro-batches' prompt indices (not repeated), or a plain tuple when the prompt
    steps carry no cursor. Generations also end at each epoch end and where a step's cursor position is
    a multiple of the generation (so a stream resumed from a cursor re-forms the same generations); such
    a short generation ends its optimizer step, as does a short prompt step. Resume is bitwise from the
    end of a generation's last pass when the generation ends with a prompt step.

    >>> prompts = [[[1], [2]], [[3], [4]], [[5], [6]]]  # 3 steps of 2 micro-batches
    >>> out = list(generation_batches(prompts, lambda mbs: [[x * 10 for x in mb] for mb in mbs], 2, 2))
    >>> [list(step) for step in out]
    [[[10, 10], [20, 20]], [[30, 30], [40, 40]], [[50, 50], [60, 60]]]
    >>> out = generation_batches([[[1], [2]], [[3], [4]]], lambda mbs: mbs, steps_per_generation=1, num_iterations=2)
    >>> [list(step) for step in out]  # micro-step k trains on generation k // 2
    [[[1], [1]], [[2], [2]], [[3], [3]], [[4], [4]]]
    """
    _check_sizes(steps_per_generation, optimizer_steps_per_generation, num_generations, num_iterations)
    accumulation: list[int] = []
    micro: list[_Micro] = []
    for m in _loop_micro_steps(
        prompt_stream,
        generate,
        steps_per_generation,
        optimizer_steps_per_generation,
        num_generations,
        num_iterations,
        accumulation,
    ):
        micro.append(m)
        if len(micro) == accumulation[0] or m.ends_step:  # yield before the next generation is asked for
            yield _step_of(micro)
            micro = []
    if micro:
        yield _step_of(micro)


def _check_sizes(steps: int | None, optimizer_steps: int | None, num_generations: int, num_iterations: int) -> None:
    if (optimizer_steps is None) == (steps is None):
        raise TypeError(
            "generation_batches takes steps_per_generation (micro-steps, TRL's unit) or "
            "optimizer_steps_per_generation (steps_per_generation / accumulation), exactly one"
        )
    size = steps if steps is not None else optimizer_steps
    name = "steps_per_generation" if steps is not None else "optimizer_steps_per_generation"
    if not (size or 0) > 0 or num_generations <= 0 or num_iterations <= 0:
        raise ValueError(
            f"{name}={size}, num_generations={num_generations} and num_iterations={num_iterations} "
            "must be positive ints"
        )


def _step_of(micro: list[_Micro]) -> tuple[Any, ...]:
    batches, last = [m.batch for m in micro], micro[-1].step
    cursor = getattr(last, "cursor", None)
    if cursor is None:
        return tuple(batches)
    indices = [tuple(m.step.indices[m.index]) for m in micro if getattr(m.step, "indices", ())]
    return StepBatch(batches, cursor, indices)
