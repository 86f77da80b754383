"""The GRPO run's generation schedule (TRL 1.16's ``GRPOTrainer``) as a :class:`~trainfold.data.StateStream`.

* prompts are drawn in TRL's ``RepeatSampler`` order (``grpo_args.generation_order``): each
  generation takes ``generation_batch / num_generations`` distinct prompts, each repeated
  ``num_generations`` times, every repeat its own copy (a reward function may change one);
* micro-step ``k`` (counted within the epoch) follows the GRPO core's schedule
  (``trainfold.grpo.data.schedule_step``): it generates when
  ``k % (steps_per_generation × num_iterations) == 0``, with the state the step starts from,
  shuffles the generation's rows (seeded), and trains on slice ``k % steps_per_generation`` of it,
  as ``_prepare_inputs`` does;
* the generation lives in the state (``state.extras[BUFFER]``, a :class:`GenerationBuffer` of
  fixed shapes), so a checkpoint taken inside a generation block resumes bitwise;
* each step that generated logs TRL's metrics of its generations (``grpo_metrics``).

Sampling is seeded from ``(args.seed, epoch, generation)``, never from global RNG state, unless
``generation_rng="global"``: then it draws from torch's global generator in TRL's order
(``trainfold.grpo.global_rng``). Completions are
sampled at one seam, :meth:`GRPORun.complete` (state + prompt ids -> completion ids); the sampling policy's
old log-probs are scored once per generation (``GRPORun.generation``).

The research loop is this stream too: ``trainfold.loop.run(step, state, run.stream(), hooks=...)``.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from trainfold.core.forward import train_mode
from trainfold.core.generate import before_eos, functional_forward, generate
from trainfold.core.rng import derive_seed
from trainfold.core.state import METRIC_KEYS, Cursor, TrainState, scalar
from trainfold.data import StateStream, StepBatch
from trainfold.grpo.args import GRPOArguments, RolloutPlan, generation_order
from trainfold.grpo.data import Sampling, schedule_step
from trainfold.grpo.global_rng import global_completions, loader_draw, shuffled_rows
from trainfold.grpo.metrics import generation_metrics
from trainfold.grpo.objective import completion_rows, gather_completions, next_token_logps, spread_completions
from trainfold.grpo.rewards import RewardFunc, combine_rewards, reward_advantages, reward_name
from trainfold.grpo.rollouts import PUBLISHED, Rollouts, published_template

__all__ = ["BUFFER", "Codec", "GenerationBuffer", "GRPORun", "empty_buffer"]

BUFFER = "grpo_generation"  # the key of the generation buffer in state.extras
_GENERATE, _SHUFFLE, _EVAL = 0x6E6E, 0x5348, 0xE7A1
_IS_RATIO = "importance_sampling_ratio"  # TRL's name, the micro-batch's per-token weight of the policy loss


@attrs.frozen
class Codec:
    """How prompts become token ids and sampled ids become completions: ``encode``, ``decode`` and the eos and
    pad ids (``pad_token_id`` None: the eos id, else 0).

    >>> codec = Codec(lambda s: [1 + int(c) for c in s], lambda ids: "".join(str(i - 1) for i in ids), eos_token_id=0)
    >>> codec.encode("12"), codec.decode([2, 3]), codec.pad
    ([2, 3], '12', 0)
    """

    encode: Callable[[Any], list[int]]
    decode: Callable[[list[int]], Any]
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @property
    def pad(self) -> int:
        """The id completions are padded with."""
        return self.pad_token_id if self.pad_token_id is not None else (self.eos_token_id or 0)

    @classmethod
    def of(cls, tokenizer: Any) -> Codec:
        """Return a transformers tokenizer's codec: a conversational prompt through its chat template (with the
        generation prompt), no special tokens added, special tokens skipped when decoding."""

        def encode(prompt: Any) -> list[int]:
            if not isinstance(prompt, str):
                prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])

        def decode(ids: list[int]) -> Any:
            return tokenizer.decode(ids, skip_special_tokens=True)

        return cls(encode, decode, tokenizer.eos_token_id, tokenizer.pad_token_id)


@attrs.frozen(eq=False)
class GenerationBuffer:
    """One generation, in fixed shapes: ``rows = generation_batch``, ``width = max_completion_length``.

    Rows are in training order (shuffled). ``prompt_index`` names each row's prompt in the dataset
    (its tokens are encoded again), ``completion_ids``/``completion_length`` the sampled tokens,
    ``tokens`` the generation's completion tokens (dapo's normaliser); ``old_logps`` and
    ``ref_logps`` hold log-probs at completion positions when the run keeps them.
    """

    prompt_index: Tensor
    completion_ids: Tensor
    completion_length: Tensor
    advantages: Tensor
    tokens: Tensor
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    versions: Tensor | None = None  # each completion's weight version (a rollout engine's runs)
    is_ratio: Tensor | None = None  # TRL's importance-sampling ratio at completion positions


def empty_buffer(
    rows: int, width: int, old: bool, ref: bool, versions: bool = False, is_ratio: bool = False
) -> GenerationBuffer:
    """Return a buffer of zeros in the run's shapes: the template a checkpoint loads into."""
    return GenerationBuffer(
        torch.zeros(rows, dtype=torch.long),
        torch.zeros(rows, width, dtype=torch.long),
        torch.zeros(rows, dtype=torch.long),
        torch.zeros(rows),
        scalar(0),
        torch.zeros(rows, width) if old else None,
        torch.zeros(rows, width) if ref else None,
        torch.zeros(rows, dtype=torch.long) if versions else None,
        torch.zeros(rows, width) if is_ratio else None,
    )


@attrs.frozen
class _Step:
    """One optimizer step of the stream: its epoch's generations, its micro-steps, the cursor after it."""

    epoch: int
    micro_steps: tuple[int, ...]
    order: tuple[tuple[int, ...], ...]
    cursor: Cursor


@attrs.frozen(eq=False)
class GRPORun:
    """What a GRPO run closes over; ``stream()`` is its :class:`~trainfold.data.StateStream`."""

    model: nn.Module
    args: GRPOArguments
    prompts: Any
    reward_funcs: tuple[RewardFunc, ...]
    codec: Codec
    sampling: Sampling  # GRPOArguments.sampling: what one generation is
    objective: Any  # grpo_objective from args: the run's loss, and eval_loss
    prompt_key: str = "prompt"
    ref_params: Mapping[str, Tensor] | None = None  # the KL's reference (beta > 0)
    eval_prompts: Any = None
    processing_class: Any = None  # the tokenizer (checkpoints hold it), when the run has one
    rollouts: Rollouts | None = None  # the rollout engine (None: generate in the step, without an engine)
    _encoded: dict[int, list[int]] = attrs.field(factory=dict)  # prompt index -> its tokens (encode is pure)

    @property
    def names(self) -> list[str]:
        return [reward_name(fn) for fn in self.reward_funcs]

    @property
    def block(self) -> int:
        """Micro-steps per generation block (TRL's ``generate_every``)."""
        return self.args.generation_schedule.block

    def order(self, epoch: int) -> tuple[tuple[int, ...], ...]:
        a = self.args
        return tuple(
            tuple(c)
            for c in generation_order(
                len(self.prompts), a.prompts_per_generation, seed=a.seed, epoch=epoch, shuffle=a.shuffle_dataset
            )
        )

    def micro_steps_per_epoch(self) -> int:
        return len(self.order(0)) * self.block

    def steps_per_epoch(self) -> int:
        return math.ceil(self.micro_steps_per_epoch() / self.args.gradient_accumulation_steps)

    def steps(self, cursor: Cursor) -> Iterator[_Step]:
        """Yield the optimizer steps from ``cursor`` on, epoch after epoch."""
        epoch, position = cursor.as_tuple()
        ga, total = self.args.gradient_accumulation_steps, self.micro_steps_per_epoch()
        per_epoch = self.steps_per_epoch()
        while True:
            order = self.order(epoch)
            for p in range(position, per_epoch):
                done = p + 1 == per_epoch
                after = Cursor(scalar(epoch + 1), scalar(0)) if done else Cursor(scalar(epoch), scalar(p + 1))
                yield _Step(epoch, tuple(range(p * ga, min((p + 1) * ga, total))), order, after)
            epoch, position = epoch + 1, 0

    def prompt_ids(self, index: int) -> list[int]:
        if index not in self._encoded:
            self._encoded[index] = list(self.codec.encode(self.prompts[index][self.prompt_key]))
        return self._encoded[index]

    def _logps(
        self,
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        rows: Mapping[str, Tensor],
        device: torch.device,
    ) -> Tensor:
        b, out = self.args.per_device_train_batch_size, []
        with torch.no_grad(), train_mode(self.model, False):
            for start in range(0, rows["input_ids"].shape[0], b):  # as TRL: per_device_train_batch_size rows at once
                inputs = {k: rows[k][start : start + b].to(device) for k in ("input_ids", "attention_mask")}
                out.append(
                    next_token_logps(
                        functional_forward(self.model, buffers), params, inputs, None, 0, self.args.temperature
                    ).cpu()
                )
        return torch.cat(out)

    def trainer_state(self, state: TrainState) -> Any:
        """Return TRL's ``trainer_state`` keyword of the reward functions: a ``transformers.TrainerState`` holding
        the run's counters when ``state`` is the state a step starts from (``global_step``: steps done, ``epoch``,
        ``max_steps``, ``num_train_epochs``, the logging/eval/save intervals); its ``log_history`` is empty."""
        a, per_epoch = self.args, self.steps_per_epoch()
        total = a.max_steps if a.max_steps > 0 else math.ceil(a.num_train_epochs * per_epoch)
        epoch, position = state.cursor.as_tuple()
        fields: dict[str, Any] = dict(
            epoch=epoch + position / per_epoch,
            global_step=int(state.step),
            max_steps=total,
            num_train_epochs=-(-total // per_epoch),
            logging_steps=a.logging_steps,
            eval_steps=a.eval_steps or 0,
            save_steps=a.save_steps,
            train_batch_size=a.per_device_train_batch_size,
        )
        try:
            import transformers
        except ImportError:  # the same fields, by attribute
            return types.SimpleNamespace(**fields, log_history=[])
        return transformers.TrainerState(**fields)

    def sample(
        self,
        state: TrainState,
        dataset: Any,
        indices: Sequence[int],
        key: int,
        encoded: Callable[[int], list[int]],
        training: bool = True,
    ) -> dict[str, Any]:
        """Generate ``num_generations`` completions of each prompt, score them; return rows and metrics.

        The reward functions get TRL's keywords besides the columns: ``trainer_state`` (:meth:`trainer_state`),
        ``log_metric(name, value)`` (logged as ``name``, the mean of a generation's values, as TRL's) and
        ``log_extra(column, values)`` (columns of TRL's completions table, which trainfold does not write: taken,
        unused, as TRL without ``log_completions``)."""
        a, g = self.sampling, self.sampling.num_generations
        index = [i for i in indices for _ in range(g)]
        prompt_ids = [encoded(i) for i in index]  # before a reward function sees (and may change) the rows
        rows = [copy.deepcopy(dataset[i]) for i in index]  # each repeat its own object
        prompts = [r[self.prompt_key] for r in rows]
        logged: dict[str, list[float]] = {}
        columns: dict[str, Any] = {k: [r[k] for r in rows] for k in rows[0] if k != self.prompt_key}
        columns |= {
            "trainer_state": self.trainer_state(state),
            "log_metric": lambda name, value: logged.setdefault(name, []).append(float(value)),
            "log_extra": lambda column, values: None,
        }
        completion_ids, eos = self.complete(state, prompt_ids, key, training), self.codec.eos_token_id
        completions = [self.codec.decode(before_eos(c, eos)) for c in completion_ids]
        columns["completion_ids"] = [list(c) for c in completion_ids]  # as TRL's
        _, each = combine_rewards(self.reward_funcs, prompts, completions, columns, a.reward_weights)
        advantages = reward_advantages(each, g, a.reward_weights, a.scale_rewards, a.multi_objective_aggregation)
        truncated = torch.tensor([c[-1] not in (eos, self.codec.pad) for c in completion_ids])
        metrics = generation_metrics(
            each,
            self.names,
            g,
            torch.tensor([len(c) for c in completion_ids]),
            truncated,
            a.reward_weights,
            a.scale_rewards,
        )
        for name, values in logged.items():  # TRL's mean: a float32 sum over a count
            metrics[name] = torch.tensor(float(torch.tensor(sum(values))) / len(values), dtype=torch.float64)
        return {
            "index": index,
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "metrics": metrics,
            "advantages": advantages,
        }

    def complete(
        self, state: TrainState, prompt_ids: Sequence[list[int]], seed: int, training: bool = True
    ) -> list[list[int]]:
        """Return a completion of each prompt sampled with ``state.params`` (the generator seeded with ``seed``, or
        the global one: ``generation_rng="global"``): the seam where generation happens."""
        if self.sampling.rng == "global":
            c = self.codec
            return global_completions(self.model, state, prompt_ids, self.sampling, c.eos_token_id, c.pad, training)
        if self.rollouts is not None:
            return [list(c.completion_ids) for c in self.rollouts.take(state, seed, prompt_ids)]
        return generate(
            self.model,
            state.params,
            prompt_ids,
            max_new_tokens=self.sampling.max_completion_length,
            temperature=self.sampling.temperature,
            eos_token_id=self.codec.eos_token_id,
            generator=torch.Generator().manual_seed(seed),
            pad_token_id=self.codec.pad,
            buffers=state.buffers,
        )

    def generation(
        self, state: TrainState, epoch: int, number: int, indices: Sequence[int]
    ) -> tuple[GenerationBuffer, dict[str, Tensor]]:
        """Return generation ``number`` of ``epoch`` as a buffer (rows shuffled, seeded), and its metrics."""
        a, seed = self.args, int(state.seed)
        out = self.sample(state, self.prompts, indices, derive_seed(seed, epoch, number, _GENERATE), self.prompt_ids)
        rows = len(out["index"])
        keyed = torch.Generator().manual_seed(derive_seed(seed, epoch, number, _SHUFFLE))
        perm = shuffled_rows(rows) if self.sampling.rng == "global" else torch.randperm(rows, generator=keyed)
        order = perm.tolist()
        prompt_ids = [out["prompt_ids"][i] for i in order]
        completion_ids = [out["completion_ids"][i] for i in order]
        lengths = [len(c) for c in completion_ids]
        width = a.max_completion_length
        padded = torch.full((rows, width), self.codec.pad, dtype=torch.long)
        for row, c in enumerate(completion_ids):
            padded[row, : len(c)] = torch.tensor(c, dtype=torch.long)
        batch = completion_rows(prompt_ids, completion_ids, self.codec.pad)
        device = next(iter(state.params.values())).device
        plens = [len(p) for p in prompt_ids]

        def logps(params: Mapping[str, Tensor]) -> Tensor:
            return gather_completions(self._logps(params, state.buffers, batch, device), plens, lengths, width)

        buffer = GenerationBuffer(
            prompt_index=torch.tensor(out["index"], dtype=torch.long)[perm],
            completion_ids=padded,
            completion_length=torch.tensor(lengths, dtype=torch.long),
            advantages=out["advantages"][perm].float(),
            tokens=scalar(sum(lengths)),
            old_logps=logps(state.params) if a.records_old_logps else None,
            ref_logps=None if self.ref_params is None else logps({k: v.to(device) for k, v in self.ref_params.items()}),
        )
        if self.rollouts is not None and _annotated(self.rollouts.plan):
            buffer, sampling = self.rollouts.annotate(buffer, perm, int(state.step))
            return buffer, {**out["metrics"], **sampling}
        return buffer, out["metrics"]

    def micro_batch(
        self, buffer: GenerationBuffer, part: int, step_micro_batches: int, device: torch.device
    ) -> dict[str, Tensor]:
        """Return slice ``part`` of the buffer as a training micro-batch (``per_device_train_batch_size`` rows)."""
        b = self.args.per_device_train_batch_size
        rows = slice(part * b, (part + 1) * b)
        index, lengths = buffer.prompt_index[rows].tolist(), buffer.completion_length[rows].tolist()
        prompt_ids = [self.prompt_ids(i) for i in index]
        completions = [c[:n].tolist() for c, n in zip(buffer.completion_ids[rows], lengths)]
        mb = completion_rows(prompt_ids, completions, self.codec.pad)
        width, plens = mb["input_ids"].shape[1] - 1, [len(p) for p in prompt_ids]
        mb.update(
            advantages=buffer.advantages[rows],
            generation_tokens=buffer.tokens.expand(b).clone(),
            generation_micro_batches=torch.full((b,), self.args.generation_steps),
            step_micro_batches=torch.full((b,), step_micro_batches),
        )
        for name, key in (("old_logps", "old_logps"), ("ref_logps", "ref_logps"), ("is_ratio", _IS_RATIO)):
            if getattr(buffer, name) is not None:
                mb[key] = spread_completions(getattr(buffer, name)[rows], plens, lengths, width)
        return {k: v.to(device) for k, v in mb.items()}

    def prepare(self, state: TrainState, step: _Step) -> tuple[TrainState, StepBatch]:
        """Return the state holding the step's generation buffer, and the step's micro-batches."""
        device, made = next(iter(state.params.values())).device, []
        size = len(step.micro_steps)

        def generate(number: int) -> GenerationBuffer:
            buffer, metrics = self.generation(state, step.epoch, number, step.order[number])
            made.append(metrics)
            return buffer

        def part(buffer: GenerationBuffer, index: int) -> dict[str, Tensor]:
            return self.micro_batch(buffer, index, size, device)

        self._prefetch(state)
        if self.sampling.rng == "global" and step.micro_steps[0] == 0:
            loader_draw()  # HF's loop starts iterating the epoch's loader
        schedule = self.args.generation_schedule
        buffer, micro, _ = schedule_step(schedule, state.extras[BUFFER], step.micro_steps, generate, part)
        # the last generation's metrics (built-in, and the reward functions' log_metric) end here; the step
        # writes its own again
        metrics = {k: v for k, v in state.metrics.items() if k in METRIC_KEYS}
        if made:  # logged with the step that generated, as TRL logs them with the generation
            metrics.update(_means(made))
        if self.rollouts is not None and self.rollouts.plan.max_staleness > 0:
            state = self.rollouts.published(state)  # the weights the generations in flight after this step need
        state = attrs.evolve(state, metrics=metrics, extras={**state.extras, BUFFER: buffer})
        return state, StepBatch(micro, step.cursor)

    def _prefetch(self, state: TrainState) -> None:
        """Submit the generations of the next ``max_staleness`` steps, each with the weights of its version
        (``trainfold.grpo.rollouts``); nothing when on-policy."""
        r = self.rollouts
        if r is None or r.plan.max_staleness == 0:
            return
        v, schedule, g = int(state.step), self.args.generation_schedule, self.sampling.num_generations
        for ahead, item in enumerate(itertools.islice(self.steps(state.cursor), r.plan.max_staleness + 1)):
            for n in sorted({schedule.generation(k) for k in item.micro_steps if schedule.generates(k)}):
                key = derive_seed(int(state.seed), item.epoch, n, _GENERATE)
                prompt_ids = [self.prompt_ids(i) for i in item.order[n] for _ in range(g)]
                r.submit(state, key, prompt_ids, r.version_of(v + ahead))

    def _eval_loss(self, state: TrainState, out: Mapping[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """Return the objective and its metrics on one eval batch, as TRL's evaluation: on-policy, not split or
        accumulated."""
        device = next(iter(state.params.values())).device
        mb = completion_rows(out["prompt_ids"], out["completion_ids"], self.codec.pad)
        rows = mb["input_ids"].shape[0]
        mb.update(
            advantages=out["advantages"],
            generation_tokens=mb["completion_mask"].sum().expand(rows).clone(),
            generation_micro_batches=torch.ones(rows),
            step_micro_batches=torch.ones(rows),
        )
        if self.ref_params is not None:
            mb["ref_logps"] = self._logps(
                {k: v.to(device) for k, v in self.ref_params.items()}, state.buffers, mb, device
            )
        mb = {k: v.to(device) for k, v in mb.items()}
        with torch.no_grad(), train_mode(self.model, False):
            loss, aux = self.objective(
                functional_forward(self.model, state.buffers), state.params, mb, self.objective.count_items(mb)
            )
        return loss.cpu(), {k: v.cpu() for k, v in aux.items()}

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """Return ``eval_loss`` and TRL's generation metrics on the eval prompts, averaged over eval batches (the
        prompts in TRL's eval order: a fresh ``RepeatSampler`` seeded with ``args.seed`` at each evaluation)."""
        n, per = len(self.eval_prompts), max(1, self.args.per_device_eval_batch_size // self.args.num_generations)
        order = [c[0] for c in generation_order(n, 1, seed=self.args.seed, epoch=0)]  # TRL's eval RepeatSampler
        batches = [order[i : i + per] for i in range(0, n, per)]
        seed, step = int(state.seed), int(state.step)

        def encoded(i: int) -> list[int]:
            return list(self.codec.encode(self.eval_prompts[i][self.prompt_key]))

        made, losses, started = [], [], time.monotonic()
        if self.sampling.rng == "global":
            loader_draw()  # HF's evaluation starts iterating its loader
        for i, b in enumerate(batches):
            out = self.sample(state, self.eval_prompts, b, derive_seed(seed, step, i, _EVAL), encoded, False)
            loss, aux = self._eval_loss(state, out)  # TRL logs the objective's metrics (entropy...) of each batch
            made.append({**out["metrics"], **aux})
            losses.append(float(loss) * len(b))  # HF: a mean over the eval rows
        metrics = {f"eval_{k}": float(v) for k, v in _means(made).items()}
        runtime = time.monotonic() - started  # HF's speeds: completions (n x num_generations) and batches per second
        speeds = {"samples": n * self.args.num_generations / runtime, "steps": len(batches) / runtime}
        timing = {"eval_runtime": runtime, **{f"eval_{k}_per_second": v for k, v in speeds.items()}}
        return {"eval_loss": sum(losses) / n, **timing, **metrics}

    def stream(self) -> StateStream:
        a, plan = self.args, self.args.rollout
        extras: dict[str, Any] = {
            BUFFER: empty_buffer(
                a.generation_batch,
                a.max_completion_length,
                a.records_old_logps,
                self.ref_params is not None,
                self.rollouts is not None and _annotated(plan),
                self.rollouts is not None and plan.correction is not None,
            )
        }
        if self.rollouts is not None and plan.max_staleness > 0:
            trainable = {k: v for k, v in self.model.named_parameters() if v.requires_grad}
            extras[PUBLISHED] = published_template(trainable, plan.max_staleness)
        return StateStream(
            steps=self.steps,
            prepare=self.prepare,
            steps_per_epoch=self.steps_per_epoch(),
            samples_per_step=a.per_device_train_batch_size * a.gradient_accumulation_steps,
            extras=extras,
            evaluate=self.evaluate if self.eval_prompts is not None else None,
        )


def _annotated(plan: RolloutPlan) -> bool:
    """Whether a generation records its completions' weight versions (off-policy runs, corrected ones)."""
    return plan.max_staleness > 0 or plan.correction is not None


def _means(made: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Each metric's mean over the generations that logged it (a reward function's ``log_metric`` may skip one)."""
    names = dict.fromkeys(k for m in made for k in m)
    return {k: torch.stack([m[k] for m in made if k in m]).mean() for k in names}
