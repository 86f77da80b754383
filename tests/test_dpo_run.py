"""DPO as a run (issue 20, items 5-7): evaluation of objectives, TRL-shaped data, reference caching, checkpointing.

Reference values come from a real TRL 1.16 ``DPOTrainer`` on a tiny random Llama built from a config.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from tolerance import EPS

from trainfold import TrainingArguments, train
from trainfold import evaluate as evaluate_run
from trainfold.dpo.objective import dpo_objective, preference_collate

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

EOS = 2
NAMES = ["<pad>", "<s>", "</s>"] + [f"t{i}" for i in range(3, 128)]


def tiny_llama(seed: int = 0, vocab: int = 128) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.5,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def noisy(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return out


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def random_pairs(seed: int, n: int, vocab: int = 128) -> list[dict]:
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(3, vocab, (int(torch.randint(lo, hi, (), generator=g)),), generator=g).tolist()

    return [{"prompt_ids": [1, *ids(1, 4)], "chosen_ids": ids(1, 5), "rejected_ids": ids(1, 5)} for _ in range(n)]


def args_for(tmp_path, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
    )
    return TrainingArguments(**{**base, **kw})


# -- TRL's evaluation ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_setup():
    """A DPOTrainer on the study's tiny Llama pair (policy, noisy reference) and 6 preference pairs as text rows."""
    trl = pytest.importorskip("trl")
    from tokenizers import Tokenizer, models, pre_tokenizers

    word = Tokenizer(models.WordLevel({n: i for i, n in enumerate(NAMES)}, unk_token="<pad>"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=word, pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )
    policy = tiny_llama(0)
    ref = noisy(policy)
    pairs = random_pairs(3, 6)

    def text(ids):
        return " ".join(NAMES[i] for i in ids)

    rows = [
        {
            "prompt": text(p["prompt_ids"]),
            "chosen": f" {text(p['chosen_ids'])} ",
            "rejected": f" {text(p['rejected_ids'])} ",
        }
        for p in pairs
    ]

    def trainer(tmp, rows_, batch_size, compute_metrics=None):
        args = trl.DPOConfig(
            output_dir=str(tmp),
            max_length=None,
            bf16=False,
            use_cpu=True,
            report_to=[],
            beta=0.1,
            per_device_eval_batch_size=batch_size,
            disable_tqdm=True,
        )
        return trl.DPOTrainer(
            model=copy.deepcopy(policy),
            ref_model=copy.deepcopy(ref),
            args=args,
            train_dataset=datasets.Dataset.from_list(rows_),
            eval_dataset=datasets.Dataset.from_list(rows_),
            processing_class=tok,
            compute_metrics=compute_metrics,
        )

    return {"policy": policy, "ref": ref, "pairs": pairs, "rows": rows, "trainer": trainer}


def ours(setup, tmp_path, batch_size, pairs=None, **kw):
    return evaluate_run(
        setup["policy"],
        args_for(tmp_path, per_device_eval_batch_size=batch_size),
        setup["pairs"] if pairs is None else pairs,
        data_collator=preference_collate(EOS),
        objective=dpo_objective(0.1, ref_params=params_of(setup["ref"])),
        **kw,
    )


def test_eval_metrics_equal_trl_evaluate(trl_setup, tmp_path):
    trainer = trl_setup["trainer"](tmp_path / "trl", trl_setup["rows"], 2)
    assert [trainer.eval_dataset[i]["prompt_ids"] for i in range(6)] == [p["prompt_ids"] for p in trl_setup["pairs"]]
    theirs = trainer.evaluate()
    mine = ours(trl_setup, tmp_path, 2)
    skip = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_num_tokens", "epoch"}
    expected = sorted(k for k in theirs if k not in skip)
    assert expected == sorted(k for k in mine if k not in skip)  # eval_loss and every eval_rewards/*, eval_logps/*...
    assert {"eval_rewards/chosen", "eval_rewards/margins", "eval_logps/rejected", "eval_logits/chosen"} <= set(mine)
    for k in expected:
        assert mine[k] == pytest.approx(theirs[k], abs=1e-5), k


def test_eval_over_uneven_batches_is_trls_pair_mean_loss_and_batch_mean_metrics(trl_setup, tmp_path):
    # Batches of 4: [4 pairs, 2 pairs]. TRL's eval_loss is the pair mean (HF weights each batch by its size), but its
    # eval_rewards/* (all its stored metrics) are the plain mean of the two batch means: trainfold's are the same.
    whole = trl_setup["trainer"](tmp_path / "a", trl_setup["rows"], 4).evaluate()
    first = trl_setup["trainer"](tmp_path / "b", trl_setup["rows"][:4], 4).evaluate()
    last = trl_setup["trainer"](tmp_path / "c", trl_setup["rows"][4:], 4).evaluate()
    mine = ours(trl_setup, tmp_path, 4)
    assert mine["eval_loss"] == pytest.approx(whole["eval_loss"], abs=1e-5)
    assert mine["eval_loss"] == pytest.approx((4 * first["eval_loss"] + 2 * last["eval_loss"]) / 6, abs=1e-5)
    for k in ("eval_rewards/chosen", "eval_rewards/accuracies", "eval_logps/chosen", "eval_entropy"):
        assert mine[k] == pytest.approx((first[k] + last[k]) / 2, abs=1e-5), k
        assert mine[k] == pytest.approx(whole[k], abs=1e-5), k
    assert mine["eval_samples_per_second"] > 0 and whole["eval_samples_per_second"] > 0


def test_compute_metrics_gets_trls_eval_prediction(trl_setup, tmp_path):
    seen = {}

    def record(name):
        def compute_metrics(p):
            seen[name] = p
            return {"rows": float(p.predictions.shape[0])}

        return compute_metrics

    theirs = trl_setup["trainer"](tmp_path / "trl", trl_setup["rows"], 2, record("trl")).evaluate()
    mine = ours(trl_setup, tmp_path, 2, compute_metrics=record("ours"))
    assert mine["eval_rows"] == theirs["eval_rows"] == 12.0  # per batch: its chosen rows, then its rejected rows
    np.testing.assert_array_equal(seen["ours"].label_ids, seen["trl"].label_ids)  # input_ids, -100 between batches
    np.testing.assert_allclose(seen["ours"].predictions, seen["trl"].predictions, atol=1e-5)  # the policy's logits
    assert mine["eval_rewards/margins"] == pytest.approx(theirs["eval_rewards/margins"], abs=1e-5)
    # Where TRL is wrong: with a last batch of 2 pairs (4 rows), accelerate's gather_for_metrics cuts it to 2 rows
    # (it counts dataset rows, not the 2 rows per pair), so TRL's compute_metrics loses that batch's rejected rows.
    trl_cut = trl_setup["trainer"](tmp_path / "cut", trl_setup["rows"], 4, record("trl")).evaluate()
    mine_4 = ours(trl_setup, tmp_path, 4, compute_metrics=record("ours"))
    assert (trl_cut["eval_rows"], mine_4["eval_rows"]) == (10.0, 12.0)


# -- evaluation during train -----------------------------------------------------------------------


def test_train_logs_eval_loss_and_the_objectives_metrics(tmp_path):
    policy, ref = tiny_llama(0, vocab=32), tiny_llama(1, vocab=32)
    items, held_out = random_pairs(0, 8, vocab=32), random_pairs(1, 4, vocab=32)
    calls = []

    def compute_metrics(p):
        calls.append(p.predictions.shape)
        return {"rows": float(p.label_ids.shape[0])}

    objective = dpo_objective(0.1, ref_params=params_of(ref))
    args = args_for(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1)
    result = train(
        policy,
        args,
        datasets.Dataset.from_list(items),
        eval_dataset=held_out,
        data_collator=preference_collate(EOS),
        objective=objective,
        compute_metrics=compute_metrics,
    )
    evals = [h for h in result.log_history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [1, 2] and len(calls) == 2
    last = evals[-1]
    for k in (
        "eval_rewards/chosen",
        "eval_rewards/rejected",
        "eval_rewards/accuracies",
        "eval_rewards/margins",
        "eval_logps/chosen",
        "eval_logps/rejected",
        "eval_logits/chosen",
        "eval_logits/rejected",
        "eval_rows",
    ):
        assert k in last, k
    again = evaluate_run(
        policy, args, held_out, state=result.state, data_collator=preference_collate(EOS), objective=objective
    )
    for k in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen"):
        assert again[k] == last[k], k  # the same state, rows, batches and ops: bitwise


def test_a_generic_objective_is_evaluated_too(tmp_path):
    from trainfold.core.models import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))

    def objective(forward, params, micro, num_items, key):
        logits = forward(params, {"input_ids": micro["input_ids"]})
        loss = (
            torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), micro["input_ids"][:, 1:].flatten(), reduction="sum"
            )
            / num_items
        )
        return loss, {"rows_seen": micro["input_ids"].shape[0] / num_items}

    rows = [{"input_ids": [i % 16, (i + 1) % 16, (i + 2) % 16]} for i in range(5)]
    args = args_for(tmp_path, per_device_eval_batch_size=2)
    got = evaluate_run(model, args, rows, objective=objective, compute_metrics=lambda p: {"n": p.label_ids.shape[0]})
    assert got["eval_rows_seen"] == pytest.approx(1.0) and got["eval_n"] == 5  # labels: the input_ids
    assert got["eval_loss"] > 0


def test_eval_errors_name_the_fix(tmp_path):
    from trainfold.evaluation.evaluation import evaluate_batches

    batch = preference_collate(EOS)(random_pairs(0, 2, vocab=32))
    model = tiny_llama(0, vocab=32)
    with pytest.raises(ValueError, match="include_for_metrics=\\['loss'\\].*objective"):
        evaluate_batches(
            model,
            None,
            [batch],
            objective=dpo_objective(0.1, ref_params=params_of(model)),
            include_for_metrics=["loss"],
            compute_metrics=lambda p: {},
        )
    with pytest.raises(ValueError, match="objective must be a function"):
        evaluate_batches(model, None, [batch], objective=3)


# -- data as TRL users hold it (item 6) --------------------------------------------------------------


def tokenized_rows(n: int, vocab: int = 32) -> datasets.Dataset:
    """Tokenized preference rows as TRL 1.16's DPOTrainer stores them (prompt_ids, chosen_ids, rejected_ids) + text."""
    return datasets.Dataset.from_list(
        [{**p, "prompt": "some text", "length_hint": "x"} for p in random_pairs(7, n, vocab)]
    )


def test_remove_unused_columns_keeps_the_preference_columns_of_a_dataset(tmp_path):
    # TRL 1.16 names the tokenized columns prompt_ids/chosen_ids/rejected_ids (DPOTrainer._set_signature_columns).
    policy = tiny_llama(0, vocab=32)
    objective = dpo_objective(0.1, ref_params=params_of(tiny_llama(1, vocab=32)))
    data = tokenized_rows(8)
    args = args_for(tmp_path, max_steps=2, remove_unused_columns=True, eval_strategy="steps", eval_steps=2)
    result = train(
        policy, args, data, eval_dataset=tokenized_rows(4), data_collator=preference_collate(EOS), objective=objective
    )
    assert result.status == "completed" and "eval_rewards/margins" in result.log_history[-2]
    metrics = evaluate_run(policy, args, data, data_collator=preference_collate(EOS), objective=objective)
    assert "eval_rewards/chosen" in metrics
    plain = evaluate_run(policy, args, data, data_collator=preference_collate(EOS))  # the collator's columns too
    assert "eval_runtime" in plain and "eval_loss" not in plain  # no objective: nothing to score (no labels)
    with pytest.raises(KeyError, match="rename \\['prompt_input_ids'.*prompt_ids"):
        preference_collate(EOS)([{"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": [3]}])


def test_group_by_length_measures_prompt_plus_the_longer_completion(tmp_path, monkeypatch):
    from trainfold.data.samplers import dataset_lengths, make_sampler

    rows = random_pairs(5, 12, vocab=32)
    expected = tuple(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows)
    assert dataset_lengths(rows) == expected
    data = datasets.Dataset.from_list(rows)
    real = type(data).__getitem__

    def no_rows(self, key):  # the arrow path reads columns, never a row
        if isinstance(key, int):
            raise AssertionError("read a row")
        return real(self, key)

    monkeypatch.setattr(type(data), "__getitem__", no_rows)
    with pytest.warns(UserWarning, match="prompt \\+ the longer completion"):
        assert dataset_lengths(data) == expected
    monkeypatch.undo()
    sampler = make_sampler("group_by_length", rows, per_device_train_batch_size=4, lengths=None)
    first = sampler.epoch_batches(0)[0][0]
    assert expected[first[0]] == max(expected)  # the longest pair leads the first batch
    args = args_for(tmp_path, max_steps=2, train_sampling_strategy="group_by_length")
    with pytest.warns(UserWarning, match="longer completion"):
        result = train(
            tiny_llama(0, vocab=32),
            args,
            data,
            data_collator=preference_collate(EOS),
            objective=dpo_objective(0.1, ref_params=params_of(tiny_llama(1, vocab=32))),
        )
    assert result.status == "completed"


def test_pad_to_multiple_of_pads_the_width_and_changes_no_number():
    model, ref = tiny_llama(0, vocab=32), tiny_llama(1, vocab=32)
    items = random_pairs(2, 3, vocab=32)
    plain, padded = preference_collate(EOS)(items), preference_collate(EOS, pad_to_multiple_of=8)(items)
    assert padded["input_ids"].shape[1] % 8 == 0 and padded["input_ids"].shape[1] >= plain["input_ids"].shape[1]
    width = plain["input_ids"].shape[1]
    for k in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(padded[k][:, :width], plain[k]) and not padded[k][:, width:].any(), k
    from trainfold.core.generate import functional_forward

    obj = dpo_objective(0.1, ref_params=params_of(ref))
    a = obj(functional_forward(model), params_of(model), plain, obj.count_items(plain))
    b = obj(functional_forward(model), params_of(model), padded, obj.count_items(padded))
    assert a[0].item() == pytest.approx(b[0].item(), abs=1e-6)
    for k in a[1]:
        assert a[1][k].item() == pytest.approx(b[1][k].item(), abs=1e-5), k
    with pytest.raises(ValueError, match="pad_to_multiple_of=0 must be a positive int"):
        preference_collate(EOS, pad_to_multiple_of=0)


def test_training_arguments_pad_to_multiple_of_reaches_the_collators(tmp_path):
    from trainfold.data import PadCollate
    from trainfold.data.columns import padded_to_multiple

    assert padded_to_multiple(preference_collate(EOS), 16).pad_to_multiple_of == 16
    assert isinstance(padded_to_multiple(None, 4), PadCollate) and padded_to_multiple(None, 4).pad_to_multiple_of == 4
    with pytest.raises(ValueError, match="pads to a multiple of 8; set one of them"):
        padded_to_multiple(preference_collate(EOS, pad_to_multiple_of=8), 16)
    with pytest.raises(TypeError, match="function, which has no pad_to_multiple_of field"):
        padded_to_multiple(lambda items: items, 16)
    with pytest.raises(ValueError, match="pad_to_multiple_of must be a positive int"):
        TrainingArguments(pad_to_multiple_of=0)

    dpo = dpo_objective(0.1, ref_params=params_of(tiny_llama(1, vocab=32)))
    widths = []

    def recording(forward, params, micro, num_items, key):  # DPO, noting each batch's width
        widths.append(micro["input_ids"].shape[1])
        return dpo(forward, params, micro, num_items, key)

    recording.count_items, recording.columns = dpo.count_items, dpo.columns
    args = args_for(tmp_path, max_steps=2, pad_to_multiple_of=16, eval_strategy="steps", eval_steps=2)
    result = train(
        tiny_llama(0, vocab=32),
        args,
        random_pairs(0, 4, vocab=32),
        eval_dataset=random_pairs(1, 2, 32),
        data_collator=preference_collate(EOS),
        objective=recording,
    )
    assert result.status == "completed"
    assert widths == [16, 16, 16]  # two train steps, one evaluation


# -- gradient checkpointing (item 7) -------------------------------------------------------------------


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("make", [lambda s: tiny_llama(s, vocab=32), tiny_gpt2], ids=["llama", "gpt2"])
def test_gradient_checkpointing_trains_dpo_and_equals_the_plain_run(tmp_path, make):
    items = random_pairs(4, 8, vocab=32)
    runs = {}
    for on in (False, True):
        policy, ref = make(0), make(1)
        attention = [m for n, m in policy.named_modules() if n.endswith(("layers.0.self_attn", "h.0.attn"))][0]
        calls = []
        attention.register_forward_hook(lambda *_, calls=calls: calls.append(torch.is_grad_enabled()))
        args = args_for(
            tmp_path / str(on),
            max_steps=2,
            gradient_checkpointing=on,
            gradient_accumulation_steps=2,
            per_device_train_batch_size=2,
        )
        result = train(
            policy,
            args,
            items,
            data_collator=preference_collate(EOS),
            objective=dpo_objective(0.1, ref_params=params_of(ref)),
        )
        assert result.status == "completed"
        runs[on] = (result, calls)
    (plain, plain_calls), (ckpt, ckpt_calls) = runs[False], runs[True]
    assert len(plain_calls) == 4 * 2  # 4 micro-batches: the policy's forward and the reference's
    assert len(ckpt_calls) == 4 * 3  # ... and the policy's block once more, recomputed in the backward pass
    for k in plain.state.params:  # bitwise here (fp32 tolerance is all the issue asks)
        assert torch.equal(ckpt.state.params[k], plain.state.params[k]), k
    losses = [[h["loss"] for h in r.log_history if "loss" in h] for r in (plain, ckpt)]
    assert losses[0] == losses[1]  # the same forward as the bitwise-equal params' (recomputed with the same ops)


# -- precompute_ref_log_probs (item 6d) ----------------------------------------------------------------


def reference_counter(model: torch.nn.Module) -> list[str]:
    """Record the model's forwards: "ref" without grad (a reference forward: precomputed, or in a train step), "eval"
    under inference mode (evaluation: the policy, and the reference when it is not precomputed), "train" with grad."""
    calls = []

    def kind(*_):
        calls.append("eval" if torch.is_inference_mode_enabled() else "train" if torch.is_grad_enabled() else "ref")

    [m for n, m in model.named_modules() if n.endswith("layers.0.self_attn")][0].register_forward_hook(kind)
    return calls


def dpo_run(tmp_path, *, precompute, ref=True, resume=False, stop=None, max_steps=4, eval_dataset=None, **kw):
    policy = tiny_llama(0, vocab=32)
    calls = reference_counter(policy)
    objective = dpo_objective(
        0.1, ref_params=params_of(tiny_llama(1, vocab=32)) if ref else None, precompute_ref_log_probs=precompute
    )
    args = args_for(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=2, seed=3, **kw)
    result = train(
        policy,
        args,
        datasets.Dataset.from_list(random_pairs(9, 8, vocab=32)),
        eval_dataset=eval_dataset,
        data_collator=preference_collate(EOS),
        objective=objective,
        resume_from_checkpoint=resume or None,
        stop=stop,
    )
    return result, {k: calls.count(k) for k in ("ref", "eval")}


def test_precomputed_reference_is_computed_once_and_survives_stop_and_resume(tmp_path):
    held_out = random_pairs(10, 4, vocab=32)  # sequential: the train micro-batches are the precompute's batches
    eval_kw = dict(eval_dataset=held_out, eval_strategy="steps", eval_steps=2, train_sampling_strategy="sequential")
    stopped, first = dpo_run(tmp_path / "run", precompute=True, stop=lambda s: int(s.step) >= 2, **eval_kw)
    assert stopped.status == "stopped"
    assert first == {"ref": 4 + 2, "eval": 2}  # 8 train, 4 eval pairs, 2 per forward; one evaluation: the policy
    cached = sorted(p.name.split("-")[0] for p in (tmp_path / "run" / "ref_logps").iterdir())
    assert cached == ["eval", "train"]
    resumed, again = dpo_run(tmp_path / "run", precompute=True, resume=True, **eval_kw)
    assert resumed.status == "completed"
    assert again == {"ref": 0, "eval": 2}  # read back from output_dir/ref_logps: no reference forward
    fly, forwards = dpo_run(tmp_path / "fly", precompute=False, **eval_kw)  # never stopped, reference on the fly
    assert forwards == {"ref": 4, "eval": 2 * 2 * 2}  # per micro-batch, and per eval batch (2 evaluations)
    for k in fly.state.params:  # stopped + resumed + precomputed = on the fly, bitwise (same batches; no dropout)
        assert torch.equal(resumed.state.params[k], fly.state.params[k]), k
    evals = [[h for h in r.log_history if "eval_loss" in h][-1] for r in (resumed, fly)]
    assert evals[0]["eval_rewards/margins"] == evals[1]["eval_rewards/margins"]


def test_precompute_in_other_batches_equals_the_reference_on_the_fly_within_rounding(tmp_path):
    # The precompute pads 3 pairs per forward where training pads 2: float32 rounding, not bitwise.
    from tolerance import grad_atol, reordered, row_abs_grads, sgd_atol, sgd_rtol

    from trainfold.core.generate import functional_forward
    from trainfold.dpo.reference import reference_logps

    model, ref, rows = tiny_llama(0, vocab=32), params_of(tiny_llama(1, vocab=32)), random_pairs(9, 8, vocab=32)
    collate = preference_collate(EOS)
    threes = reference_logps(model, ref, rows, collate, batch_size=3)
    twos = reference_logps(model, ref, rows, collate, batch_size=2)
    # A sequence's log-prob is a sum of its (negative) token log-probs, which come out of forwards over batches of
    # other shapes: its terms reordered, counting every position of the widest batch (all rows) as a term.
    terms = collate(rows)["input_ids"].numel()
    for a, b in zip(threes, twos):
        assert bool(((a - b).abs() <= reordered(terms, 1.0) * b.abs()).all())
    linear = dict(optim="sgd", optim_args="momentum=0.9", max_grad_norm=0.0)  # linear in the gradients, no clip
    fly, _ = dpo_run(tmp_path / "fly", precompute=False, max_steps=3, **linear)
    obj = dpo_objective(0.1, ref_params=ref, precompute_ref_log_probs=True, precompute_ref_batch_size=3)
    args = args_for(tmp_path / "pre", max_steps=3, save_strategy="steps", save_steps=2, seed=3, **linear)
    pre = train(model, args, datasets.Dataset.from_list(rows), data_collator=collate, objective=obj)
    # Both runs take the same batches of 2 pairs; only the reference log-probs differ, by dr <= reordered(terms, |r|)
    # a sequence. A pair's loss -logsigmoid(z), z = beta (pi_c - r_c - pi_r + r_r), has the gradient
    # -beta sigmoid(-z) grad(pi_c - pi_r) / count; z moves by beta (dr_c + dr_r), sigmoid(-z) by at most
    # sigmoid(z) sigmoid(-z) times that, so the pair's gradient moves by at most rho = beta max(dr_c + dr_r) of its
    # size (sigmoid(z) <= 1), and its loss by beta (dr_c + dr_r) / count. Add the pairs' terms reordered (grad_atol
    # of the sizes measured at the initial params, a step's rows a subset of all 8 over the step's count 2; the
    # change of the sizes at later params is second order), and SGD(lr <= 1e-2, momentum 0.9) over 3 steps.
    rho = 0.1 * max((reordered(terms, 1.0) * (c.abs() + r.abs())).max().item() for c, r in [twos])
    full = dpo_objective(0.1, ref_params=ref)
    forward, step_count = functional_forward(model), torch.tensor(2)
    pair = lambda p, r: full(forward, p, collate(rows[r : r + 1]), step_count, None)[0]
    sizes = row_abs_grads(pair, params_of(model), range(len(rows)))
    diff = {k: v + rho * sizes[k].max().item() for k, v in grad_atol(sizes, terms).items()}
    for k in fly.state.params:
        atol = sgd_atol(1e-2, 3, diff[k], momentum=0.9)
        torch.testing.assert_close(pre.state.params[k], fly.state.params[k], atol=atol, rtol=sgd_rtol(3), msg=k)
    # The loss logged at step t: its pairs' (positive) terms reordered, the reference's shift rho, and its first-order
    # change at params within the bound of the t - 1 steps before it (the sizes bound the loss's gradient too).
    slack = lambda t: sum(sizes[k].sum().item() * sgd_atol(1e-2, t, diff[k], momentum=0.9) for k in sizes)
    losses = [[h["loss"] for h in r.log_history if "loss" in h] for r in (pre, fly)]
    assert len(losses[1]) == 3
    for t, (a, b) in enumerate(zip(*losses)):
        assert a == pytest.approx(b, abs=reordered(terms, b) + rho + slack(t))


def test_without_ref_params_the_reference_is_the_model_before_training(tmp_path):
    initial, _ = dpo_run(tmp_path / "a", precompute=True, ref=False, max_steps=2, train_sampling_strategy="sequential")
    policy = tiny_llama(0, vocab=32)
    args = args_for(
        tmp_path / "b", max_steps=2, save_strategy="steps", save_steps=2, seed=3, train_sampling_strategy="sequential"
    )
    explicit = train(
        policy,
        args,
        datasets.Dataset.from_list(random_pairs(9, 8, vocab=32)),
        data_collator=preference_collate(EOS),
        objective=dpo_objective(0.1, ref_params=params_of(tiny_llama(0, vocab=32))),
    )
    for k in explicit.state.params:
        assert torch.equal(initial.state.params[k], explicit.state.params[k]), k
    # policy == reference at step 1, in the same batches: z = 0 exactly, so each pair's loss is -logsigmoid(0), ln 2
    # rounded once to float32 (within an ulp: eps relative), and the mean of equal values is that value
    assert initial.log_history[0]["loss"] == pytest.approx(math.log(2), rel=EPS)


def test_without_ref_params_a_resume_with_the_trained_module_is_refused_by_name(tmp_path):
    # ref_params=None: the reference is the module as passed. Resuming with the module a first run trained
    # must not score the trained weights as the reference (the cache of the untrained model does not match).
    policy = tiny_llama(0, vocab=32)
    rows = datasets.Dataset.from_list(random_pairs(9, 8, vocab=32))
    objective = dpo_objective(0.1, precompute_ref_log_probs=True)
    args = args_for(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, seed=3)
    first = train(
        policy, args, rows, data_collator=preference_collate(EOS), objective=objective, stop=lambda s: int(s.step) >= 2
    )
    assert first.status == "stopped"
    with pytest.raises(ValueError, match="ref_params=None.*Pass ref_params="):
        train(
            policy, args, rows, data_collator=preference_collate(EOS), objective=objective, resume_from_checkpoint=True
        )
    again = train(
        tiny_llama(0, vocab=32),
        args,
        rows,
        data_collator=preference_collate(EOS),
        objective=objective,
        resume_from_checkpoint=True,
    )  # the untrained module again: its cached reference is read back
    assert again.status == "completed"


def test_the_cache_is_keyed_by_data_and_reference_and_never_trusts_a_bad_file(tmp_path):
    from trainfold.dpo.reference import prepare_reference, reference_fingerprint

    model = tiny_llama(0, vocab=32)
    rows = random_pairs(2, 4, vocab=32)
    collate = preference_collate(EOS)
    ref = params_of(tiny_llama(1, vocab=32))
    base = reference_fingerprint(rows, model, ref, collate)
    assert base == reference_fingerprint(datasets.Dataset.from_list(rows), model, ref, collate)  # contents, not ids
    assert base != reference_fingerprint(rows[::-1], model, ref, collate)
    assert base != reference_fingerprint(rows, model, {**ref, "lm_head.weight": ref["lm_head.weight"] + 1}, collate)
    obj = dpo_objective(0.1, ref_params=ref, precompute_ref_log_probs=True)
    calls = reference_counter(model)

    def prepare():
        return prepare_reference(
            obj,
            model,
            rows,
            None,
            collate,
            output_dir=tmp_path,
            device=torch.device("cpu"),
            train_batch_size=2,
            eval_batch_size=2,
        )

    prepared, train_rows, _ = prepare()
    assert prepared.ref_params is None and calls == ["ref", "ref"] and "ref_chosen_logps" in train_rows[0]
    assert "ref_chosen_logps" not in rows[0]  # nothing passed in is changed
    (cache,) = (tmp_path / "ref_logps").iterdir()
    prepare()
    assert len(calls) == 2  # read back
    cache.write_bytes(b"not a safetensors file")
    _, again, _ = prepare()
    assert len(calls) == 4 and again == train_rows  # recomputed, the same numbers
    with pytest.raises(TypeError, match="iterable dataset"):
        prepare_reference(
            obj,
            model,
            iter(rows),
            None,
            collate,
            output_dir=tmp_path,
            device=torch.device("cpu"),
            train_batch_size=2,
            eval_batch_size=2,
        )
    with pytest.raises(ValueError, match="data_collator=preference_collate"):
        prepare_reference(
            obj,
            model,
            rows,
            None,
            None,
            output_dir=tmp_path,
            device=torch.device("cpu"),
            train_batch_size=2,
            eval_batch_size=2,
        )
    with pytest.raises(ValueError, match="precompute_ref_batch_size=0"):
        dpo_objective(0.1, precompute_ref_batch_size=0)


def test_predict_with_an_objective_returns_trls_predictions_and_metrics(tmp_path):
    from trainfold import predict
    from trainfold.core.models import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_len=16))
    pairs = random_pairs(3, 3, vocab=32)
    out = predict(
        model,
        args_for(tmp_path, per_device_eval_batch_size=2),
        pairs,
        data_collator=preference_collate(EOS),
        objective=dpo_objective(0.1, ref_params=params_of(model)),
    )
    assert out.predictions.shape[:2] == out.label_ids.shape and out.predictions.shape[0] == 6  # chosen + rejected
    # policy == reference in the same forward (margins exactly 0): ln 2 rounded once to float32, averaged
    assert out.metrics["test_loss"] == pytest.approx(math.log(2), rel=EPS)
    assert out.metrics["test_rewards/margins"] == 0
