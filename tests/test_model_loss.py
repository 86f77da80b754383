"""A model whose task trainfold has no loss for trains with the loss it returns, as transformers.Trainer trains it."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

import trainfold
from trainfold.core.model_loss import accepts_loss_kwargs, model_loss

transformers = pytest.importorskip("transformers")


class Regression(torch.nn.Module):
    """Shaped like the RegressionModel of transformers' own Trainer tests: ``(loss, y)`` when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.5))
        self.b = torch.nn.Parameter(torch.tensor(-0.25))

    def forward(self, input_x, labels=None):
        y = input_x * self.a + self.b
        return (y,) if labels is None else (torch.nn.functional.mse_loss(y, labels), y)


class Normalising(Regression):
    """A model that takes the Trainer's loss kwargs: its loss is a sum over ``num_items_in_batch``."""

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        if labels is None:
            return {"logits": y}
        n = kwargs.get("num_items_in_batch")
        loss = ((y - labels) ** 2).sum() / n if n is not None else ((y - labels) ** 2).mean()
        return {"loss": loss, "logits": y}


def rows(n: int = 13) -> list[dict[str, float]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    y = 2 * x + 3 + 0.1 * torch.randn(n, generator=g)
    return [{"input_x": x[i].item(), "labels": y[i].item()} for i in range(n)]


def collate(items):
    return {k: torch.tensor([r[k] for r in items]) for k in ("input_x", "labels")}


def hf_args(**over):
    base = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,  # 13 rows: micro-batches of 4, 4, 4, 1; the last step's are unequal
        gradient_accumulation_steps=2,
        per_device_eval_batch_size=3,
        learning_rate=0.1,
        num_train_epochs=2,
        optim="sgd",  # linear in the gradients: the order of the GA division costs ulps, not a step
        lr_scheduler_type="constant",
        logging_steps=1,
        eval_strategy="epoch",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    return transformers.TrainingArguments(**(base | over))


@pytest.mark.parametrize("cls", [Regression, Normalising], ids=["mean-loss", "num-items-in-batch"])
def test_the_models_own_loss_trains_evaluates_and_predicts_as_the_trainer(cls):
    data, held_out = rows(), rows(5)
    args = hf_args()
    theirs = cls()
    trainer = transformers.Trainer(theirs, args, train_dataset=data, eval_dataset=data[:10], data_collator=collate)
    trainer.train()
    expected = trainer.predict(held_out)
    ours = cls()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = trainfold.train(
            ours, trainfold.TrainingArguments.from_hf(args), data, eval_dataset=data[:10], data_collator=collate
        )
    logged = [(e["step"], e.get("loss"), e.get("eval_loss")) for e in result.log_history if "train_loss" not in e]
    reference = [(e["step"], e.get("loss"), e.get("eval_loss")) for e in trainer.state.log_history[:-1]]
    assert [s for s, *_ in logged] == [s for s, *_ in reference]
    for (_, loss, eval_loss), (_, hf_loss, hf_eval) in zip(logged, reference):
        assert (loss is None) == (hf_loss is None) and (eval_loss is None) == (hf_eval is None)
        if loss is not None:
            assert loss == pytest.approx(hf_loss, rel=1e-5)
        if eval_loss is not None:  # each eval batch's mean weighed by its rows, as the Trainer's
            assert eval_loss == pytest.approx(hf_eval, rel=1e-5)
    for name in ("a", "b"):
        assert getattr(ours, name).item() == pytest.approx(getattr(theirs, name).item(), rel=1e-5, abs=1e-6)
    predicted = trainfold.predict(ours, trainfold.TrainingArguments.from_hf(args), held_out, data_collator=collate)
    torch.testing.assert_close(torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions))
    assert predicted.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-5)


def test_the_step_loss_is_the_trainers_normalisation():
    # two micro-batches of 3 and 1 rows: a mean loss is averaged over micro-batches (the Trainer's division by
    # the accumulation steps); a model taking num_items_in_batch gets the step's labelled items and is summed
    x, y = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.0, 0.0, 0.0, 0.0])
    micro = [{"input_x": x[:3], "labels": y[:3]}, {"input_x": x[3:], "labels": y[3:]}]
    for cls in (Regression, Normalising):
        model = cls()
        objective = model_loss(model)
        n = sum(objective.count_items(m) for m in micro)
        forward = lambda p, inputs, model=model: torch.func.functional_call(model, p, (), inputs)
        params = dict(model.named_parameters())
        total = sum(objective(forward, params, m, n, None)[0] for m in micro)
        errors = (x * 0.5 - 0.25) ** 2
        want = (errors[:3].mean() + errors[3:].mean()) / 2 if cls is Regression else errors.mean()
        assert accepts_loss_kwargs(model) is (cls is Normalising)
        torch.testing.assert_close(total, want)


def test_a_model_returning_no_loss_is_refused_naming_the_fix():
    model = torch.nn.Sequential(torch.nn.Linear(1, 1))

    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, input_x, labels=None):
            return {"logits": self.net(input_x[:, None])[:, 0]}

    args = trainfold.TrainingArguments.from_hf(hf_args(eval_strategy="no", max_steps=1))
    with pytest.raises(ValueError, match=r"Plain returned no loss \(its outputs: \['logits'\]\).*compute_loss_func="):
        trainfold.train(Plain(), args, rows(), data_collator=collate)


class DoubleOutput(torch.nn.Module):
    """transformers' test RegressionModel with double_output: ``(loss, y, y)``, and ``**kwargs``."""

    def __init__(self, a: float = 1.5, b: float = 2.5) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a))
        self.b = torch.nn.Parameter(torch.tensor(b))

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        return (y, y) if labels is None else (torch.nn.functional.mse_loss(y, labels), y, y)


def test_several_outputs_are_predicted_as_a_tuple_and_the_default_collation_trains_as_the_trainer():
    data = rows(20)
    args = hf_args(gradient_accumulation_steps=1, eval_strategy="no", optim="adamw_torch")
    trainer = transformers.Trainer(DoubleOutput(), args, train_dataset=data)  # default_data_collator on both sides
    expected = trainer.predict(data)
    ours = trainfold.TrainingArguments.from_hf(args)
    predicted = trainfold.predict(DoubleOutput(), ours, data)
    assert isinstance(predicted.predictions, tuple) and len(predicted.predictions) == 2
    for mine, theirs in zip(predicted.predictions, expected.predictions):
        torch.testing.assert_close(torch.as_tensor(mine), torch.as_tensor(theirs))
    assert predicted.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-6)
    trainer.train()
    model = DoubleOutput()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainfold.train(model, ours, data)
    for name in ("a", "b"):  # one micro-batch per step: the same sums in the same order, under AdamW too
        torch.testing.assert_close(getattr(model, name), getattr(trainer.model, name))
