"""The in-process engine: synchronous, ``core.generate``'s sampling on a private copy of the published weights.

>>> import torch
>>> from trainfold.core.models import TinyLM, TinyLMConfig
>>> _ = torch.manual_seed(0)
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=16))
>>> engine = LocalEngine(model)
>>> engine.publish(0, model.state_dict())
>>> from trainfold.rollout.engine import RolloutRequest, SamplingSpec
>>> engine.submit([RolloutRequest("a", [1, 2], SamplingSpec(max_new_tokens=3, seed=1))])
>>> [(c.request_id, len(c.completion_ids), c.version_spans) for c in engine.poll()]
[('a', 3, ((0, 0),))]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from trainfold.rollout.engine import (
    Completion,
    RolloutRequest,
    Weights,
    check_requests,
    gather_weights,
    restored,
)
from trainfold.rollout.sampling import complete_all

__all__ = ["LocalEngine", "check_weights"]


def check_weights(expected: Mapping[str, Tensor], pairs: Sequence[tuple[str, Tensor]]) -> None:
    """Refuse weights the model does not have, or of another shape or dtype (all problems at once)."""
    problems = []
    for name, t in pairs:
        if name not in expected:
            problems.append(f"unknown weight {name!r}")
        elif tuple(t.shape) != tuple(expected[name].shape) or t.dtype != expected[name].dtype:
            problems.append(
                f"{name!r} is {tuple(t.shape)} {t.dtype}, the model's is "
                f"{tuple(expected[name].shape)} {expected[name].dtype}"
            )
    if problems:
        raise ValueError(
            "publish refused, the engine keeps its version: " + "; ".join(problems)
            + " (publish the model's state_dict names, shapes and dtypes)"
        )  # fmt: skip


class LocalEngine:
    """A :class:`~trainfold.rollout.engine.RolloutEngine` in this process; a submission is generated when
    submitted, with the version published last, its requests of one prompt length as one batch
    (:func:`trainfold.rollout.sampling.complete_all`, as the process engine). ``eos_token_id`` ends a
    completion (kept); ``pad_token_id`` pads nothing (batches are unpadded), kept for the engines' signature."""

    def __init__(self, model: nn.Module, *, eos_token_id: int | None = None, pad_token_id: int = 0) -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self._weights: dict[str, Tensor] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._version: int | None = None
        self._done: list[Completion] = []

    @property
    def version(self) -> int | None:
        return self._version

    def publish(self, version: int, weights: Weights) -> None:
        pairs = gather_weights(weights)  # a failing iterator raises here: nothing has changed
        check_weights(self._weights, pairs)
        self._weights = {**self._weights, **dict(pairs)}
        self._version = int(version)

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        if not requests:
            return
        check_requests(requests, (c.request_id for c in self._done), self._version)
        assert self._version is not None
        # a batch that raises raises BatchFailed (a RuntimeError naming its requests); nothing is kept
        self._done += complete_all(self.model, self._weights, requests, self._version, eos_token_id=self.eos_token_id)

    def poll(self, min_items: int = 0, timeout_s: float | None = None) -> list[Completion]:
        if min_items > len(self._done):
            raise ValueError(f"poll(min_items={min_items}) but only {len(self._done)} requests are open")
        out, self._done = self._done, []
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"completions": [c.to_dict() for c in self._done], "pending": []}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._done, pending = restored(state, self._version)
        self.submit(pending)

    def close(self) -> None:
        self._done = []
