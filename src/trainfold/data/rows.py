"""Row helpers every TRL dataset format shares: whether a row is conversational, where a prompt ends.

SFT, DPO, KTO and reward rows all come as text or as message lists (``[{"role": ..., "content": ...}, ...]``);
their preparation (``trainfold.sft.data``, ``trainfold.dpo.data``, ``trainfold.kto.rows``) asks the same two
questions of them; paired rows without a prompt (DPO's, KTO's) split it off as TRL does. Their collators
refuse an empty batch or an item without its columns the same way (:func:`check_items`).

>>> is_conversational({"prompt": [{"role": "user", "content": "hi"}]}), common_prefix([1, 2], [1, 3])
(True, 1)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["check_items", "common_prefix", "implicit_prompt", "is_conversational"]

_TEXT_KEYS = ("messages", "prompt", "completion")


def is_conversational(row: Mapping[str, Any]) -> bool:
    """Return whether ``row`` holds message lists (``[{"role": ..., "content": ...}, ...]``), as TRL decides.

    >>> is_conversational({"messages": [{"role": "user", "content": "hi"}]}), is_conversational({"text": "hi"})
    (True, False)
    """
    for key in _TEXT_KEYS:
        value = row.get(key)
        if isinstance(value, list) and value and isinstance(value[0], Mapping) and "role" in value[0]:
            return True
    return False


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Return how many leading token ids ``a`` and ``b`` share (where a tokenized prompt meets its completion).

    >>> common_prefix([1, 2, 3], [1, 2, 4, 5])
    2
    """
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def implicit_prompt(chosen: Any, rejected: Any) -> dict[str, Any]:
    """Return ``prompt``, ``chosen`` and ``rejected`` split off two full texts or conversations as TRL 1.16 splits
    rows without a prompt: the prompt is what they share up to the first differing character or message (a space
    right before that character stays with the completions).

    >>> implicit_prompt("Sky? It is blue.", "Sky? It is green.")
    {'prompt': 'Sky? It is', 'chosen': ' blue.', 'rejected': ' green.'}
    """
    n = min(len(chosen), len(rejected))
    cut = next((i for i in range(n) if chosen[i] != rejected[i]), None)
    if cut is None:  # one is the start of the other: TRL's loop ends at the last shared index
        cut = max(n - 1, 0)
    elif cut > 0 and chosen[cut - 1] == " ":
        cut -= 1
    return {"prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[cut:]}


def check_items(
    items: Sequence[Mapping[str, Any]], columns: Sequence[str], what: str, fix: Callable[[Mapping[str, Any]], str]
) -> None:
    """Refuse an empty batch of ``what`` items, or one that lacks any of ``columns``: the error names the item, what
    it lacks and has, and ``fix(item)``.

    >>> check_items([{"a": 1}, {"b": 2}], ["a"], "row", lambda item: "give a")
    Traceback (most recent call last):
    KeyError: "row 1 lacks ['a'] (has ['b']); give a"
    """
    if not items:
        raise ValueError(f"cannot collate an empty list of {what}s")
    for i, item in enumerate(items):
        missing = [k for k in columns if k not in item]
        if missing:
            raise KeyError(f"{what} {i} lacks {missing} (has {sorted(item)}); {fix(item)}")
