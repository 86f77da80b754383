"""The GRPO run (``trainfold.grpo.run.train``): TRL 1.16's schedule, metrics and settings; resume inside a block."""

from __future__ import annotations

import math
import types

import pytest
import torch

from trainfold import sgd
from trainfold.core.generate import functional_forward, pad_right
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.state import Cursor, init_state
from trainfold.grpo.args import GRPOArguments, generation_order
from trainfold.grpo.data import Sampling
from trainfold.grpo.global_rng import global_completions, loader_draw, shuffled_rows
from trainfold.grpo.metrics import generation_metrics
from trainfold.grpo.objective import grpo_objective
from trainfold.grpo.run import BUFFER, Codec, grpo_stream, train

CFG = TinyLMConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_len=16)


def lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(CFG)


def encode(s):
    return [1 + int(c) for c in s]


def decode(ids):
    return "".join(str(i % 10) for i in ids)


CODEC = Codec(encode, decode)


def digit_sum(prompts, completions, **_):
    return [sum(int(ch) for ch in c) / 10 for c in completions]


def grpo_args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=3,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        learning_rate=1e-2,
        save_strategy="no",
        seed=3,
    )
    return GRPOArguments(**{**base, **kw})


# -- TRL's sampler and generation schedule --------------------------------------------------


def test_prompt_order_is_trls_repeat_sampler_over_epochs():
    from trl.trainer.utils import RepeatSampler

    data, g, per, repeats = list(range(11)), 3, 4, 2
    sampler = RepeatSampler(data, mini_repeat_count=g, batch_size=per, repeat_count=repeats, shuffle=True, seed=7)
    for epoch in range(3):  # HF iterates the same sampler each epoch: the generator moves on
        ours = [
            i
            for chunk in generation_order(len(data), per, seed=7, epoch=epoch)
            for _ in range(repeats)
            for i in chunk
            for _ in range(g)
        ]
        assert list(sampler) == ours
    plain = RepeatSampler(data, mini_repeat_count=1, batch_size=per, shuffle=False)
    assert list(plain) == [i for c in generation_order(len(data), per, seed=0, epoch=0, shuffle=False) for i in c]


class _TRLStub:
    """The state ``GRPOTrainer._prepare_inputs`` reads, with generation replaced by labelled rows."""

    def __init__(self, spg, iterations):
        self.args = types.SimpleNamespace(steps_per_generation=spg)
        self.num_iterations, self._step, self._buffered_inputs = iterations, 0, None
        self.model = types.SimpleNamespace(training=True)
        self.prompts = []

    def _generate_and_score_completions(self, batch):
        self.prompts.append(batch["idx"].tolist())
        n = len(batch["idx"])
        return {"gen": torch.full((n,), len(self.prompts) - 1), "row": torch.arange(n)}


def _trl_schedule(b, ga, spg, iterations, g, num_prompts, seed, epochs):
    """Run TRL's own sampler, dataloader batching and ``_prepare_inputs``; label each micro-step's slice."""
    from torch.utils.data import BatchSampler
    from trl import GRPOTrainer
    from trl.trainer.utils import RepeatSampler

    config = GRPOArguments(
        per_device_train_batch_size=b, gradient_accumulation_steps=ga, steps_per_generation=spg, num_generations=g
    )
    spg = config.generation_steps  # TRL's default: gradient_accumulation_steps
    sampler = RepeatSampler(range(num_prompts), g, batch_size=b * spg // g, repeat_count=iterations * spg, seed=seed)
    stub, labels = _TRLStub(spg, iterations), []
    for _ in range(epochs):
        for batch in BatchSampler(sampler, b * spg, drop_last=False):
            out = GRPOTrainer._prepare_inputs(stub, {"idx": torch.tensor(batch)})
            labels.append((int(out["gen"][0]), tuple(sorted(out["row"].tolist()))))
            stub._step += 1
    return labels, stub.prompts


def _canonical(labels):
    seen = {}
    return [seen.setdefault(x, len(seen)) for x in labels]


@pytest.mark.parametrize(
    "b, ga, spg, iterations", [(2, 2, None, 1), (2, 2, 4, 1), (2, 2, 4, 2), (2, 2, 1, 1), (2, 4, 2, 1), (4, 2, 2, 3)]
)
def test_generation_schedule_is_trls_prepare_inputs(tmp_path, b, ga, spg, iterations):
    num_prompts, g, epochs = 8, 2, 2
    labels, trl_prompts = _trl_schedule(b, ga, spg, iterations, g, num_prompts, seed=3, epochs=epochs)
    seen = []

    def record(prompts, completions, idx, **_):
        seen.append(list(idx))
        return digit_sum(prompts, completions)

    args = grpo_args(
        tmp_path,
        per_device_train_batch_size=b,
        gradient_accumulation_steps=ga,
        steps_per_generation=spg,
        num_iterations=iterations,
    )
    model = lm()
    run = grpo_stream(
        model,
        args,
        [{"prompt": str(i % 10), "idx": i} for i in range(num_prompts)],
        record,
        codec=CODEC,
    )
    stream = run.stream()
    state = init_state(model, sgd(0.1), seed=3, extras=stream.extras)
    assert stream.steps_per_epoch * epochs * ga == len(labels)  # TRL: len(dataloader) // GA updates an epoch
    micro, generations = [], []
    for _, item in zip(range(stream.steps_per_epoch * epochs), stream.steps(Cursor())):
        before = len(seen)
        state, batch = stream.prepare(state, item)
        generations.append(len(seen) - before)
        micro.extend(batch)
    assert seen == trl_prompts  # the same prompts, repeated alike, in the same order
    trl_per_step = [
        sum(1 for k in range(s * ga, (s + 1) * ga) if k % (args.generation_steps * iterations) == 0)
        for s in range(len(labels) // ga)
    ]
    assert generations == trl_per_step  # generated as often as TRL, at the same optimizer steps

    def same(x, y):
        return x["input_ids"].shape == y["input_ids"].shape and all(torch.equal(x[k], y[k]) for k in x)

    ours = []
    for mb in micro:  # label a micro-batch by the first equal one: reuse shows up as repeated labels
        ours.append(next(i for i, other in enumerate(micro) if same(mb, other)))
    assert _canonical(ours) == _canonical(labels)


def test_buffered_log_probs_are_the_sampling_policys_at_the_completion_tokens(tmp_path):
    from trainfold.core.generate import functional_forward, token_logps

    args = grpo_args(tmp_path, gradient_accumulation_steps=2, steps_per_generation=4, beta=0.1)
    assert args.records_old_logps  # the generation outlives its first optimizer step
    model = lm()
    ref = {k: v.detach() + 0.01 for k, v in model.named_parameters()}
    stream = grpo_stream(
        model, args, [{"prompt": str(d)} for d in range(8)], digit_sum, codec=CODEC, ref_params=ref
    ).stream()
    state = init_state(model, sgd(0.1), seed=3, extras=stream.extras)
    _, batch = stream.prepare(state, next(iter(stream.steps(Cursor()))))
    for mb in batch:
        mask = mb["completion_mask"][:, 1:].bool()
        assert mask.sum(1).tolist() == [3, 3]  # no EOS: every completion has max_completion_length tokens
        inputs = {"input_ids": mb["input_ids"], "attention_mask": mb["attention_mask"]}
        for params, key in ((state.params, "old_logps"), (ref, "ref_logps")):
            with torch.no_grad():
                expected = token_logps(functional_forward(model)(params, inputs), mb["input_ids"])
            torch.testing.assert_close(mb[key][mask], expected[mask], rtol=1e-5, atol=1e-5)
            assert torch.all(mb[key][~mask] == 0)
        assert mb["generation_tokens"].tolist() == [8 * 3] * 2  # the generation's 8 completions of 3 tokens


def test_steps_per_generation_counts_micro_steps_like_trl(tmp_path):
    """With accumulation 2, steps_per_generation=4 generates every 2 optimizer steps (TRL), not every 4."""
    calls = []

    def counted(prompts, completions, **_):
        calls.append(len(completions))
        return digit_sum(prompts, completions)

    args = grpo_args(tmp_path, gradient_accumulation_steps=2, steps_per_generation=4, max_steps=4)
    result = train(lm(), args, [{"prompt": str(d)} for d in range(8)], counted, codec=CODEC)
    assert result.global_step == 4 and calls == [8, 8]
    assert [("reward" in e) for e in result.log_history[:4]] == [True, False, True, False]
    assert all("entropy" in e and "clip_ratio/region_mean" in e for e in result.log_history[:4])


# -- resume inside a generation block ------------------------------------------------------


@pytest.mark.parametrize("spg, iterations, stop_at, rng", [(2, 2, 1, "keyed"), (2, 2, 1, "global")])
def test_resume_inside_a_generation_block_is_bitwise(tmp_path, spg, iterations, stop_at, rng):
    calls = []

    def counted(prompts, completions, **_):
        calls.append(len(completions))
        return digit_sum(prompts, completions)

    data = [{"prompt": str(d)} for d in range(8)]

    def args(out, **kw):
        return grpo_args(
            out,
            max_steps=4,
            gradient_accumulation_steps=2,
            steps_per_generation=spg,
            num_iterations=iterations,
            beta=0.05,
            generation_rng=rng,  # global: the checkpoint's global generator states continue the draws
            **kw,
        )

    straight = train(lm(), args(tmp_path / "a"), data, counted, codec=CODEC)
    assert (stop_at * 2) % (spg * iterations) != 0  # the checkpoint falls inside a block
    first = train(
        lm(),
        args(tmp_path / "b", save_strategy="steps", save_steps=1),
        data,
        counted,
        codec=CODEC,
        stop=lambda s: int(s.step) >= stop_at,
    )
    assert first.status == "stopped" and first.global_step == stop_at
    calls.clear()
    resumed = train(
        lm(),
        args(tmp_path / "b", save_strategy="steps", save_steps=1),
        data,
        counted,
        codec=CODEC,
        resume_from_checkpoint=True,
    )
    block_steps = spg * iterations // 2
    assert len(calls) == 4 // block_steps - stop_at // block_steps - 1  # the open block came from the checkpoint
    assert resumed.global_step == 4
    assert not torch.equal(straight.state.params["tok.weight"], lm().tok.weight)
    for k in straight.state.params:
        assert torch.equal(straight.state.params[k], resumed.state.params[k]), k
    assert torch.equal(straight.state.extras[BUFFER].completion_ids, resumed.state.extras[BUFFER].completion_ids)


def test_sigterm_inside_a_generation_block_saves_it_and_resumes_bitwise(tmp_path):
    import os
    import signal

    calls = []

    def interrupting(prompts, completions, **_):
        calls.append(len(completions))
        if len(calls) == 2:  # while step 3 generates: the JIT checkpoint after step 3 is inside its block
            os.kill(os.getpid(), signal.SIGTERM)
        return digit_sum(prompts, completions)

    data = [{"prompt": str(d)} for d in range(8)]
    args = grpo_args(tmp_path / "a", max_steps=4, gradient_accumulation_steps=2, steps_per_generation=4)
    straight = train(lm(), args, data, digit_sum, codec=CODEC)
    jit = args.replace(output_dir=str(tmp_path / "b"), enable_jit_checkpoint=True)
    first = train(lm(), jit, data, interrupting, codec=CODEC)
    assert first.status == "preempted" and first.global_step == 3 and first.last_checkpoint.name == "checkpoint-3"
    calls.clear()
    resumed = train(lm(), jit, data, interrupting, codec=CODEC, resume_from_checkpoint=True)
    assert resumed.global_step == 4 and calls == []  # step 4 trained on the saved generation
    for k in straight.state.params:
        assert torch.equal(straight.state.params[k], resumed.state.params[k]), k


# -- metrics -------------------------------------------------------------------------------


def test_generation_metrics_follow_trls_formulas_on_a_hand_case():
    from trl.trainer.utils import nanstd

    nan = math.nan
    each = torch.tensor([[1.0, 0.0], [3.0, nan], [2.0, 1.0], [2.0, 1.0]])  # 2 functions, 2 groups of 2
    lengths, truncated = torch.tensor([3, 1, 2, 3]), torch.tensor([True, False, False, True])
    m = generation_metrics(each, ["a", "b"], 2, lengths, truncated, weights=[1.0, 2.0])
    total = torch.tensor([1.0, 3.0, 4.0, 4.0])  # nansum of the weighted rewards
    assert m["rewards/a/mean"].item() == 2.0 and m["rewards/b/mean"].item() == pytest.approx(2 / 3)
    assert m["rewards/a/std"].item() == pytest.approx(math.sqrt(2 / 3))  # unbiased: sum of squares 2, over 3
    assert m["rewards/b/std"].item() == pytest.approx(nanstd(each[:, 1]).item())
    assert m["reward"].item() == 3.0 and m["reward_std"].item() == pytest.approx(nanstd(total).item())
    assert m["frac_reward_zero_std"].item() == 0.5  # the second group's rewards are equal
    assert [m[f"completions/{k}_length"].item() for k in ("mean", "min", "max")] == [2.25, 1.0, 3.0]
    assert m["completions/clipped_ratio"].item() == 0.5
    assert [m[f"completions/{k}_terminated_length"].item() for k in ("mean", "min", "max")] == [1.5, 1.0, 2.0]
    batch = generation_metrics(each, ["a", "b"], 2, lengths, truncated, weights=[1.0, 2.0], scale_rewards="batch")
    assert batch["frac_reward_zero_std"].item() == 0.0


def test_objective_metrics_are_trls_token_means_per_micro_batch():
    model = lm()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 16, (2, 6), generator=g)
    completion = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0]])
    attention = torch.tensor([[1] * 6, [1, 1, 1, 1, 1, 0]])
    from trainfold.core.generate import functional_forward, token_logps

    params = {k: v.detach() for k, v in model.named_parameters()}
    with torch.no_grad():
        logits = functional_forward(model)(params, {"input_ids": ids, "attention_mask": attention})
        current = token_logps(logits, ids)
    ref = current + 0.3 * torch.randn(current.shape, generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "advantages": torch.tensor([1.0, -1.0]),
        "ref_logps": ref,
        "step_micro_batches": torch.tensor([2, 2]),
    }
    obj = grpo_objective("grpo", beta=0.1)
    _, aux = obj(functional_forward(model), params, batch, obj.count_items(batch))
    mask = completion[:, 1:].float()
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    kl = torch.exp(ref - current) - (ref - current) - 1  # ratio 1: the bias correction changes nothing
    assert aux["entropy"].item() == pytest.approx(((entropy * mask).sum() / mask.sum()).item() / 2, rel=1e-5)
    assert aux["kl"].item() == pytest.approx(((kl * mask).sum() / mask.sum()).item() / 2, rel=1e-5)


def test_dapo_normalises_each_micro_batch_by_its_generation_as_trl():
    """TRL: loss = sum(mask * token loss) / (num_items_in_batch * GA / steps_per_generation), per micro-batch."""
    from trainfold.core.generate import functional_forward

    model = lm()
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids = torch.randint(1, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    completion = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    adv = torch.tensor([0.5, -2.0])
    obj = grpo_objective("dapo")
    for tokens, ga, spg in ((40, 4, 2), (7, 2, 4)):  # one step of two generations; a generation of two steps
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "completion_mask": completion,
            "advantages": adv,
            "generation_tokens": torch.tensor([tokens] * 2),
            "generation_micro_batches": torch.tensor([spg] * 2),
            "step_micro_batches": torch.tensor([ga] * 2),
        }
        loss, _ = obj(functional_forward(model), params, batch, torch.tensor(123))  # the step's count is not used
        on_policy = -(adv * completion[:, 1:].sum(1)).sum()  # ratio 1: each token's loss is -A
        assert loss.item() == pytest.approx(on_policy.item() / (tokens * ga / spg), rel=1e-6)


def test_run_logs_kl_with_beta_and_evaluates_eval_prompts(tmp_path):
    args = grpo_args(
        tmp_path,
        beta=0.1,
        eval_strategy="steps",
        eval_steps=2,
        max_steps=2,
        save_strategy="steps",
        save_steps=2,
        metric_for_best_model="eval_reward",
        greater_is_better=True,
    )
    result = train(
        lm(),
        args,
        [{"prompt": str(d)} for d in range(4)],
        digit_sum,
        codec=CODEC,
        eval_prompts=[{"prompt": "12"}, {"prompt": "3"}],
    )
    assert result.best_checkpoint is not None and result.best_checkpoint.name == "checkpoint-2"
    logs = [e for e in result.log_history if "loss" in e]
    assert logs[0]["kl"] == 0.0 and logs[1]["kl"] > 0  # the reference is the model as given
    evals = [e for e in result.log_history if "eval_reward" in e]
    assert len(evals) == 1 and {"eval_rewards/digit_sum/mean", "eval_completions/mean_length"} <= set(evals[0])
    assert math.isfinite(evals[0]["eval_loss"])


def test_a_tokenizer_encodes_prompts_and_decodes_completions_as_trl(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<pad>", "</s>"] + [f"t{i}" for i in range(2, 16)]
    word = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<pad>"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=word, pad_token="<pad>", eos_token="</s>")
    seen = []

    def record(prompts, completions, completion_ids, **_):
        seen.append((prompts, completions, completion_ids))
        return [float(len(c)) for c in completions]

    train(
        lm(),
        grpo_args(tmp_path, max_steps=1, max_completion_length=4),
        [{"prompt": "t3 t4"}, {"prompt": "t5"}],
        record,
        processing_class=tok,
    )
    prompts, completions, ids = seen[0]
    assert prompts in (["t3 t4"] * 2, ["t5"] * 2)  # one prompt per generation, num_generations times
    for text, c in zip(completions, ids):  # skip_special_tokens: no </s> or <pad> in the text; EOS ends a completion
        assert text == tok.decode(c, skip_special_tokens=True) and "</s>" not in text
        assert 1 not in c[:-1]


def _trl_grpo(tmp_path, funcs, rows, peft_config=None, eval_dataset=None, **kw):
    """A TRL ``GRPOTrainer`` on a tiny Llama saved under ``tmp_path`` (with a chat-template tokenizer)."""
    trl, datasets = pytest.importorskip("trl"), pytest.importorskip("datasets")
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from tiny_chat import llama, word_tokenizer

    tok = word_tokenizer("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}")
    llama().save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    common = dict(max_steps=1, per_device_train_batch_size=4, num_generations=2, max_completion_length=3, seed=5)
    common |= dict(report_to="none", save_strategy="no", disable_tqdm=True, bf16=False, use_cpu=True, **kw)
    args = GRPOArguments.from_hf(trl.GRPOConfig(output_dir=str(tmp_path / "tf"), **common))
    config = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), **common)  # the last config made: its accelerator
    data = datasets.Dataset.from_list(rows)
    model = str(tmp_path / "model")
    evals = None if eval_dataset is None else datasets.Dataset.from_list(eval_dataset)
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=funcs, args=config, train_dataset=data, eval_dataset=evals, peft_config=peft_config
    )
    return trainer, args, data, tok


def test_a_chat_prompts_completions_reach_the_reward_functions_as_trls(tmp_path):
    seen = {"trl": [], "tf": []}
    chat = [{"prompt": [{"role": "user", "content": f"w{i} w{i + 1}"}]} for i in range(4)]

    def recorder(who):
        def reward(prompts, completions, completion_ids, **_):
            seen[who].append((completions, completion_ids))
            return [float(len(c[0]["content"])) for c in completions]

        reward.__name__ = "length"
        return reward

    trainer, args, data, tok = _trl_grpo(tmp_path, [recorder("trl")], chat)
    trainer.train()
    train(str(tmp_path / "model"), args, data, [recorder("tf")])  # the tokenizer saved with the model, as TRL
    shape = lambda c: [(list(m), m["role"]) for m in c]
    for who in ("trl", "tf"):
        completions, ids = seen[who][0]
        assert [shape(c) for c in completions] == [[(["role", "content"], "assistant")]] * 4, who
        assert [c[0]["content"] for c in completions] == [tok.decode(i, skip_special_tokens=True) for i in ids]


def test_an_evaluation_logs_trls_metric_names(tmp_path):
    rows = [{"prompt": f"w{i} w{i + 1}"} for i in range(4)]
    reward = lambda completions, **_: [float(len(c)) for c in completions]
    kw = dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4, beta=0.1)
    trainer, args, data, _ = _trl_grpo(tmp_path, [reward], rows, eval_dataset=rows, **kw)
    trainer.train()
    ours = train(str(tmp_path / "model"), args, data, [reward], eval_dataset=rows).log_history
    evals = lambda h: next(e for e in h if "eval_loss" in e)
    assert set(evals(ours)) == set(evals(trainer.state.log_history)) - {"eval_num_tokens"}
    assert {"eval_entropy", "eval_kl", "eval_clip_ratio/low_min"} <= set(evals(ours))


def test_peft_config_draws_trls_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    config = lambda: peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_alpha=4, lora_dropout=0.0)
    rows = [{"prompt": f"w{i} w{i + 1}"} for i in range(4)]
    reward = lambda completions, **_: [float(len(c)) for c in completions]
    trainer, args, data, _ = _trl_grpo(tmp_path, [reward], rows, peft_config=config(), learning_rate=0.0)
    adapter = {k: v for k, v in trainer.model.named_parameters() if v.requires_grad}
    ours = train(str(tmp_path / "model"), args, data, [reward], peft_config=config())
    assert set(ours.state.params) == set(adapter)
    for k, v in adapter.items():  # learning rate 0: the adapter as drawn
        assert torch.equal(ours.state.params[k], v), k


def test_trls_keyword_names_train_as_trainfolds(tmp_path):
    """``GRPOTrainer(model=, reward_funcs=, args=, train_dataset=, eval_dataset=)`` moves over with its names."""
    rows, kw = [{"prompt": "12"}, {"prompt": "3"}], dict(codec=CODEC)
    args = grpo_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2)
    ours = train(lm(), args, rows, digit_sum, eval_prompts=rows, **kw).log_history
    theirs = train(model=lm(), reward_funcs=[digit_sum], args=args, train_dataset=rows, eval_dataset=rows, **kw)
    untimed = lambda h: [{k: v for k, v in e.items() if "runtime" not in k and "_per_second" not in k} for e in h[:-1]]
    assert untimed(theirs.log_history) == untimed(ours)
    with pytest.raises(TypeError, match="got prompts and train_dataset"):
        train(lm(), args, rows, digit_sum, train_dataset=rows, **kw)
    with pytest.raises(TypeError, match="needs the prompts"):
        train(lm(), args, reward_funcs=digit_sum, **kw)


@pytest.mark.parametrize("reward", ["org/reward-model", torch.nn.Linear(2, 1)], ids=["name", "module"])
def test_a_reward_model_is_refused_by_name(tmp_path, reward):
    with pytest.raises(TypeError, match=r"reward models \(.*\) are not supported.*wrap the model"):
        train(lm(), grpo_args(tmp_path), [{"prompt": "1"}] * 2, [digit_sum, reward], codec=CODEC)


def test_a_trl_config_is_refused_with_the_conversion():
    trl = pytest.importorskip("trl")
    import trainfold

    config = dict(output_dir="x", use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(TypeError, match=r"GRPOArguments\.from_hf\(config\)"):
        train(lm(), trl.GRPOConfig(**config), [{"prompt": "1"}] * 2, digit_sum, codec=CODEC)
    with pytest.raises(TypeError, match=r"SFTArguments\.from_hf\(config\)"):
        trainfold.sft.train(lm(), trl.SFTConfig(**config), [{"input_ids": [1, 2]}])
    with pytest.raises(TypeError, match=r"DPOArguments\.from_hf\(config\)"):
        trainfold.dpo.train(
            lm(), trl.DPOConfig(**config), [{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}]
        )


# -- repeated prompts are independent objects ----------------------------------------------


def test_a_reward_function_that_changes_one_repeat_changes_no_other(tmp_path):
    seen = []

    def meddling(prompts, completions, tags, **_):
        prompts[0]["text"] += "!"
        tags[0].append("x")
        seen.append(([p["text"] for p in prompts], [list(t) for t in tags]))
        return [0.0] * len(completions)

    data = [{"prompt": {"text": str(d)}, "tags": []} for d in range(2)]
    args = grpo_args(tmp_path, max_steps=2)
    train(lm(), args, data, meddling, codec=Codec(lambda p: encode(p["text"]), decode))
    for texts, tags in seen:
        assert texts[0].endswith("!") and not any(t.endswith("!") for t in texts[1:])
        assert tags[0] == ["x"] and all(t == [] for t in tags[1:])
    assert data == [{"prompt": {"text": "0"}, "tags": []}, {"prompt": {"text": "1"}, "tags": []}]


# -- settings ------------------------------------------------------------------------------


def test_settings_resolve_like_grpo_config():
    trl = pytest.importorskip("trl")
    for kw in ({}, {"steps_per_generation": 4}, {"generation_batch_size": 16}):
        ours = GRPOArguments(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4, **kw)
        theirs = trl.GRPOConfig(
            output_dir="/tmp/unused",
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            num_generations=4,
            use_cpu=True,
            bf16=False,
            **kw,
        )
        assert (ours.generation_steps, ours.generation_batch) == (
            theirs.steps_per_generation,
            theirs.generation_batch_size,
        )
    assert GRPOArguments().loss_type == trl.GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False).loss_type


def test_errors_name_the_setting_the_value_and_the_fix(tmp_path):
    with pytest.raises(TypeError, match=r"top_k=5 is a trl.GRPOConfig setting.*softmax\(logits / temperature\)"):
        GRPOArguments(top_k=5)
    with pytest.raises(TypeError, match="mask_truncated_completions=True"):
        GRPOArguments(mask_truncated_completions=True)
    GRPOArguments(use_vllm=False, top_k=0, importance_sampling_level="token")  # what trainfold does anyway
    with pytest.raises(TypeError, match="'num_generatons' \\(did you mean 'num_generations'\\?\\)"):
        GRPOArguments(num_generatons=4)
    with pytest.raises(ValueError, match="steps_per_generation or generation_batch_size, not both"):
        GRPOArguments(steps_per_generation=2, generation_batch_size=16)
    with pytest.raises(ValueError, match=r"(?s)(?=.*loss_type='gspo')(?=.*top_p=0.9)(?=.*learning_rate must be >= 0)"):
        GRPOArguments(loss_type="gspo", top_p=0.9, learning_rate=-1.0)
    with pytest.raises(ValueError, match="2 prompts fill no generation of 4 prompts"):
        train(
            lm(),
            grpo_args(tmp_path, per_device_train_batch_size=8),
            [{"prompt": "1"}] * 2,
            digit_sum,
            codec=CODEC,
        )
    with pytest.raises(ValueError, match="got 2 reward_weights for 1 reward functions"):
        train(
            lm(),
            grpo_args(tmp_path, reward_weights=[1.0, 2.0]),
            [{"prompt": "1"}] * 2,
            digit_sum,
            codec=CODEC,
        )
    with pytest.raises(TypeError, match="takes GRPOArguments"):
        from trainfold import TrainingArguments

        train(lm(), TrainingArguments(), [{"prompt": "1"}], digit_sum, codec=CODEC)


def test_reward_functions_get_trls_trainer_state_log_metric_and_log_extra(tmp_path):
    """A TRL reward function reading ``trainer_state`` and calling ``log_metric``/``log_extra`` runs as in TRL: the
    same counters at each generation, the metric logged under its name with TRL's values."""
    seen = {"trl": [], "tf": []}

    def recorder(who):
        def shaped(completions, trainer_state, log_metric, log_extra, **_):
            s = trainer_state
            seen[who].append((s.global_step, s.max_steps, s.epoch, s.num_train_epochs, s.logging_steps))
            log_metric("progress", s.global_step / s.max_steps)
            log_extra("length", [len(c) for c in completions])
            return [float(len(c)) for c in completions]

        return shaped

    rows = [{"prompt": f"w{i} w{i + 1}"} for i in range(8)]
    trainer, args, data, _ = _trl_grpo(tmp_path, [recorder("trl")], rows, max_steps=3, logging_steps=1)
    trainer.train()
    ours = train(str(tmp_path / "model"), args, data, [recorder("tf")]).log_history
    assert seen["tf"] == seen["trl"] and len(seen["tf"]) == 3
    logged = lambda h: [(e["step"], e["progress"]) for e in h if "progress" in e]
    assert logged(ours) == logged(trainer.state.log_history)  # a float32 sum over a count, as TRL's
    assert logged(ours) == [(1, 0.0), (2, pytest.approx(1 / 3)), (3, pytest.approx(2 / 3))]


def test_bf16_defaults_differ_from_grpo_configs_as_documented(tmp_path):
    """docs/rl.md: ``GRPOConfig()`` resolves ``bf16=None`` to ``not fp16`` on every device; ``GRPOArguments()``
    keeps ``False``, and ``from_hf`` takes the resolved value."""
    trl = pytest.importorskip("trl")
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert theirs.bf16 is True and trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp16=True).bf16 is False
    assert GRPOArguments().bf16 is False and GRPOArguments.from_hf(theirs).bf16 is True


# -- where completions draw their randomness (generation_rng) ---------------------------------


def _run_from(tmp_path, name, global_seed, **kw):
    args = grpo_args(tmp_path / name, max_steps=2, eval_strategy="steps", eval_steps=2, **kw)
    prompts, model = [{"prompt": str(d)} for d in range(8)], lm()
    torch.manual_seed(global_seed)  # the global generator as the run starts (GRPOTrainer: its set_seed)
    out = train(model, args, prompts, digit_sum, eval_prompts=prompts[:4], codec=CODEC)
    return [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k} for e in out.log_history]


def test_global_generation_rng_samples_from_torchs_generator_and_keyed_does_not(tmp_path):
    """``generation_rng="global"`` (the facade's): completions, hence rewards, follow torch's global generator as the
    run starts; ``"keyed"`` (``train``'s default): not at all."""
    reward = lambda h: [e.get("reward", e.get("eval_reward")) for e in h if "reward" in e or "eval_reward" in e]
    for rng in ("keyed", "global"):
        one, again, other = (_run_from(tmp_path, f"{rng}{i}", s, generation_rng=rng) for i, s in enumerate((1, 1, 2)))
        assert one == again
        assert (reward(one) == reward(other)) == (rng == "keyed"), rng
    assert _run_from(tmp_path, "default", 2) == _run_from(tmp_path, "keyed", 1, generation_rng="keyed")


def test_global_generation_rng_draws_in_trls_order():
    """The draws of a training generation: the loader's one at the epoch's start, a multinomial per token over the
    generation's rows, then the rows' permutation; an evaluation's: its loader's, then its batches'."""
    model, prompts = lm(), [[1, 2], [3], [1, 2], [3]]
    state = init_state(model, sgd(0.1), copy=True)
    torch.manual_seed(5)
    loader_draw()
    made = global_completions(model, state, prompts, Sampling(2, 3), None, 0, True)
    perm = shuffled_rows(4)
    torch.manual_seed(5)
    torch.empty((), dtype=torch.int64).random_()  # torch's DataLoader: its workers' base seed
    params = dict(state.params)
    expected = [list(p) for p in prompts]
    for _ in range(3):  # no end token: every row runs to the length, one draw over all rows per token
        ids, mask = pad_right(expected)
        logits = functional_forward(model)(params, {"input_ids": ids, "attention_mask": mask})
        last = logits[torch.arange(4), mask.sum(1) - 1].float()
        for row, tok in enumerate(torch.multinomial(torch.softmax(last, -1), 1).squeeze(-1).tolist()):
            expected[row].append(tok)
    assert made == [e[len(p) :] for e, p in zip(expected, prompts)]
    assert torch.equal(perm, torch.randperm(4))


@pytest.mark.parametrize("other", [{"max_staleness": 1}, {"rollout_engine": "process"}])
def test_global_generation_rng_is_refused_where_trls_order_cannot_hold(tmp_path, other):
    with pytest.raises(ValueError, match=f"generation_rng='global' with {next(iter(other))}="):
        grpo_args(tmp_path, generation_rng="global", **other)
