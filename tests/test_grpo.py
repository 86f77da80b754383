"""GRPO: sampling, rewards, group-relative advantages, the clipped loss, a research loop (``loop.run`` over the
run's generation stream)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import EPS, grad_atol, reordered, row_abs_grads

from trainfold import adamw, init_state, loop, make_step, sgd
from trainfold.core.generate import functional_forward, generate, token_logps
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.grpo.args import GRPOArguments
from trainfold.grpo.objective import grpo_objective
from trainfold.grpo.rewards import combine_rewards, group_advantages
from trainfold.grpo.run import BUFFER, Codec, grpo_stream

CFG = TinyLMConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_len=32)


def lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(CFG)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


CODEC = Codec(lambda s: [1 + int(c) for c in s], lambda ids: "".join(str(i % 10) for i in ids))


def grpo_run(model, reward, **settings):
    """The run's generation stream on 8 one-digit prompts: 4 completions per micro-batch, 2 per prompt."""
    settings = {"per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 3, **settings}
    prompts = [{"prompt": str(d)} for d in range(8)]
    return grpo_stream(model, GRPOArguments(seed=1, **settings), prompts, reward, codec=CODEC)


def research_loop(model, run, opt, steps, **kwargs):
    """``loop.run`` over the run's stream: the research loop, ``steps`` optimizer steps."""
    step = make_step(model, optimizer=opt, objective=run.objective)
    state = init_state(model, opt, seed=run.args.seed)
    return loop.run(step, state, run.stream(), stop=lambda s: int(s.step) >= steps, **kwargs)


# -- generate -------------------------------------------------------------------------------


def test_generate_is_seeded_and_leaves_the_model_alone():
    model = lm()
    model.train()
    params = params_of(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = [[1, 2, 3], [4], [5, 6]]

    def draw(seed):
        return generate(model, params, prompts, max_new_tokens=5, generator=torch.Generator().manual_seed(seed))

    assert draw(0) == draw(0)
    assert draw(0) != draw(1)
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_batched_generation_equals_one_prompt_at_a_time_and_stops_after_eos():
    model = lm(1)
    params = params_of(model)
    prompts = [[1, 2, 3, 4], [5], [6, 7]]
    together = generate(model, params, prompts, max_new_tokens=6, temperature=0)
    alone = [generate(model, params, [p], max_new_tokens=6, temperature=0)[0] for p in prompts]
    assert together == alone
    eos = together[0][1]
    stopped = generate(model, params, prompts[:1], max_new_tokens=6, temperature=0, eos_token_id=eos)
    assert stopped[0] == together[0][: together[0].index(eos) + 1]


def test_generate_runs_hugging_face_models_like_their_own_greedy_search():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    prompt = [3, 7, 9]
    ours = generate(model, params_of(model), [prompt], max_new_tokens=5, temperature=0)[0]
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0)[0, 3:].tolist()
    assert ours == theirs


# -- rewards and advantages -----------------------------------------------------------------


def test_advantages_match_trl_on_its_trace_example():
    adv = group_advantages(torch.tensor([5.0, 2.0, 4.0, 4.0]), 4)
    torch.testing.assert_close(adv, torch.tensor([0.9933, -1.3906, 0.1987, 0.1987]), atol=1e-4, rtol=0)


def test_batch_scaling_keeps_group_means_but_divides_by_the_batch_std():
    r = torch.tensor([1.0, 3.0, 10.0, 30.0])
    adv = group_advantages(r, 2, "batch")
    expected = torch.tensor([-1.0, 1.0, -10.0, 10.0]) / (r.std() + 1e-4)
    torch.testing.assert_close(adv, expected)


def test_combine_rewards_weights_functions_and_passes_columns():
    def match(prompts, completions, answer, **_):
        return [float(c == a) for c, a in zip(completions, answer)]

    def short(prompts, completions, **_):
        return [None if c == "" else 1.0 / len(c) for c in completions]

    total, each = combine_rewards(
        [match, short], ["q", "q", "q"], ["ab", "", "b"], {"answer": ["ab", "x", "x"]}, [2.0, 1.0]
    )
    assert total.tolist() == [2.5, 0.0, 1.0]
    assert math.isnan(each[1, 1].item())


rewards_lists = st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=2, max_size=6)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(2, 5).flatmap(
        lambda g: st.tuples(
            st.just(g),
            st.lists(
                st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=g, max_size=g),
                min_size=1,
                max_size=4,
            ),
        )
    )
)
def test_advantage_properties(case):
    g, groups = case
    r = torch.tensor([x for grp in groups for x in grp])
    adv = group_advantages(r, g).reshape(-1, g)
    assert torch.isfinite(adv).all()
    for grp, a in zip(groups, adv):
        spread = torch.tensor(grp, dtype=torch.float64).std().item()
        rounding = 2.4e-7 * max(abs(x) for x in grp) / (spread + 1e-4)  # float32 r - mean (4 ulps), as in TRL
        torch.testing.assert_close(a.mean(), torch.tensor(0.0), atol=1e-4 + rounding, rtol=0)
        std = torch.tensor(grp, dtype=torch.float64).std()
        if std > 1e-2:  # (r - mean) / (std + 1e-4) has std std / (std + 1e-4), within 1% of 1
            assert a.double().std().item() == pytest.approx(1.0, rel=1e-2)
        if len(set(grp)) == 1:
            assert torch.equal(a, torch.zeros(g))
    none = group_advantages(r, g, "none").reshape(-1, g)
    torch.testing.assert_close(none, r.reshape(-1, g) - r.reshape(-1, g).mean(1, keepdim=True), atol=1e-3, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.one_of(st.just(math.nan), st.floats(-10, 10, width=32)), min_size=4, max_size=4),
    st.sampled_from(["group", "batch", "none"]),
)
def test_unscored_rewards_never_make_nan_advantages(rewards, scale):
    r = torch.tensor(rewards)
    adv = group_advantages(r, 2, scale)
    assert torch.isfinite(adv).all()
    assert torch.all(adv[torch.isnan(r)] == 0)


# -- the objective --------------------------------------------------------------------------


def rollout_batch(seed=0, rows=4, prompt_len=3, completion_len=4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, CFG.vocab_size, (rows, prompt_len + completion_len), generator=g)
    completion = torch.zeros_like(ids)
    completion[:, prompt_len:] = 1
    completion[0, -1] = 0  # a shorter completion (right padding)
    attention = torch.ones_like(ids)
    attention[0, -1] = 0
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "advantages": torch.randn(rows, generator=g),
    }


def inputs(batch):
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def test_on_policy_loss_value_is_minus_mean_advantage():
    model = lm()
    batch = rollout_batch()
    obj = grpo_objective("grpo")
    loss, aux = obj(functional_forward(model), params_of(model), batch, obj.count_items(batch))
    assert loss.item() == pytest.approx(-batch["advantages"].mean().item(), abs=1e-6)
    assert aux["clip_ratio/region_mean"].item() == 0


def test_ratio_outside_the_clip_range_is_clipped_and_gives_no_gradient():
    model = lm()
    params = {k: v.requires_grad_() for k, v in params_of(model).items()}
    batch = rollout_batch()
    batch["advantages"] = torch.ones(4)
    with torch.no_grad():
        logps = token_logps(functional_forward(model)(params, inputs(batch)), batch["input_ids"])
    batch["old_logps"] = logps - 1.0  # ratio e > 1 + epsilon everywhere, with positive advantages
    obj = grpo_objective("bnpo", epsilon=0.2)
    loss, aux = obj(functional_forward(model), params, batch, obj.count_items(batch))
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)
    assert aux["clip_ratio/high_mean"].item() == pytest.approx(1.0)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True, materialize_grads=True)
    assert all(torch.all(g == 0) for g in grads)


def test_kl_to_an_identical_reference_is_zero_and_to_another_is_positive():
    model, other = lm(0), lm(1)
    forward = functional_forward(model)
    batch = rollout_batch()
    obj = grpo_objective("grpo", beta=0.1)
    with torch.no_grad():
        same = token_logps(forward(params_of(model), inputs(batch)), batch["input_ids"])
        diff = token_logps(forward(params_of(other), inputs(batch)), batch["input_ids"])
    _, aux = obj(forward, params_of(model), {**batch, "ref_logps": same}, torch.tensor(4))
    assert aux["kl"].item() == pytest.approx(0.0, abs=1e-6)
    _, aux = obj(forward, params_of(model), {**batch, "ref_logps": diff}, torch.tensor(4))
    assert aux["kl"].item() > 0


def with_block(batch, micro_batches):
    """Mark ``batch`` as the rows of a generation block of ``micro_batches`` (what the run's stream records)."""
    rows = len(batch["advantages"])
    tokens = int(batch["completion_mask"].sum())
    return {
        **batch,
        "generation_tokens": torch.full((rows,), tokens),
        "generation_micro_batches": torch.full((rows,), micro_batches),
    }


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_step_does_not_depend_on_the_micro_batch_split(loss_type):
    model = lm()
    batch = rollout_batch(rows=6)
    batch["old_logps"] = torch.zeros(6, 6) - 2.5
    obj = grpo_objective(loss_type, max_completion_length=4)
    opt = sgd(0.5)
    step = make_step(model, optimizer=opt, objective=obj)
    state = init_state(model, opt)
    whole = step(state, [with_block(batch, 1)])
    split = with_block(batch, 2)
    halves = step(state, [{k: v[:2] for k, v in split.items()}, {k: v[2:] for k, v in split.items()}])
    assert whole.metrics["grad_norm"].item() > 1e-4
    # The rows' terms in another order (tests/tolerance.py): each gradient within grad_atol of the rows'
    # measured sizes (each row's objective over the step's count), moved by 0.5 of it, rounded once; the
    # loss within the same bound on its own terms (signed: advantages).
    forward, count = functional_forward(model), whole.metrics["num_items"]
    one = lambda p, r: obj(forward, p, {k: v[r : r + 1] for k, v in with_block(batch, 6).items()}, count, None)[0]
    sizes, terms = row_abs_grads(one, state.params, range(6)), batch["completion_mask"].numel()
    losses = [one(state.params, r).abs().item() for r in range(6)]
    assert halves.metrics["loss"].item() == pytest.approx(
        whole.metrics["loss"].item(), abs=reordered(terms, sum(losses))
    )
    atol = grad_atol(sizes, terms)
    for k in whole.params:
        torch.testing.assert_close(halves.params[k], whole.params[k], atol=0.5 * atol[k], rtol=EPS)


def test_dapo_normalises_every_step_of_a_block_by_its_tokens_per_step():
    model = lm()
    first, second = rollout_batch(rows=4, seed=1), rollout_batch(rows=4, seed=2)
    second["completion_mask"][:, -2:] = 0  # the block's steps hold different token counts
    tokens = int(first["completion_mask"].sum() + second["completion_mask"].sum())
    obj, bnpo = grpo_objective("dapo"), grpo_objective("bnpo")
    forward, params = functional_forward(model), params_of(model)
    for part in (first, second):  # a block of 2 optimizer steps of 1 micro-batch each
        marked = {
            **part,
            "generation_tokens": torch.full((4,), tokens),
            "generation_micro_batches": torch.full((4,), 2),
        }
        loss, _ = obj(forward, params, marked, obj.count_items(marked))
        own, _ = bnpo(forward, params, part, bnpo.count_items(part))  # normalised by the step's own tokens
        own_tokens = int(part["completion_mask"][:, 1:].sum())
        assert loss.item() == pytest.approx(own.item() * own_tokens / (tokens / 2), rel=1e-5)


def test_dr_grpo_divides_by_the_maximum_completion_length():
    model = lm()
    batch = rollout_batch()
    a = grpo_objective("dr_grpo", max_completion_length=4)
    b = grpo_objective("dr_grpo", max_completion_length=8)
    args = (functional_forward(model), params_of(model), batch, torch.tensor(4))
    assert a(*args)[0].item() == pytest.approx(2 * b(*args)[0].item(), abs=1e-6)


# -- the loop -------------------------------------------------------------------------------


def first_digit_is_seven(prompts, completions, **_):
    return [float(c[:1] == "7") for c in completions]


def digit_sum(prompts, completions, **_):
    return [sum(int(ch) for ch in c) / 10 for c in completions]


@pytest.mark.parametrize("spg, iterations", [(1, 1), (3, 1), (1, 2)])
def test_the_research_loop_generates_once_per_block_with_the_state_it_starts_from(spg, iterations):
    """loop.run over the run's stream: a generation every steps_per_generation x num_iterations micro-steps, made
    with the state the step starts from; old log-probs kept only when the generation outlives its step."""
    model, calls, fed, rewarded = lm(), [], [], []

    def recorded(prompts, completions, trainer_state, **_):
        calls.append(trainer_state.global_step)
        return digit_sum(prompts, completions)

    run = grpo_run(model, recorded, steps_per_generation=spg, num_iterations=iterations)

    def seen(s, log):
        fed.append(s.extras[BUFFER].advantages.clone())
        rewarded.append("reward" in s.metrics)

    hooks = [loop.every(1, seen)]
    state, log = research_loop(model, run, adamw(1e-3), 6, hooks=hooks)
    assert int(state.step) == 6 and log.status == "completed"
    assert calls == list(range(0, 6, spg * iterations))  # the latest state, once per block
    assert (state.extras[BUFFER].old_logps is not None) == (spg * iterations > 1)
    assert rewarded == [k in calls for k in range(6)] and "clip_ratio/region_mean" in state.metrics
    if iterations == 2:  # each generation trained on twice
        assert all(torch.equal(fed[i], fed[i + 1]) for i in (0, 2, 4))


def _example():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        import grpo_digits
    finally:
        sys.path.pop(0)
    return grpo_digits


def test_example_mean_reward_rises():
    rewards = _example().run(steps=40, seed=0)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.3, (first, last)


@pytest.mark.slow
def test_example_full_run_learns_digit_strings():
    steps = 200 if os.environ.get("TRAINFOLD_SLOW") == "full" else 80
    rewards = _example().run(steps=steps, seed=0)
    assert sum(rewards[-5:]) / 5 > 0.6


# -- errors ---------------------------------------------------------------------------------


def test_errors_name_the_bad_value_and_the_fix():
    with pytest.raises(ValueError, match="scale_rewards='mean'"):
        group_advantages(torch.zeros(4), 2, "mean")
    with pytest.raises(ValueError, match="num_generations=1"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match=r"shape \(5,\) do not split into groups of 2"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        combine_rewards([lambda prompts, completions: [0.0]], ["a", "b"], ["x", "y"])
    with pytest.raises(ValueError, match="loss_type='gspo'"):
        grpo_objective("gspo")
    with pytest.raises(KeyError, match="'generation_tokens', which grpo_stream's batches carry"):
        grpo_objective("dapo").count_items(rollout_batch())
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_objective("dr_grpo")
    with pytest.raises(ValueError, match="(?s)num_generations=1 must be >= 2.*temperature=0"):
        grpo_run(lm(), first_digit_is_seven, num_generations=1, temperature=0)
    with pytest.raises(TypeError, match=r"needs codec=trainfold.grpo.Codec\(encode, decode\)"):
        grpo_stream(lm(), GRPOArguments(per_device_train_batch_size=2, num_generations=2), [{"prompt": "1"}], len)
    model = lm()
    with pytest.raises(KeyError, match="grpo_stream's batches .beta > 0 scores the reference"):
        grpo_objective(beta=0.1)(functional_forward(model), params_of(model), rollout_batch(), torch.tensor(4))


def test_the_stream_and_the_objective_change_none_of_their_inputs():
    model = lm()
    opt = sgd(0.1)
    run = grpo_run(model, first_digit_is_seven, steps_per_generation=2, beta=0.05)  # the reference: the model
    prompts = [dict(p) for p in run.prompts]
    state = init_state(model, opt, seed=3)
    state = attrs.evolve(state, extras={**run.stream().extras, **state.extras})
    versions = {k: v._version for k, v in state.params.items()}
    item = next(iter(run.steps(state.cursor)))
    _, out = run.prepare(state, item)
    _, again = run.prepare(state, item)
    assert run.prompts == prompts  # each repeat a reward function sees is its own copy
    assert all(torch.equal(a[k], b[k]) for a, b in zip(out, again) for k in a)  # seeded from the state
    assert {k: v._version for k, v in state.params.items()} == versions
    batch_versions = [{k: v._version for k, v in mb.items()} for mb in out]
    make_step(model, optimizer=opt, objective=run.objective)(state, out)
    assert [{k: v._version for k, v in mb.items()} for mb in out] == batch_versions


# -- parity with TRL ------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_and_metrics_match_trl(tmp_path, loss_type):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    names = ["<pad>", "<s>", "</s>"] + [f"t{i}" for i in range(3, 64)]
    word = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<pad>"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=word, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    policy = LlamaForCausalLM(cfg)
    policy.save_pretrained(tmp_path / "policy")  # TRL loads its reference from the path when beta != 0
    tok.save_pretrained(tmp_path / "policy")
    temperature, beta, eps, eps_high, max_len = 0.7, 0.1, 0.2, 0.28, 5
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to=[],
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=max_len,
        beta=beta,
        loss_type=loss_type,
        temperature=temperature,
        epsilon=eps,
        epsilon_high=eps_high,
    )
    trainer = trl.GRPOTrainer(
        model=str(tmp_path / "policy"),
        reward_funcs=[lambda prompts, completions, **_: [0.0] * len(prompts)],
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": "t5 t6"}] * 4),
        processing_class=tok,
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 64, (4, 3), generator=g)
    completion = torch.randint(3, 64, (4, max_len), generator=g)
    completion_mask = torch.ones(4, max_len, dtype=torch.long)
    completion_mask[0, 3:] = 0
    completion_mask[2, 4:] = 0
    completion = completion * completion_mask
    ids = torch.cat([prompt, completion], 1)
    attention = torch.cat([torch.ones_like(prompt), completion_mask], 1)
    params = params_of(policy)
    with torch.no_grad():
        current = token_logps(policy(input_ids=ids, attention_mask=attention).logits, ids, temperature)[:, 2:]
    old = current + 0.4 * torch.randn(current.shape, generator=g)  # some ratios leave the clip range
    ref = current + 0.5 * torch.randn(current.shape, generator=g)
    advantages = torch.randn(4, generator=g)
    trl_loss = trainer._compute_loss(
        trainer.model,
        {
            "prompt_ids": prompt,
            "prompt_mask": torch.ones_like(prompt),
            "completion_ids": completion,
            "completion_mask": completion_mask,
            "advantages": advantages,
            "old_per_token_logps": old,
            "ref_per_token_logps": ref,
            "num_items_in_batch": completion_mask.sum(),
        },
    ).item()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    def ours_layout(x):  # TRL keeps completion positions only; ours scores every position t -> t+1
        return torch.cat([torch.zeros(4, 2), x], 1)

    batch = {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": torch.cat([torch.zeros_like(prompt), completion_mask], 1),
        "advantages": advantages,
        "old_logps": ours_layout(old),
        "ref_logps": ours_layout(ref),
        "generation_tokens": torch.full((4,), int(completion_mask.sum())),  # one micro-batch per generation
        "generation_micro_batches": torch.full((4,), 1),
    }
    obj = grpo_objective(
        loss_type, epsilon=eps, epsilon_high=eps_high, beta=beta, temperature=temperature, max_completion_length=max_len
    )
    loss, aux = obj(functional_forward(policy), params, batch, obj.count_items(batch))
    assert loss.item() == pytest.approx(trl_loss, abs=1e-5)
    assert trl_metrics["clip_ratio/region_mean"] > 0
    if loss_type in ("bnpo", "dapo"):  # our metrics aggregate like the loss; TRL's are token means, as these are
        for k in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert aux[k].item() == pytest.approx(trl_metrics[k], abs=1e-5), k
    # the GRPO run's micro-batches (step_micro_batches) log TRL's per-completion extremes too
    _, run_aux = obj(
        functional_forward(policy), params, {**batch, "step_micro_batches": torch.full((4,), 1)}, obj.count_items(batch)
    )
    assert trl_metrics["clip_ratio/low_min"] != trl_metrics["clip_ratio/high_max"]
    for k in ("clip_ratio/low_min", "clip_ratio/high_max"):
        assert run_aux[k].item() == pytest.approx(trl_metrics[k], abs=1e-6), k


@pytest.mark.parametrize("spg, iterations", [(3, 1), (1, 2)])
def test_the_research_loop_resumes_bitwise_inside_a_generation_block(tmp_path, spg, iterations):
    """loop.run over the run's stream, stopped at step 2 (inside a block of 3 micro-steps) and resumed from its
    checkpoint, ends bitwise where the uninterrupted loop does: the generation is in the state."""
    run = grpo_run(lm(), digit_sum, steps_per_generation=spg, num_iterations=iterations)
    straight, _ = research_loop(lm(), run, adamw(1e-2), 6)
    first, log = research_loop(lm(), run, adamw(1e-2), 2, hooks=[loop.save(every=1)], output_dir=tmp_path)
    resumed, again = research_loop(lm(), run, adamw(1e-2), 6, hooks=[loop.save(every=1)], output_dir=tmp_path,
                                   resume=True)  # fmt: skip
    assert int(first.step) == 2 and again.resumed_from is not None and int(resumed.step) == 6
    assert not torch.equal(straight.params["tok.weight"], run.model.tok.weight)
    for k in straight.params:
        assert torch.equal(straight.params[k], resumed.params[k]), k


def test_grpo_trains_a_hugging_face_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    run = grpo_run(model, digit_sum, steps_per_generation=2, beta=0.04)  # the reference: the model as given
    state, _ = research_loop(model, run, adamw(1e-2), 2)
    assert all(math.isfinite(state.metrics[k].item()) for k in ("loss", "kl", "entropy"))
    assert state.metrics["kl"].item() > 0  # the second step trained on a buffer the first step had changed


# -- the layout: rows, the forward adapter, trainfold.grpo -----------------------------------


def test_completion_rows_mask_the_prompt_and_pad_right():
    from trainfold.core.generate import before_eos
    from trainfold.grpo.objective import completion_rows

    rows = completion_rows([[5, 6], [7]], [[1, 9], [2]], pad=3)
    assert rows["input_ids"].tolist() == [[5, 6, 1, 9], [7, 2, 3, 3]]
    assert rows["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert rows["completion_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert before_eos([4, 2, 5, 2], 2) == [4] and before_eos([4, 5], 2) == [4, 5]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), min_size=1, max_size=4))
def test_spreading_completion_values_then_gathering_them_gives_them_back(shapes):
    from trainfold.grpo.objective import gather_completions, spread_completions

    prompts, lengths = [p for p, _ in shapes], [n for _, n in shapes]
    width = max(p + n for p, n in shapes)
    values = torch.arange(len(shapes) * 4, dtype=torch.float32).reshape(len(shapes), 4) + 1
    kept = torch.stack([torch.cat([v[:n], torch.zeros(4 - n)]) for v, n in zip(values, lengths)])
    spread = spread_completions(values, prompts, lengths, width)
    assert torch.equal(gather_completions(spread, prompts, lengths, 4), kept)
    assert int((spread != 0).sum()) == sum(lengths)  # nothing outside the completion positions


def test_functional_forward_is_make_forward_with_the_models_own_tensors_filled_in():
    from trainfold.core.forward import make_forward

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).eval()
    x = {"input": torch.randn(4, 3)}
    params = {k: v.detach() + 1 for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    assert torch.equal(functional_forward(model, buffers)(params, x), make_forward(model, buffers)(params, x))
    assert torch.equal(functional_forward(model)(params, x), make_forward(model, buffers)(params, x))
    partial = {"0.weight": params["0.weight"]}  # the rest (a frozen bias, the buffers) from the model
    own = {k: v.detach() for k, v in model.named_parameters()}
    expected = make_forward(model, buffers)({**own, **partial}, x)
    assert torch.equal(functional_forward(model)(partial, x), expected)


def test_trainfold_grpo_offers_the_recipe_the_arguments_and_the_run():
    import trainfold
    from trainfold.grpo import args as grpo_args
    from trainfold.grpo import objective
    from trainfold.grpo import run as run_module

    assert trainfold.grpo.__name__ == "trainfold.grpo"  # one folder: the pieces, the Arguments and the run
    assert trainfold.grpo.train is run_module.train and trainfold.grpo.GRPOArguments is grpo_args.GRPOArguments
    assert {"grpo_stream", "Codec", "GRPORun"} <= set(trainfold.grpo.__all__)
    assert not {"make_rollout", "grpo_trajectory", "Rollout"} & set(trainfold.grpo.__all__)  # one driver: loop.run
    assert trainfold.grpo.grpo_objective is objective.grpo_objective
