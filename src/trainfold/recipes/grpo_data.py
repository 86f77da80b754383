"""GRPO's data: optimizer steps of generated completions, one ``generate`` call per block of prompt steps.

:func:`generation_batches` turns a prompt stream (``trainfold.data.stream``) into the steps a GRPO
run trains on, keeping each prompt step's cursor so a resumed run re-forms the same blocks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor

from trainfold.data import StepBatch

__all__ = ["generation_batches"]


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


def _block_ends(step: Any, filled: int, optimizer_steps_per_generation: int) -> bool:
    cursor = getattr(step, "cursor", None)
    if cursor is None:
        return filled == optimizer_steps_per_generation
    return filled == optimizer_steps_per_generation or int(cursor.position) % optimizer_steps_per_generation == 0


def generation_batches(
    prompt_stream: Iterable[Sequence[Any]],
    generate: Callable[[list[Any]], Sequence[Any]],
    optimizer_steps_per_generation: int,
    num_generations: int = 1,
    num_iterations: int = 1,
) -> Iterator[tuple[Any, ...]]:
    """Yield optimizer steps of generated data, calling ``generate`` once per block of steps.

    A block gathers the prompt micro-batches of ``optimizer_steps_per_generation`` steps of
    ``prompt_stream`` (rows repeated ``num_generations`` times, consecutively), calls
    ``generate(micro_batches)`` once on all of them, which returns one generated micro-batch per
    prompt micro-batch, and yields the result split back into the block's steps: a StepBatch
    with the prompt step's cursor and indices (prompt indices, not repeated), or a plain tuple
    when the prompt steps carry no cursor. Blocks end where a step's cursor position is a multiple of
    ``optimizer_steps_per_generation`` and at each epoch end, so a resumed stream re-forms the same blocks
    from the next boundary; the last block may be shorter. With ``num_iterations`` > 1 each block's
    steps are yielded that many times over, in the same order (TRL's ``num_iterations``); every
    pass carries the prompt steps' cursors, so a stream resumed from a step's cursor continues after
    it: resume bitwise from the end of a block's last pass.

    >>> prompts = [[[1], [2]], [[3], [4]], [[5], [6]]]  # 3 steps of 2 micro-batches
    >>> out = list(generation_batches(prompts, lambda mbs: [[x * 10 for x in mb] for mb in mbs], 2, 2))
    >>> [list(step) for step in out]
    [[[10, 10], [20, 20]], [[30, 30], [40, 40]], [[50, 50], [60, 60]]]
    """
    if optimizer_steps_per_generation <= 0 or num_generations <= 0 or num_iterations <= 0:
        raise ValueError(
            f"optimizer_steps_per_generation={optimizer_steps_per_generation}, num_generations={num_generations} and "
            f"num_iterations={num_iterations} must be positive ints"
        )
    block: list[Any] = []
    for step in prompt_stream:
        block.append(step)
        if _block_ends(step, len(block), optimizer_steps_per_generation):
            yield from _generate_block(block, generate, num_generations, num_iterations)
            block = []
    if block:
        yield from _generate_block(block, generate, num_generations, num_iterations)


def _generate_block(
    block: list[Any], generate: Callable[[list[Any]], Sequence[Any]], num_generations: int, num_iterations: int = 1
) -> Iterator[tuple[Any, ...]]:
    prompts = [_repeat_rows(mb, num_generations) for step in block for mb in step]
    generated = list(generate(prompts))
    if len(generated) != len(prompts):
        raise ValueError(
            f"generate returned {len(generated)} micro-batches for {len(prompts)} prompt micro-batches; "
            "it must return one generated micro-batch per prompt micro-batch, in order"
        )
    steps, start = [], 0
    for step in block:
        micro = generated[start : start + len(step)]
        cursor = getattr(step, "cursor", None)
        steps.append(tuple(micro) if cursor is None else StepBatch(micro, cursor, getattr(step, "indices", ())))
        start += len(step)
    for _ in range(num_iterations):
        yield from steps
