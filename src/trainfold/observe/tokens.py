"""The running input-token count (HF's ``include_num_input_tokens_seen``) in ``state.extras[TOKENS_SEEN]``.

>>> TOKENS_SEEN
'num_input_tokens_seen'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from trainfold.core.state import TrainState

__all__ = ["TOKENS_SEEN", "TOKEN_COUNTS", "counting_input_tokens"]

TOKENS_SEEN = "num_input_tokens_seen"  # the key of the running input-token count in state.extras
TOKEN_COUNTS = ("all", "non_padding")  # what counting_input_tokens counts


def counting_input_tokens(
    step: Callable[[TrainState, Any], TrainState],
    mode: str = "all",
    input_name: str = "input_ids",
    collective: Any = None,
) -> Callable[[TrainState, Any], TrainState]:
    """Return ``step`` that also adds the batch's input tokens to ``state.extras[TOKENS_SEEN]`` (HF's
    ``include_num_input_tokens_seen``): every token (``"all"``) or the attention mask's ones
    (``"non_padding"``), summed over ranks. The count lives in the state, so it resumes exactly;
    put ``TOKENS_SEEN: scalar(0)`` in the first state's extras (``initial_extras(tokens_seen=True)``).

    >>> from trainfold.core.state import TrainState, scalar
    >>> s = TrainState(params={}, buffers={}, opt_state=None, extras={TOKENS_SEEN: scalar(0)})
    >>> counted = counting_input_tokens(lambda state, batch: state, "non_padding")
    >>> batch = [{"input_ids": torch.ones(2, 3), "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}]
    >>> int(counted(s, batch).extras[TOKENS_SEEN])
    3
    """
    if mode not in TOKEN_COUNTS:
        raise ValueError(f"mode={mode!r} must be 'all' or 'non_padding'")

    def tokens(micro: Mapping[str, Any]) -> int:
        if mode == "non_padding" and "attention_mask" in micro:
            return int(micro["attention_mask"].sum())
        if input_name not in micro:
            raise KeyError(
                f"cannot count input tokens: the micro-batch has no {input_name!r} (keys: {sorted(micro)}); "
                "set model_input_name, or include_num_input_tokens_seen='no'"
            )
        return micro[input_name].numel()

    def counted(state: TrainState, batch: Any) -> TrainState:
        new = step(state, batch)
        seen = torch.tensor(sum(tokens(mb) for mb in batch), dtype=torch.int64)
        if collective is not None:
            collective.sum_([seen])
        return attrs.evolve(new, extras={**new.extras, TOKENS_SEEN: state.extras[TOKENS_SEEN] + seen})

    return counted
