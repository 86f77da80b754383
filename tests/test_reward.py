"""trainfold.reward against TRL 1.16's RewardTrainer: the same rows, model and settings, step by step.

The facade (``trainfold.reward.RewardTrainer``) is given the very ``trl.RewardConfig`` the real trainer gets,
so these runs are also TRL's reward.py script moved by its import.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_chat import WORDS, llama

import trainfold
from trainfold.reward import RewardArguments, bradley_terry, reward_collate, reward_objective, reward_rows

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} </s> {% endfor %}"


def tokenizer():
    """Words of ``WORDS`` split on white space, ``</s>`` split off the word it ends (TRL appends it unspaced)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    word = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    word.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("</s>", behavior="isolated"), pre_tokenizers.WhitespaceSplit()]
    )
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=word, pad_token="<pad>", eos_token="</s>")
    tok.chat_template = TEMPLATE
    return tok


def _say(g, lo=1, hi=5):
    return " ".join(
        f"w{int(i)}" for i in torch.randint(0, 59, (int(torch.randint(lo, hi, (), generator=g)),), generator=g)
    )


def rows(kind, n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt, chosen, rejected = _say(g), _say(g), _say(g)
        if kind == "implicit":
            out.append({"chosen": f"{prompt} {chosen}", "rejected": f"{prompt} {rejected}"})
        elif kind == "explicit":
            out.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected, "margin": 0.25 * (i % 3)})
        else:  # conversational, explicit prompt
            user = [{"role": "user", "content": prompt}]
            out.append(
                {
                    "prompt": user,
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            )
    return out


def config(out, **kw):
    base = dict(
        output_dir=str(out), max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-2, logging_steps=1, seed=3, use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8,
        disable_tqdm=True,
    )  # fmt: skip
    return trl.RewardConfig(**{**base, **kw})


def _history(trainer):
    steps = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    return steps, evals


METRICS = ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward")


@pytest.mark.parametrize(
    ("kind", "kw"),
    [
        ("explicit", {}),
        ("implicit", {"center_rewards_coefficient": 0.01}),
        # pairs over max_length dropped; one pair per micro-batch, so a short last one cannot weigh differently
        ("conversational", {"max_length": 9, "per_device_train_batch_size": 1}),
    ],
)
def test_per_step_losses_and_metrics_are_trls(tmp_path, kind, kw):
    llama().save_pretrained(tmp_path / "model")  # a causal LM: the one-label head is drawn from the seed, as TRL's
    tokenizer().save_pretrained(tmp_path / "model")
    train, test = datasets.Dataset.from_list(rows(kind)), datasets.Dataset.from_list(rows(kind, n=8, seed=1))
    got = {}
    for who, cls in (("trl", trl.RewardTrainer), ("trainfold", trainfold.reward.RewardTrainer)):
        args = config(tmp_path / who, **kw)
        trainer = cls(model=str(tmp_path / "model"), args=args, train_dataset=train, eval_dataset=test)
        trainer.train()
        got[who] = (*_history(trainer), trainer.evaluate())
    (ours, our_evals, our_final), (theirs, their_evals, their_final) = got["trainfold"], got["trl"]
    assert len(ours) == len(theirs) == 4
    for name in METRICS:
        assert [e[name] for e in ours] == pytest.approx([e[name] for e in theirs], rel=1e-5, abs=1e-6), name
    for name in ("eval_loss", "eval_accuracy", "eval_margin", "eval_mean_reward"):
        assert [e[name] for e in our_evals] == pytest.approx([e[name] for e in their_evals], rel=1e-5, abs=1e-6), name
    assert our_final["eval_loss"] == pytest.approx(their_final["eval_loss"], rel=1e-5)


def test_max_length_drops_the_pairs_trl_drops(tmp_path):
    tok = tokenizer()
    data = datasets.Dataset.from_list(rows("explicit", n=32))
    llama().save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    real = trl.RewardTrainer(
        model=str(tmp_path / "model"), args=config(tmp_path / "o", max_length=6, eval_strategy="no"), train_dataset=data
    )
    ours = reward_rows(data, tokenizer(), max_length=6)
    assert 0 < len(ours) < 32
    assert [r["chosen_ids"] for r in ours] == list(real.train_dataset["chosen_ids"])
    assert [r["margin"] for r in ours] == list(real.train_dataset["margin"])


def test_the_saved_reward_model_and_tokenizer_load_and_score_as_trained(tmp_path):
    llama().save_pretrained(tmp_path / "model")
    tokenizer().save_pretrained(tmp_path / "model")
    args = config(tmp_path / "o", max_steps=2, eval_strategy="no")
    trainer = trainfold.reward.RewardTrainer(str(tmp_path / "model"), args, train_dataset=rows("implicit"))
    trainer.train()
    trainer.save_model()
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "o")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "o")
    batch = tok(["w1 w2</s>"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, trainer.model(**batch).logits)
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == tok.pad_token_id == 0


def test_bradley_terry_is_trls_formula_and_the_objective_splits_exactly():
    chosen, rejected, margin = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.5]), torch.tensor([0.1, 0, 1])
    expected = -torch.nn.functional.logsigmoid(chosen - rejected - margin).mean() + 0.01 * torch.mean(
        (chosen + rejected) ** 2
    )
    assert torch.allclose(bradley_terry(chosen, rejected, margin, 0.01).mean(), expected, rtol=1e-6)
    items = [{"chosen_ids": [1, 2], "rejected_ids": [3], "margin": m} for m in (0.1, 0.0, 1.0, 0.5)]
    torch.manual_seed(0)
    head = torch.nn.Embedding(8, 1)

    def forward(params, inputs):  # a score per row: its last real token's embedding
        last = inputs["attention_mask"].sum(-1) - 1
        return {"logits": head(inputs["input_ids"])[torch.arange(len(last)), last]}

    objective, collate = reward_objective(0.01), reward_collate(0)
    whole, _ = objective(forward, {}, collate(items), torch.tensor(4))
    halves = sum(objective(forward, {}, collate(part), torch.tensor(4))[0] for part in (items[:2], items[2:]))
    assert torch.allclose(whole, halves, rtol=1e-6)


def test_settings_trainfold_cannot_honour_are_refused_by_name():
    with pytest.raises(ValueError, match="chat_template_path='t.jinja' is not supported"):
        RewardArguments(bf16=False, chat_template_path="t.jinja")
    with pytest.raises(ValueError, match="center_rewards_coefficient must be >= 0, got -1"):
        RewardArguments(bf16=False, center_rewards_coefficient=-1)
    model = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(**{**llama().config.to_dict(), "num_labels": 3})
    )
    with pytest.raises(ValueError, match="num_labels=3.*num_labels=1"):
        trainfold.reward.train(model, RewardArguments(bf16=False), [])


def test_trls_own_reward_script_runs_with_only_its_trainer_swapped(tmp_path, monkeypatch):
    """The installed ``trl/scripts/reward.py`` itself, run twice: with TRL's RewardTrainer, then with trainfold's
    in its place (the one line a user changes: ``from trl import RewardTrainer``)."""
    import json
    import runpy

    import trl.scripts.reward as script_module

    llama().save_pretrained(tmp_path / "model")
    tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    for split, part in (("train", rows("explicit")), ("test", rows("explicit", n=8, seed=1))):
        (tmp_path / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    argv = ["--model_name_or_path", str(tmp_path / "model"), "--dataset_name", str(tmp_path / "data")]
    argv += ["--max_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    argv += ["--learning_rate", "1e-2", "--logging_steps", "1", "--seed", "3", "--use_cpu", "true", "--bf16", "false"]
    argv += ["--gradient_checkpointing", "false", "--report_to", "none", "--save_strategy", "no"]
    argv += ["--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "8"]
    got = {}
    for who, cls in (("trl", trl.RewardTrainer), ("trainfold", trainfold.reward.RewardTrainer)):

        class Recorded(cls):
            def train(self, *a, _who=who, **kw):
                out = super().train(*a, **kw)
                got[_who] = _history(self)
                return out

        monkeypatch.setattr(trl, "RewardTrainer", Recorded)
        script = runpy.run_path(script_module.__file__, run_name=f"reward_{who}")
        parsed = script["make_parser"]().parse_args_and_config([*argv, "--output_dir", str(tmp_path / who)])
        script["main"](*parsed)
    (ours, our_evals), (theirs, their_evals) = got["trainfold"], got["trl"]
    assert len(ours) == 4
    for name in METRICS:
        assert [e[name] for e in ours] == pytest.approx([e[name] for e in theirs], rel=1e-5, abs=1e-6), name
    assert [e["eval_loss"] for e in our_evals] == pytest.approx([e["eval_loss"] for e in their_evals], rel=1e-5)
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "trainfold")
    assert loaded.config.num_labels == 1 and transformers.AutoTokenizer.from_pretrained(tmp_path / "trainfold")


def test_a_reward_run_resumes_bitwise(tmp_path):
    import shutil

    llama().save_pretrained(tmp_path / "model")
    tokenizer().save_pretrained(tmp_path / "model")

    def run(out, **kw):
        args = RewardArguments(
            output_dir=str(out), max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            learning_rate=1e-2, logging_steps=1, seed=3, bf16=False, gradient_checkpointing=False, report_to="none",
            save_steps=2, disable_tqdm=True,
        )  # fmt: skip
        result = trainfold.reward.train(str(tmp_path / "model"), args, rows("explicit"), **kw)
        return [e["loss"] for e in result.log_history if "loss" in e and "train_loss" not in e], result

    whole, done = run(tmp_path / "a")
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    resumed, again = run(tmp_path / "b", resume_from_checkpoint=True)
    assert resumed[-2:] == whole[2:]
    assert all(torch.equal(again.state.params[k], v) for k, v in done.state.params.items())
