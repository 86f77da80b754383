"""The eval loss of token tasks is HF ``Trainer.evaluate``'s (issue 48, item 5); the token mean is ``eval_token_loss``.

HF repeats each batch's mean loss ``eval_batch_size`` times (the last batch's cut to its rows) and averages:
a mean of batch means weighted by their rows. Rows of different token counts in batches of different sizes
(the last one short) make it differ from the token mean, so these runs tell the two apart. The reference is a
real ``transformers.Trainer`` on tiny models built from configs.
"""

from __future__ import annotations

import pytest
import torch

import trainfold
from trainfold.core.losses import cross_entropy
from trainfold.evaluation.evaluation import evaluate_batches

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")


def _config(**kw):
    return transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, pad_token_id=1, use_cache=False, **kw,
    )  # fmt: skip


def token_classifier():
    torch.manual_seed(0)
    return transformers.LlamaForTokenClassification(_config(num_labels=5, classifier_dropout=0.0))


def causal_lm():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_config())


def ragged_rows(n, kind):
    """``n`` rows of 2 to 12 tokens; token labels with some -100 (NER's sub-words), or an LM's labels."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(n):
        length = int(torch.randint(2, 13, (), generator=g))
        ids = torch.randint(2, 32, (length,), generator=g).tolist()
        if kind == "tokens":
            labels = torch.randint(0, 5, (length,), generator=g)
            labels[torch.rand(length, generator=g) < 0.3] = -100
            rows.append({"input_ids": ids, "labels": labels.tolist()})
        else:
            rows.append({"input_ids": ids, "labels": list(ids)})
    return rows


class Pad:
    """Pad ``input_ids`` with 1 and ``labels`` with -100, with an attention mask (as HF's token collators)."""

    def __call__(self, items):
        width = max(len(x["input_ids"]) for x in items)

        def padded(key, value):
            return torch.tensor([x[key] + [value] * (width - len(x[key])) for x in items])

        mask = [[1] * len(x["input_ids"]) + [0] * (width - len(x["input_ids"])) for x in items]
        return {
            "input_ids": padded("input_ids", 1),
            "attention_mask": torch.tensor(mask),
            "labels": padded("labels", -100),
        }


def hf_args(path, **kw):
    return transformers.TrainingArguments(
        output_dir=str(path), use_cpu=True, report_to="none", disable_tqdm=True, save_strategy="no",
        per_device_eval_batch_size=3, **kw,
    )  # fmt: skip


def token_mean(model, rows):
    """The mean loss over every labelled token of ``rows``, each row scored alone."""
    total, count = 0.0, 0
    for row in rows:
        batch = Pad()([row])
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits.double()
        labels = batch["labels"]
        if isinstance(model, transformers.LlamaForCausalLM):
            logits, labels = logits[:, :-1], labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        total, count = total + float(loss), count + int((labels != -100).sum())
    return total / count


@pytest.mark.parametrize("make", [token_classifier, causal_lm], ids=["token-classification", "causal-lm"])
@pytest.mark.parametrize("accumulation", [None, 2])
def test_eval_loss_is_the_trainers_row_weighted_mean_of_batch_means(tmp_path, make, accumulation):
    kind = "tokens" if make is token_classifier else "lm"
    rows, model = ragged_rows(8, kind), make()  # batches of 3, 3 and 2 rows
    args = hf_args(tmp_path, eval_accumulation_steps=accumulation)
    hf = transformers.Trainer(model=model, args=args, data_collator=Pad())
    theirs = hf.evaluate(datasets.Dataset.from_list(rows))
    predicted = hf.predict(datasets.Dataset.from_list(rows)).metrics
    ours = trainfold.evaluate(model, trainfold.TrainingArguments.from_hf(args), rows, data_collator=Pad())
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-6)
    assert ours["eval_token_loss"] == pytest.approx(token_mean(model, rows), rel=1e-6)
    assert abs(ours["eval_token_loss"] - ours["eval_loss"]) > 1e-4  # far beyond rel 1e-6: the two conventions differ
    test = trainfold.predict(model, trainfold.TrainingArguments.from_hf(args), rows, data_collator=Pad()).metrics
    assert test["test_loss"] == pytest.approx(predicted["test_loss"], rel=1e-6)
    assert test["test_token_loss"] == ours["eval_token_loss"]


def test_the_eval_during_training_and_the_facades_evaluate_report_the_trainers_eval_loss(tmp_path):
    rows = ragged_rows(8, "tokens")
    settings = dict(
        max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1, eval_strategy="steps",
        eval_steps=2, train_sampling_strategy="sequential", metric_for_best_model="eval_loss",
    )  # fmt: skip
    got = {}
    for who, cls in (("hf", transformers.Trainer), ("trainfold", trainfold.Trainer)):
        trainer = cls(
            model=token_classifier(), args=hf_args(tmp_path / who, **settings), data_collator=Pad(),
            train_dataset=datasets.Dataset.from_list(rows), eval_dataset=datasets.Dataset.from_list(rows),
        )  # fmt: skip
        trainer.train()
        got[who] = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h], trainer.evaluate()
    (hf_evals, hf_final), (our_evals, our_final) = got["hf"], got["trainfold"]
    assert len(our_evals) == 2 and our_evals == pytest.approx(hf_evals, rel=1e-5)  # at steps 2 and 4
    assert our_final["eval_loss"] == pytest.approx(hf_final["eval_loss"], rel=1e-5)
    assert "eval_token_loss" in our_final and "eval_token_loss" not in hf_final  # the named extra


def test_the_loop_hook_and_sharded_evaluation_use_the_same_convention():
    """``loop.evaluate`` is ``evaluate_batches``; over ranks (2 batches and 1) every batch keeps its rows' weight."""
    from trainfold.testing import on_simulated_ranks

    model, rows = token_classifier(), ragged_rows(8, "tokens")
    batches = [Pad()(rows[i : i + 3]) for i in range(0, 8, 3)]
    with torch.no_grad():
        means = [float(model.eval()(**b).loss) for b in batches]
    expected = (3 * means[0] + 3 * means[1] + 2 * means[2]) / 8
    whole = evaluate_batches(model, None, batches, loss=cross_entropy, speed_metrics=False)
    assert whole["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert whole["eval_token_loss"] == pytest.approx(token_mean(model, rows), rel=1e-6)
    ranks = on_simulated_ranks(
        2,
        lambda c: evaluate_batches(
            model, None, [batches[:2], batches[2:]][c.rank], collective=c, loss=cross_entropy, speed_metrics=False
        ),
    )
    assert ranks[0] == ranks[1] and ranks[0]["eval_loss"] == pytest.approx(expected, rel=1e-12)


def test_a_batch_without_labelled_items_has_no_weight_as_hf_drops_its_nan():
    model, rows = token_classifier(), ragged_rows(6, "tokens")
    empty = Pad()([{"input_ids": [3, 4], "labels": [-100, -100]}])
    batches = [Pad()(rows[:3]), empty, Pad()(rows[3:])]
    got = evaluate_batches(model, None, batches, loss=cross_entropy, speed_metrics=False)
    alone = evaluate_batches(model, None, batches[::2], loss=cross_entropy, speed_metrics=False)
    assert got["eval_loss"] == pytest.approx(alone["eval_loss"], rel=1e-12)
