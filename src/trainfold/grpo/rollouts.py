"""GRPO's generations on a rollout engine (``trainfold.rollout``): versioned weights, asynchronous with a bound.

Every generation of the run has a key (its seed, ``derive_seed(seed, epoch, number)``), the global step ``t``
that first trains on it, and a weight version: ``max(0, t - max_staleness)`` — a pure function of the schedule,
never of timing. :meth:`Rollouts.prefetch` runs at the start of each step ``v`` (the state holds version ``v``):
it submits every generation with ``t <= v + max_staleness`` not yet in flight, publishing the weights of its
version first, so with ``max_staleness >= 1`` the engine generates the next blocks while this step trains.
:meth:`Rollouts.complete` (the run's generation seam) then waits for the generation's completions.

A checkpoint holds what regenerates the generations in flight bitwise: the weights of the last
``max_staleness`` versions (``state.extras[PUBLISHED]``, their versions with them); the open requests are a
pure function of the cursor and the seed, so a resumed run resubmits exactly the requests an uninterrupted one
had in flight, on the same weights, and a completion is a pure function of (weights, prompt, spec, seed) and
of the submit it came in (the engines batch a submit's requests; the run resubmits each generation as it was).

``"local"`` is :class:`BatchedEngine`: a generation is sampled as one ``core.generate`` batch, as the run did
before engines, so ``rollout_engine="local", max_staleness=0`` is that run bitwise. The process engine samples
each request with its own seed (``derive_seed(key, row)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.forward import train_mode
from trainfold.core.generate import functional_forward, generate, token_logps
from trainfold.core.losses import logits_of
from trainfold.core.rng import derive_seed
from trainfold.grpo.args import RolloutPlan
from trainfold.grpo.data import Sampling
from trainfold.rollout.engine import (
    Completion,
    EngineDied,
    RolloutEngine,
    RolloutRequest,
    SamplingSpec,
    Weights,
    check_requests,
    gather_weights,
)
from trainfold.rollout.staleness import importance_sampling_ratio

__all__ = ["PUBLISHED", "BatchedEngine", "Rollouts", "published_template"]

PUBLISHED = "grpo_published"  # state.extras: the weights of the versions generations in flight were submitted with
MAX_RESTARTS = 2  # engines a run starts again after the one it had died


class BatchedEngine:
    """The in-process :class:`~trainfold.rollout.engine.RolloutEngine` of the GRPO run: consecutive requests of
    one ``submit`` with the same seed and spec are sampled as one ``core.generate`` batch with one generator
    (``torch.Generator().manual_seed(seed)``), as ``model.generate`` samples a batch; synchronous."""

    def __init__(
        self,
        model: nn.Module,
        buffers: Mapping[str, Tensor] | None = None,
        *,
        eos_token_id: int | None = None,
        pad_token_id: int = 0,
    ) -> None:
        self.model, self.buffers = model, buffers
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self._weights: dict[str, Tensor] = {}
        self._version: int | None = None
        self._done: list[Completion] = []

    @property
    def version(self) -> int | None:
        return self._version

    def publish(self, version: int, weights: Weights) -> None:
        self._weights = {**self._weights, **dict(gather_weights(weights))}  # a failing iterator changes nothing
        self._version = int(version)

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        check_requests(requests, (c.request_id for c in self._done), self._version)
        start = 0
        while start < len(requests):
            end = start + 1
            while end < len(requests) and requests[end].spec == requests[start].spec:
                end += 1
            self._done += self._batch(list(requests[start:end]))
            start = end

    @torch.no_grad()
    def _batch(self, requests: list[RolloutRequest]) -> list[Completion]:
        spec, version = requests[0].spec, int(self._version or 0)
        prompts = [list(r.prompt_ids) for r in requests]
        made = generate(
            self.model,
            self._weights,
            prompts,
            max_new_tokens=spec.max_new_tokens,
            temperature=spec.temperature,
            eos_token_id=self.eos_token_id,
            generator=torch.Generator().manual_seed(spec.seed),
            pad_token_id=self.pad_token_id,
            buffers=self.buffers,
        )
        out = []
        for request, prompt, ids in zip(requests, prompts, made):
            full = torch.tensor([prompt + list(ids)], dtype=torch.long)
            with train_mode(self.model, False):
                inputs = {"input_ids": full, "attention_mask": torch.ones_like(full)}
                logits = logits_of(functional_forward(self.model, self.buffers)(self._weights, inputs))
            logps = token_logps(logits, full, spec.temperature or 1.0)[0, len(prompt) - 1 :].float().cpu()
            stopped = bool(ids) and self.eos_token_id is not None and ids[-1] == self.eos_token_id
            out.append(Completion(request, tuple(ids), logps, ((version, 0),), "stop" if stopped else "length"))
        return out

    def poll(self, min_items: int = 0, timeout_s: float | None = None) -> list[Completion]:
        out, self._done = self._done, []
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"completions": [c.to_dict() for c in self._done], "pending": []}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._done = [Completion.from_dict(d) for d in state["completions"]]

    def close(self) -> None:
        self._done = []


def _sampling_metrics(old: Tensor, sampled: Tensor, mask: Tensor, ratio: Tensor) -> dict[str, Tensor]:
    """TRL's ``sampling/sampling_logp_difference/{mean,max}`` and ``sampling/importance_sampling_ratio/{min,mean,
    max}`` of one generation (token ratios over the completion tokens, sequence ratios over the completions)."""
    delta = (old - sampled).abs()
    delta = delta[mask & ~torch.isnan(delta)]
    flat = ratio.flatten() if ratio.shape[-1] == 1 else ratio[mask]
    zero = torch.tensor(0.0)

    def of(x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        return (fn(x) if x.numel() else zero).double()

    return {
        "sampling/sampling_logp_difference/mean": of(delta, torch.mean),
        "sampling/sampling_logp_difference/max": of(delta, torch.max),
        "sampling/importance_sampling_ratio/min": of(flat, torch.min),
        "sampling/importance_sampling_ratio/mean": of(flat, torch.mean),
        "sampling/importance_sampling_ratio/max": of(flat, torch.max),
    }


def published_template(params: Mapping[str, Tensor], max_staleness: int) -> dict[str, Any]:
    """Return ``state.extras[PUBLISHED]`` in the run's shapes: ``max_staleness`` weight copies and their versions."""
    return {
        "versions": torch.zeros(max_staleness, dtype=torch.long),
        "weights": tuple({k: torch.zeros_like(v) for k, v in params.items()} for _ in range(max_staleness)),
    }


@attrs.define(eq=False)
class Rollouts:
    """The run's engine and its generations in flight; ``make_engine(state)`` builds the engine on first use."""

    plan: RolloutPlan
    sampling: Sampling
    make_engine: Callable[[Any], RolloutEngine]
    engine: RolloutEngine | None = None
    last: list[Completion] = attrs.field(factory=list)  # the completions of the generation taken last
    restarts: int = 0  # engines started again after one died
    _open: dict[int, tuple[list[str], int, list[list[int]]]] = attrs.field(factory=dict)  # key -> ids, version, prompts
    _ready: dict[str, Completion] = attrs.field(factory=dict)

    def _engine(self, state: Any) -> RolloutEngine:
        if self.engine is None:
            self.engine = self.make_engine(state)
        return self.engine

    def version_of(self, first_step: int) -> int:
        """The weight version a generation first trained at global step ``first_step`` is sampled with."""
        return max(0, first_step - self.plan.max_staleness)

    def submit(self, state: Any, key: int, prompt_ids: Sequence[list[int]], version: int) -> None:
        """Submit one generation (its prompts in row order) with the weights of ``version``."""
        if key not in self._open:
            self._guarded(state, lambda: self._submit(state, key, prompt_ids, version))

    def _submit(self, state: Any, key: int, prompt_ids: Sequence[list[int]], version: int) -> None:
        engine = self._engine(state)
        if engine.version != version:
            engine.publish(version, self._weights(state, version))
        batched = isinstance(engine, BatchedEngine)
        s = self.sampling
        requests = [
            RolloutRequest(
                f"{key}.{row}",
                ids,
                SamplingSpec(s.max_completion_length, s.temperature, seed=key if batched else derive_seed(key, row)),
            )
            for row, ids in enumerate(prompt_ids)
        ]
        engine.submit(requests)
        self._open[key] = ([r.request_id for r in requests], version, [list(p) for p in prompt_ids])

    def _guarded(self, state: Any, action: Callable[[], Any]) -> Any:
        """Run ``action``; where the engine died, start a new one, resubmit every open generation (the same
        requests on the same weights: the same completions) and run it again, ``MAX_RESTARTS`` times a run."""
        while True:
            try:
                return action()
            except EngineDied as e:
                if self.restarts >= MAX_RESTARTS:
                    raise EngineDied(
                        f"the {self.plan.engine!r} rollout engine died {self.restarts + 1} times, the last at step "
                        f"{int(state.step)} ({e}); the run stops: resume it from its last checkpoint once the "
                        "generation process can run"
                    ) from e
                self.restarts += 1
                self._restart(state)

    def _restart(self, state: Any) -> None:
        opened = list(self._open.items())  # in submission order
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:  # the process is gone: nothing to free
                pass
        self.engine, self._open, self._ready = None, {}, {}
        for key, (_, version, prompt_ids) in opened:
            self._submit(state, key, prompt_ids, version)

    def _weights(self, state: Any, version: int) -> Mapping[str, Tensor]:
        if version == int(state.step):
            return state.params
        held = state.extras.get(PUBLISHED)
        versions = [] if held is None else held["versions"].tolist()
        if version not in versions:
            raise RuntimeError(
                f"generation needs the weights of version {version}, but the state (step {int(state.step)}) holds "
                f"versions {versions}: resume from a checkpoint of this run (it holds them)"
            )
        return held["weights"][versions.index(version)]

    def take(self, state: Any, key: int, prompt_ids: Sequence[list[int]]) -> list[Completion]:
        """Return generation ``key``'s completions in row order, waiting for them; submit it first (with the
        state's weights) where it is not in flight (a synchronous generation, an evaluation)."""
        self.submit(state, key, prompt_ids, int(state.step))
        self._guarded(state, lambda: self._wait(state, key))
        ids = self._open.pop(key)[0]
        self.last = [self._ready.pop(i) for i in ids]
        return self.last

    def published(self, state: Any) -> Any:
        """Return ``state`` holding the weights of the versions the next steps' generations in flight were
        submitted with: slot ``j`` holds version ``max(0, v - max_staleness + 1 + j)`` (``v`` = ``state.step``)."""
        s, v = self.plan.max_staleness, int(state.step)
        wanted = [max(0, v - s + 1 + j) for j in range(s)]
        weights = tuple(
            {k: t.detach().clone() for k, t in self._weights(state, u).items()} for u in wanted
        )  # copies: the step may change the state's tensors in place
        held = {"versions": torch.tensor(wanted, dtype=torch.long), "weights": weights}
        return attrs.evolve(state, extras={**state.extras, PUBLISHED: held})

    def annotate(self, buffer: Any, perm: Tensor, current: int) -> tuple[Any, dict[str, Tensor]]:
        """Return the generation ``buffer`` (rows in ``perm`` order) with each completion's weight version and,
        where the plan corrects, TRL's importance-sampling ratio of the trainer's ``old_logps`` to the engine's;
        and TRL's ``sampling/*`` metrics of it."""
        made = [self.last[i] for i in perm.tolist()]
        versions = torch.tensor([min(v for v, _ in c.version_spans) for c in made], dtype=torch.long)
        too_old = [(c.request_id, int(v)) for c, v in zip(made, versions) if current - int(v) > self.plan.max_staleness]
        if too_old:
            raise RuntimeError(
                f"completions {too_old[:4]} are older than max_staleness={self.plan.max_staleness} at version "
                f"{current}: the engine generated them with other weights than the schedule published"
            )
        out = attrs.evolve(buffer, versions=versions)
        if self.plan.correction is None:
            return out, {}
        rows, width = buffer.completion_ids.shape
        sampled = torch.zeros(rows, width)
        for row, c in enumerate(made):
            sampled[row, : len(c.completion_ids)] = c.logps[: len(c.completion_ids)]
        mask = (torch.arange(width)[None, :] < buffer.completion_length[:, None]).float()
        mode, low, high = self.plan.correction
        ratio = importance_sampling_ratio(buffer.old_logps, sampled, mask, mode, low, high)
        metrics = _sampling_metrics(buffer.old_logps, sampled, mask.bool(), ratio)
        return attrs.evolve(out, is_ratio=(ratio.expand(rows, width) * mask).contiguous()), metrics

    def _wait(self, state: Any, key: int) -> None:
        ids = self._open[key][0]
        while any(i not in self._ready for i in ids):
            got = self._engine(state).poll(min_items=1)
            if not got:
                raise RuntimeError(f"the rollout engine returned none of the open requests of generation {key}")
            self._ready.update((c.request_id, c) for c in got)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine, self._open, self._ready = None, {}, {}
