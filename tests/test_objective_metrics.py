"""An objective's ``aux`` metrics are its micro-batch's means; a step reports their mean weighted by each
micro-batch's items, the exact mean over the step's items, whatever the accumulation (they were summed)."""

from __future__ import annotations

import pytest
import torch

from trainfold.core.losses import causal_lm
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.state import init_state
from trainfold.data import pad_collate
from trainfold.optim import sgd
from trainfold.step import make_step
from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.train import train


def model():
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))


def accuracy_objective(forward, params, micro, num_items, key):
    """The causal-LM loss, and the micro-batch's next-token accuracy over its labelled tokens."""
    logits = forward(params, {"input_ids": micro["input_ids"]})
    labels = micro["labels"][:, 1:]
    mask = labels != -100
    hits = (logits[:, :-1].argmax(-1) == labels) & mask
    return causal_lm(logits, micro["labels"], num_items), {
        "accuracy": hits.sum() / mask.sum(),
        "constant": torch.tensor(0.5625),
    }


def batch_of(sizes, lengths):
    """Micro-batches of ``sizes`` rows, row ``i`` with ``lengths[i]`` labelled tokens (unequal counts)."""
    rows = [{"input_ids": [(3 * i + j) % 16 for j in range(n)], "labels": [(3 * i + j) % 16 for j in range(n)]}
            for i, n in enumerate(lengths)]  # fmt: skip
    out, start = [], 0
    for size in sizes:
        out.append(pad_collate()(rows[start : start + size]))
        start += size
    return out


@pytest.mark.parametrize("sizes", [(4,), (2, 2), (1, 3), (3, 1), (1, 1, 1, 1)])
def test_a_steps_aux_is_the_exact_mean_over_its_items_for_any_split(sizes):
    lengths = [2, 7, 4, 3]
    whole = make_step(model(), optimizer=sgd(0.1), objective=accuracy_objective)(
        init_state(model(), sgd(0.1)), batch_of((4,), lengths)
    )
    m = model()
    split = make_step(m, optimizer=sgd(0.1), objective=accuracy_objective)(
        init_state(m, sgd(0.1)), batch_of(sizes, lengths)
    )
    assert split.metrics["accuracy"].item() == pytest.approx(whole.metrics["accuracy"].item(), rel=1e-6)
    assert split.metrics["constant"].item() == pytest.approx(0.5625, rel=1e-7)


def test_a_custom_objectives_accuracy_under_accumulation_is_a_mean_not_a_sum(tmp_path):
    rows = [{"input_ids": [i % 16, (i + 1) % 16, (i + 2) % 16, (i + 3) % 16]} for i in range(8)]
    rows = [{**r, "labels": r["input_ids"]} for r in rows]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        logging_steps=1, report_to="none", disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    history = train(model(), args, rows, objective=accuracy_objective).log_history
    assert [h["constant"] for h in history if "loss" in h] == [0.5625, 0.5625]  # was 1.125: summed
    assert all(0 <= h["accuracy"] <= 1 for h in history if "loss" in h)


def test_an_objective_that_normalises_its_aux_as_its_loss_says_so_and_they_are_summed():
    def shares(forward, params, micro, num_items, key):
        loss = causal_lm(forward(params, {"input_ids": micro["input_ids"]}), micro["labels"], num_items)
        return loss, {"double": 2 * loss.detach()}

    shares.aux_reduction = "sum"
    m = model()
    state = make_step(m, optimizer=sgd(0.1), objective=shares)(init_state(m, sgd(0.1)), batch_of((1, 3), [2, 7, 4, 3]))
    assert state.metrics["double"].item() == pytest.approx(2 * state.metrics["loss"].item(), rel=1e-6)


def test_an_unknown_aux_reduction_is_refused_by_name():
    def objective(forward, params, micro, num_items, key):
        return causal_lm(forward(params, {"input_ids": micro["input_ids"]}), micro["labels"], num_items), {}

    objective.aux_reduction = "max"
    with pytest.raises(ValueError, match="aux_reduction is 'max'; set 'mean'.*or 'sum'"):
        make_step(model(), optimizer=sgd(0.1), objective=objective)
