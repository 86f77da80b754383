"""GRPO's one schedule (``trainfold.grpo.data``) counts ``steps_per_generation`` in TRL's micro-steps; one driver:
the research loop (``loop.run`` over the run's stream) and ``train`` give the same steps for the same settings."""

from __future__ import annotations

import types

import pytest
import torch

from trainfold import loop, make_step, sgd
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.state import init_state
from trainfold.grpo.args import GRPOArguments
from trainfold.grpo.data import GenerationSchedule, schedule_step
from trainfold.grpo.run import Codec, grpo_stream, train

CFG = TinyLMConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_len=16)


def lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(CFG)


def encode(s):
    return [1 + int(c) for c in s]


def decode(ids):
    return "".join(str(i % 10) for i in ids)


CODEC = Codec(encode, decode)


def digit_sum(prompts, completions, **_):
    return [sum(int(ch) for ch in c) / 10 for c in completions]


# -- TRL's unit -------------------------------------------------------------------------------


class _TRLStub:
    """What ``GRPOTrainer._prepare_inputs`` reads, with generation replaced by labelled rows."""

    def __init__(self, spg, iterations):
        self.args = types.SimpleNamespace(steps_per_generation=spg)
        self.num_iterations, self._step, self._buffered_inputs = iterations, 0, None
        self.model = types.SimpleNamespace(training=True)
        self.generated_at = []

    def _generate_and_score_completions(self, batch):
        self.generated_at.append(self._step)
        n = len(batch["idx"])
        return {"gen": torch.full((n,), len(self.generated_at) - 1), "row": torch.arange(n)}


def _trl_micro_steps(b, spg, iterations, micro_steps):
    """Label each of TRL's micro-steps by (generation, rows of its slice), through TRL's own ``_prepare_inputs``."""
    from trl import GRPOTrainer

    stub, labels = _TRLStub(spg, iterations), []
    for _ in range(micro_steps):  # each micro-step the dataloader hands over a generation batch: b x spg rows
        out = GRPOTrainer._prepare_inputs(stub, {"idx": torch.arange(b * spg)})
        labels.append((int(out["gen"][0]), tuple(sorted(out["row"].tolist()))))
        stub._step += 1
    return labels, stub.generated_at


def _canonical(labels):
    seen = {}
    return [seen.setdefault(x, len(seen)) for x in labels]


@pytest.mark.parametrize(
    "b, ga, spg, iterations", [(2, 2, 2, 1), (2, 2, 4, 1), (2, 2, 3, 2), (2, 2, 1, 1), (2, 4, 2, 1), (4, 2, 2, 3)]
)
def test_the_schedule_counts_steps_per_generation_in_trls_micro_steps(b, ga, spg, iterations):
    """The run's schedule is TRL's ``_prepare_inputs``: generation batch = b x spg, made at the same micro-steps,
    every micro-step on the same slice of it."""
    generations = 2 * ga
    micro_steps = generations * spg * iterations
    trl, trl_generated_at = _trl_micro_steps(b, spg, iterations, micro_steps)
    args = GRPOArguments(
        per_device_train_batch_size=b, gradient_accumulation_steps=ga, steps_per_generation=spg, num_generations=2,
        num_iterations=iterations,
    )  # fmt: skip
    schedule, made = args.generation_schedule, []

    def generate(number):
        made.append(number)
        return number

    ours = []
    for first in range(0, micro_steps, ga):  # optimizer steps of GA micro-steps, the generation held across them
        held = made[-1] if made else None
        _, micro, _ = schedule_step(schedule, held, range(first, first + ga), generate, lambda g, i: (g, i))
        ours += micro
    assert _canonical(ours) == _canonical(trl)  # the same slice at every micro-step, reuse included
    assert [k for k in range(micro_steps) if schedule.generates(k)] == trl_generated_at
    assert args.generation_batch == b * spg  # TRL's generation batch: per_device_train_batch_size x spg


def test_default_steps_per_generation_is_the_accumulation():
    schedule = GRPOArguments(gradient_accumulation_steps=3, per_device_train_batch_size=8).generation_schedule
    assert schedule == GenerationSchedule(3, 1, 3) and not schedule.records_old_logps
    assert GenerationSchedule(4, 1, 2).records_old_logps and not GenerationSchedule(1, 1, 2).records_old_logps
    generation, micro, made = schedule_step(
        GenerationSchedule(2, 2), "old", range(3, 6), lambda g: g, lambda g, i: (g, i)
    )
    assert (generation, micro, made) == (1, [("old", 1), (1, 0), (1, 1)], 1)  # micro-step 3 ends the held one


# -- one driver: the research loop is loop.run over the run's stream ---------------------------


@pytest.mark.parametrize("ga, spg, iterations", [(2, 3, 2)])
def test_the_research_loop_and_train_give_the_same_steps_for_the_same_settings(tmp_path, ga, spg, iterations):
    """steps_per_generation != gradient_accumulation_steps and num_iterations > 1: the same losses, bitwise."""
    b, g, num_prompts = 2, 2, 6
    args = GRPOArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=b,
        gradient_accumulation_steps=ga,
        steps_per_generation=spg,
        num_iterations=iterations,
        num_generations=g,
        max_completion_length=3,
        beta=0.05,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        save_strategy="no",
        seed=3,
    )
    steps = num_prompts // args.prompts_per_generation * spg * iterations // ga
    args = args.replace(max_steps=steps)
    data = [{"prompt": str(i % 10)} for i in range(num_prompts)]
    run_losses, loop_losses = [], []
    result = train(
        lm(),
        args,
        data,
        digit_sum,
        codec=CODEC,
        optimizer=sgd(0.1),
        observers=[lambda s, _: run_losses.append(s.metrics["loss"].item())],
    )

    model = lm()
    run = grpo_stream(model, args, data, digit_sum, codec=CODEC)
    step = make_step(model, optimizer=sgd(0.1), objective=run.objective)
    state, _ = loop.run(
        step,
        init_state(model, sgd(0.1), seed=args.seed),
        run.stream(),
        stop=lambda s: int(s.step) >= steps,
        hooks=[loop.every(1, lambda s, _: loop_losses.append(s.metrics["loss"].item()))],
    )
    assert len(loop_losses) == steps == result.global_step and len(set(loop_losses)) > 1
    assert loop_losses == run_losses
    for k, v in result.state.params.items():
        assert torch.equal(state.params[k], v), k


def test_a_real_trl_grpo_trainer_generates_when_the_research_loop_and_the_run_do(tmp_path):
    """TRL's GRPOTrainer on a tiny model: generation batch b x steps_per_generation, at the same optimizer steps."""
    import datasets
    import trl
    from tiny_chat import llama, word_tokenizer

    tok, calls = word_tokenizer(None), {"trl": [], "run": [], "loop": []}
    settings = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=3)
    settings |= dict(num_iterations=2, num_generations=2, max_completion_length=2, max_steps=6, seed=3, logging_steps=1)
    common = dict(bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no", disable_tqdm=True)
    config = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **common, **settings)
    rows = [{"prompt": f"w{i} w{i + 1}"} for i in range(6)]

    def scored(name, step):
        def reward(prompts, completions, **kwargs):
            done = step() if name == "trl" else kwargs["trainer_state"].global_step  # TRL's keyword, as TRL's
            calls[name].append((done, len(completions)))
            return [float(len(c)) for c in completions]

        return reward

    trainer = trl.GRPOTrainer(
        model=llama(), reward_funcs=scored("trl", lambda: trainer.state.global_step), args=config,
        train_dataset=datasets.Dataset.from_list(rows), processing_class=tok,
    )  # fmt: skip
    trainer.train()
    args = GRPOArguments.from_hf(config, output_dir=str(tmp_path / "run"))
    result = train(llama(), args, rows, scored("run", lambda: None), processing_class=tok)
    generated = [e["step"] for e in result.log_history if "reward" in e]  # logged by the steps that generated
    assert generated == [e["step"] for e in trainer.state.log_history if "reward" in e] == [1, 4]

    model = llama()  # the research loop: loop.run over the run's stream, the reward reading the step from TRL's keyword
    run = grpo_stream(model, args, rows, scored("loop", lambda: None), processing_class=tok)
    step = make_step(model, optimizer=sgd(0.1), objective=run.objective)
    start = init_state(model, sgd(0.1), seed=args.seed)
    state, _ = loop.run(step, start, run.stream(), stop=lambda s: int(s.step) >= 6)
    assert calls["trl"] == [(0, 6), (3, 6)]  # 6 completions = 2 x 3 micro-steps, every 3 optimizer steps
    assert calls["run"] == calls["loop"] == calls["trl"] and int(state.step) == 6
