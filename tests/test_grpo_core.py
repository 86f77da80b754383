"""GRPO's one schedule (``trainfold.grpo.data``): the hand loop and the run count ``steps_per_generation`` in
TRL's micro-steps, and give the same steps for the same settings."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold import make_step, sgd
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.state import init_state
from trainfold.grpo.args import GRPOArguments, generation_order
from trainfold.grpo.data import GenerationSchedule, generation_batches, schedule_step
from trainfold.grpo.loop import grpo_trajectory, make_rollout
from trainfold.grpo.objective import grpo_objective
from trainfold.grpo.run import grpo_stream, train

CFG = TinyLMConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_len=16)


def lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(CFG)


def encode(s):
    return [1 + int(c) for c in s]


def decode(ids):
    return "".join(str(i % 10) for i in ids)


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
def test_the_loop_counts_steps_per_generation_in_trls_micro_steps(b, ga, spg, iterations):
    """The hand loop's schedule is TRL's ``_prepare_inputs``: generation batch = b x spg, at the same micro-steps."""
    generations = 2 * ga  # whole generations (TRL's sampler never cuts one) that fill whole prompt steps
    trl, trl_generated_at = _trl_micro_steps(b, spg, iterations, generations * spg * iterations)
    rows = iter(range(generations * spg * b))
    prompts = [[[next(rows) for _ in range(b)] for _ in range(ga)] for _ in range(generations * spg // ga)]
    made, sizes = [], []

    def generate(micro_batches):
        sizes.append(sum(len(mb) for mb in micro_batches))
        made.append(len(made))
        return [(made[-1], i) for i in range(len(micro_batches))]  # a generation's slice i

    steps = list(generation_batches(prompts, generate, steps_per_generation=spg, num_iterations=iterations))
    assert all(len(s) == ga for s in steps) and len(steps) == len(trl) // ga  # optimizer steps of GA micro-steps
    ours = [label for step in steps for label in step]
    assert _canonical(ours) == _canonical(trl)  # the same slice at every micro-step, reuse included
    assert set(sizes) == {b * spg}  # TRL's generation batch: per_device_train_batch_size x steps_per_generation
    assert len(made) == len(trl_generated_at)
    assert (
        GRPOArguments(
            per_device_train_batch_size=b, gradient_accumulation_steps=ga, steps_per_generation=spg, num_generations=2
        ).generation_batch
        == b * spg
    )


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 3), st.integers(1, 5), st.integers(1, 3))
def test_generations_cover_the_prompt_micro_batches_in_trls_order(num_steps, ga, spg, iterations):
    ids = list(range(num_steps * ga))
    prompts = [[[i] for i in ids[s * ga : (s + 1) * ga]] for s in range(num_steps)]
    calls = []

    def generate(mbs):
        calls.append([x for mb in mbs for x in mb])
        return mbs

    steps = list(generation_batches(prompts, generate, steps_per_generation=spg, num_iterations=iterations))
    chunks = [ids[i : i + spg] for i in range(0, len(ids), spg)]
    assert calls == chunks  # one generation per steps_per_generation prompt micro-batches, in order
    assert [x for step in steps for mb in step for x in mb] == [x for c in chunks for _ in range(iterations) for x in c]
    assert all(len(step) == ga for step in steps[:-1]) and 1 <= len(steps[-1]) <= ga


def test_the_loop_generates_lazily_with_the_state_each_step_starts_from():
    prompts = [[[1], [2]], [[3], [4]], [[5], [6]]]  # 3 optimizer steps of 2 micro-batches
    log = []

    def generate(mbs):
        log.append(("generate", [x for mb in mbs for x in mb]))
        return mbs

    for step in generation_batches(prompts, generate, steps_per_generation=3):
        log.append(("step", [x for mb in step for x in mb]))
    assert log == [
        ("generate", [1, 2, 3]),
        ("step", [1, 2]),
        ("generate", [4, 5, 6]),  # only when step 2 needs the second generation's first slice
        ("step", [3, 4]),
        ("step", [5, 6]),
    ]


def test_default_steps_per_generation_is_the_accumulation():
    schedule = GRPOArguments(gradient_accumulation_steps=3, per_device_train_batch_size=8).generation_schedule
    assert schedule == GenerationSchedule(3, 1, 3) and not schedule.records_old_logps
    assert GenerationSchedule(4, 1, 2).records_old_logps and not GenerationSchedule(1, 1, 2).records_old_logps
    generation, micro, made = schedule_step(
        GenerationSchedule(2, 2), "old", range(3, 6), lambda g: g, lambda g, i: (g, i)
    )
    assert (generation, micro, made) == (1, [("old", 1), (1, 0), (1, 1)], 1)  # micro-step 3 ends the held one


# -- the loop and the run: one schedule --------------------------------------------------------


@pytest.mark.parametrize("ga, spg, iterations", [(2, 3, 2)])
def test_the_loop_and_the_run_give_the_same_steps_for_the_same_settings(tmp_path, ga, spg, iterations):
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
    generations = num_prompts // args.prompts_per_generation
    steps = generations * spg * iterations // ga
    args = args.replace(max_steps=steps)
    data = [{"prompt": str(i % 10)} for i in range(num_prompts)]
    run_losses = []
    result = train(
        lm(),
        args,
        data,
        digit_sum,
        encode=encode,
        decode=decode,
        optimizer=sgd(0.1),
        observers=[lambda s, _: run_losses.append(s.metrics["loss"].item())],
    )

    # the loop, fed the run's prompts in TRL's order and the run's own sampling: only the schedule is the loop's
    model = lm()
    run = grpo_stream(model, args, data, digit_sum, encode=encode, decode=decode)
    order = generation_order(num_prompts, args.prompts_per_generation, seed=args.seed, epoch=0)
    rows = [i for chunk in order for i in chunk for _ in range(g)]
    micro = [{"idx": rows[i : i + b]} for i in range(0, len(rows), b)]
    prompts = [micro[i : i + ga] for i in range(0, len(micro), ga)]
    made = []

    def rollout(state, micro_batches):
        number = len(made)
        assert [i for mb in micro_batches for i in mb["idx"]] == [i for i in order[number] for _ in range(g)]
        buffer, _ = run.generation(state, 0, number, order[number])
        made.append(int(state.step))
        return [run.micro_batch(buffer, i, ga, torch.device("cpu")) for i in range(len(micro_batches))]

    rollout.steps_per_generation, rollout.num_iterations, rollout.num_generations = spg, iterations, 1
    step = make_step(model, optimizer=sgd(0.1), objective=run.objective)
    states = list(grpo_trajectory(step, init_state(model, sgd(0.1), seed=args.seed), prompts, rollout))
    loop_losses = [s.metrics["loss"].item() for s in states]
    assert len(made) == generations and len(loop_losses) == steps == result.global_step
    assert len(set(loop_losses)) > 1
    assert loop_losses == run_losses
    for k, v in result.state.params.items():
        assert torch.equal(states[-1].params[k], v), k


def test_make_rollout_takes_one_size_in_either_unit():
    model = lm()
    common = dict(encode=encode, decode=decode, num_generations=2, max_new_tokens=2)
    micro = make_rollout(model, digit_sum, steps_per_generation=3, **common)
    assert (micro.steps_per_generation, micro.optimizer_steps_per_generation, micro.records_old_logps) == (
        3,
        None,
        True,
    )
    steps = make_rollout(model, digit_sum, optimizer_steps_per_generation=2, **common)
    assert (steps.steps_per_generation, steps.optimizer_steps_per_generation) == (None, 2)
    assert not make_rollout(model, digit_sum, **common).records_old_logps
    with pytest.raises(TypeError, match="steps_per_generation=2 .*optimizer_steps_per_generation=3; pass one"):
        make_rollout(model, digit_sum, steps_per_generation=2, optimizer_steps_per_generation=3, **common)
    with pytest.raises(ValueError, match="steps_per_generation=0 must be >= 1"):
        make_rollout(model, digit_sum, steps_per_generation=0, **common)
    with pytest.raises(TypeError, match="exactly one"):
        list(generation_batches([], lambda mbs: mbs, 1, steps_per_generation=1))


def test_a_real_trl_grpo_trainer_generates_when_the_loop_and_the_run_do(tmp_path):
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
        def reward(prompts, completions, **_):
            calls[name].append((step(), len(completions)))
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

    model = llama()
    rollout = make_rollout(
        model, scored("loop", lambda: len(states)), encode=lambda s: tok(s, add_special_tokens=False)["input_ids"],
        decode=tok.decode, num_generations=2, max_new_tokens=2, steps_per_generation=3, num_iterations=2,
    )  # fmt: skip
    prompts = [[{"prompt": [r["prompt"]]} for r in rows[i : i + 2]] for i in range(0, 6, 2)]  # steps of 2 x 1 prompt
    step = make_step(model, optimizer=sgd(0.1), objective=grpo_objective("dapo"))
    states = []  # the loop's reward function reads how many steps are done
    for s in grpo_trajectory(step, init_state(model, sgd(0.1)), prompts, rollout):
        states.append(s)
    assert calls["trl"] == [(0, 6), (3, 6)]  # 6 completions = 2 x 3 micro-steps, every 3 optimizer steps
    assert [n for _, n in calls["run"]] == [6, 6] and calls["loop"] == calls["trl"] and len(states) == 6
