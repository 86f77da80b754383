"""The rollout-engine protocol: versioned weights in, seeded requests in, completions with log-probs out.

An engine generates with exactly one weight version at a time. ``publish(version, weights)`` is atomic (a
publish that fails midway leaves the engine on the old version); a request is generated with the version
published last before it was *submitted* (publishes and submits are handled in the order they were made,
whatever the timing), so a completion is a pure function of (weights of that version, prompt, sampling
spec, seed) — on the local and process engines also of the submit it came in, through float rounding only
(:mod:`trainfold.rollout.sampling` batches a submit's prompts of one length) — and records its version on
every token span. ``state_dict()`` holds what was submitted and not
yet polled, so a checkpoint can hold the generations in flight.

>>> spec = SamplingSpec(max_new_tokens=4, temperature=1.0, seed=7)
>>> req = RolloutRequest("r0", (1, 2, 3), spec)
>>> RolloutRequest.from_dict(req.to_dict()) == req
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor

__all__ = [
    "Completion",
    "EngineDied",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingSpec",
    "Weights",
    "check_requests",
    "gather_weights",
    "restored",
]

Weights = Iterable[tuple[str, Tensor]] | Mapping[str, Tensor]


class EngineDied(RuntimeError):
    """The generation process of an engine is gone; what was in flight there is lost.

    ``lost`` holds each lost request with the version it was submitted under: a new engine given that
    version regenerates them exactly (generation is deterministic).
    """

    def __init__(self, message: str, lost: Sequence[tuple[RolloutRequest, int]] = ()) -> None:
        super().__init__(message)
        self.lost = tuple(lost)


def _finite_prob(spec: SamplingSpec, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"SamplingSpec.top_p={value} must be in (0, 1] (1.0 keeps every token)")


@attrs.frozen
class SamplingSpec:
    """How one request is sampled: transformers' names; ``temperature=0`` is greedy; ``seed`` seeds its own
    generator (never the global RNG), so the same spec, prompt and weights give the same tokens."""

    max_new_tokens: int = attrs.field(validator=attrs.validators.ge(1))
    temperature: float = attrs.field(default=1.0, converter=float, validator=attrs.validators.ge(0.0))
    top_p: float = attrs.field(default=1.0, converter=float, validator=_finite_prob)
    top_k: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    seed: int = 0


@attrs.frozen
class RolloutRequest:
    """One prompt to complete: its ``request_id`` (unique among the open ones), token ids and sampling spec."""

    request_id: str
    prompt_ids: tuple[int, ...] = attrs.field(converter=lambda ids: tuple(int(i) for i in ids))
    spec: SamplingSpec

    def to_dict(self) -> dict[str, Any]:
        """Return the request as plain JSON values."""
        return {"request_id": self.request_id, "prompt_ids": list(self.prompt_ids), "spec": attrs.asdict(self.spec)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RolloutRequest:
        """Rebuild a request from :meth:`to_dict`'s values."""
        return cls(str(d["request_id"]), d["prompt_ids"], SamplingSpec(**d["spec"]))


@attrs.frozen(eq=False)
class Completion:
    """A finished request: its completion ids, each token's log-prob (float32, under the sampling
    temperature, the unfiltered distribution — what the trainer recomputes), ``version_spans`` as
    ``((version, first token offset), ...)`` in token order, and ``finish_reason`` (``"stop"`` at the end
    token, which it keeps, or ``"length"``)."""

    request: RolloutRequest
    completion_ids: tuple[int, ...]
    logps: Tensor
    version_spans: tuple[tuple[int, int], ...]
    finish_reason: str

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def token_versions(self) -> Tensor:
        """Return the weight version of each completion token (int64, one per token)."""
        out = torch.empty(len(self.completion_ids), dtype=torch.long)
        bounds = [offset for _, offset in self.version_spans[1:]] + [len(self.completion_ids)]
        for (version, start), end in zip(self.version_spans, bounds):
            out[start:end] = version
        return out

    def to_dict(self) -> dict[str, Any]:
        """Return JSON values and the log-probs tensor (what a checkpoint holds)."""
        return {
            "request": self.request.to_dict(),
            "completion_ids": list(self.completion_ids),
            "logps": self.logps,
            "version_spans": [list(s) for s in self.version_spans],
            "finish_reason": self.finish_reason,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Completion:
        """Rebuild a completion from :meth:`to_dict`'s values."""
        return cls(
            RolloutRequest.from_dict(d["request"]),
            tuple(int(i) for i in d["completion_ids"]),
            torch.as_tensor(d["logps"], dtype=torch.float32),
            tuple((int(v), int(o)) for v, o in d["version_spans"]),
            str(d["finish_reason"]),
        )

    def same_as(self, other: Completion) -> bool:
        """Whether two completions are bitwise the same (request, tokens, log-probs, versions)."""
        return (
            self.request == other.request
            and self.completion_ids == other.completion_ids
            and torch.equal(self.logps, other.logps)
            and self.version_spans == other.version_spans
            and self.finish_reason == other.finish_reason
        )


@runtime_checkable
class RolloutEngine(Protocol):
    """What a trainer needs from a generation engine (local, another process, vLLM).

    ``publish(version, weights)``: make ``weights`` (name → tensor, the model's ``state_dict`` names; all
    of them or a subset) the weights of the requests submitted from now on, tagged ``version``; atomic.
    ``submit(requests)``: queue requests (returns at once where the engine is asynchronous).
    ``poll(min_items=0, timeout_s=None)``: the completions finished so far, in submission order, waiting
    for at least ``min_items`` (``TimeoutError`` after ``timeout_s``; a synchronous engine never waits).
    ``state_dict()`` / ``load_state_dict()``: the requests submitted and not yet polled (JSON values and
    tensors). ``close()``: free the engine (idempotent). ``version``: the version
    published last (None before the first publish).
    """

    @property
    def version(self) -> int | None: ...

    def publish(self, version: int, weights: Weights) -> None: ...

    def submit(self, requests: Sequence[RolloutRequest]) -> None: ...

    def poll(self, min_items: int = 0, timeout_s: float | None = None) -> list[Completion]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def gather_weights(weights: Weights | Callable[[], Weights], copy: bool = True) -> list[tuple[str, Tensor]]:
    """Return ``weights`` as a list of (name, full CPU-or-device tensor), in one fixed-order pass.

    Sharded (FSDP2 ``DTensor``) weights are gathered here with ``full_tensor()`` — every collective of the
    publish runs in this pass, before any byte moves to the engine, so no trainer collective interleaves
    with the transfer (trl#7131, open-instruct#1649). Tensors are detached and, with ``copy`` (for an engine
    that keeps them), copied, so the optimizer changing the trainer's tensors afterwards cannot reach the
    engine; an engine whose publish returns only once the bytes are sent passes ``copy=False``.

    >>> import torch
    >>> [(n, t.tolist()) for n, t in gather_weights({"w": torch.ones(2)})]
    [('w', [1.0, 1.0])]
    """
    items = weights() if callable(weights) else weights
    pairs = items.items() if isinstance(items, Mapping) else items
    out = []
    for name, tensor in pairs:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out.append((str(name), full.detach().clone() if copy else full.detach()))
    return out


def check_requests(requests: Sequence[RolloutRequest], open_ids: Iterable[str], version: int | None) -> None:
    """Refuse a submit that no engine can serve: nothing published yet, or a request id already open."""
    if version is None:
        raise RuntimeError("submit before any publish: call engine.publish(version, weights) first")
    seen = set(open_ids)
    problems = []
    for r in requests:
        if not isinstance(r, RolloutRequest):
            problems.append(f"{r!r} is not a RolloutRequest")
        elif r.request_id in seen:
            problems.append(f"request id {r.request_id!r} is already open (poll it first or pick another id)")
        elif not r.prompt_ids:
            problems.append(f"request {r.request_id!r} has an empty prompt")
        else:
            seen.add(r.request_id)
    if problems:
        raise ValueError("; ".join(problems))


def restored(state: Mapping[str, Any], version: int | None) -> tuple[list[Completion], list[RolloutRequest]]:
    """Return a ``state_dict``'s unpolled completions and its pending requests (to submit again), refusing pending
    requests that need another weight version than ``version``, the engine's own."""
    done = [Completion.from_dict(d) for d in state["completions"]]
    pending = [(RolloutRequest.from_dict(p["request"]), int(p["version"])) for p in state.get("pending", [])]
    wrong = sorted({v for _, v in pending if v != version})
    if wrong:
        raise ValueError(f"pending requests need weight versions {wrong}; this engine is on {version}")
    return done, [r for r, _ in pending]
