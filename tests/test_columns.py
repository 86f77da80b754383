"""Columns (issue 15, item 7): ``remove_unused_columns``, ``label_names`` and the length column, as HF does them."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold import TrainingArguments, train
from trainfold.core.losses import cross_entropy
from trainfold.data import keyed
from trainfold.data.columns import Columns, columns_for, eval_collate, signature_columns, with_columns

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

STEPS = 6
SETTINGS = dict(
    max_steps=STEPS,
    per_device_train_batch_size=4,
    learning_rate=3e-3,
    warmup_steps=2,
    weight_decay=0.1,
    max_grad_norm=0.5,
    seed=7,
    train_sampling_strategy="sequential",
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
)


def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config)


def text_rows(n=4 * STEPS, t=12):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(1, 50, (t,), generator=g).tolist()
        out.append(
            {
                "text": f"sentence {i}",
                "input_ids": ids,
                "attention_mask": [1] * t,
                "label": int(torch.randint(0, 3, (1,), generator=g)),
                "length": t,
            }
        )
    return out


def test_a_label_and_a_text_column_train_as_in_a_real_trainer(tmp_path):
    data = datasets.Dataset.from_list(text_rows())
    base = bert()
    hf_model = copy.deepcopy(base)
    trainer = transformers.Trainer(
        model=hf_model,
        train_dataset=data,
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, **SETTINGS),
    )
    trainer.train()
    hf_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ours = train(
        base, TrainingArguments(output_dir=str(tmp_path / "tf"), **SETTINGS), data, compute_loss_func=cross_entropy
    )
    our_losses = [h["loss"] for h in ours.log_history if "loss" in h and "train_loss" not in h]
    assert len(our_losses) == len(hf_losses) == STEPS
    assert our_losses == pytest.approx(hf_losses, rel=1e-5)
    for name, p in hf_model.named_parameters():
        assert torch.equal(ours.state.params[name], p.detach()), name  # the same ops as HF in the same order


class Recording(torch.nn.Module):
    """``forward(input_ids, attention_mask=None, **kwargs)`` like an HF model; records the keys it gets."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 3)
        self.seen: set[str] = set()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        self.seen |= {"input_ids", *(["attention_mask"] if attention_mask is not None else []), *kwargs}
        return self.emb(input_ids).mean(1)


def _args(tmp_path, **over):
    return TrainingArguments(output_dir=str(tmp_path), **{**SETTINGS, "max_steps": 2, **over})


def test_a_kwargs_forward_gets_only_its_named_columns_and_never_the_length(tmp_path):
    net = Recording()
    r = train(
        net, _args(tmp_path, train_sampling_strategy="group_by_length"), text_rows(), compute_loss_func=cross_entropy
    )
    assert r.global_step == 2 and net.seen == {"input_ids", "attention_mask"}
    rows = [{k: v for k, v in row.items() if k != "text"} | {"extra": 1.0} for row in text_rows()]
    net = Recording()
    train(net, _args(tmp_path, remove_unused_columns=False), rows, compute_loss_func=cross_entropy)
    assert net.seen == {"input_ids", "attention_mask", "extra"}  # everything but the sampler's length column


def test_label_names_name_the_column_the_loss_reads(tmp_path):
    renamed = [{("target" if k == "label" else k): v for k, v in row.items()} for row in text_rows()]
    by_label = train(bert(), _args(tmp_path / "a"), text_rows(), compute_loss_func=cross_entropy)
    by_target = train(bert(), _args(tmp_path / "b", label_names=["target"]), renamed, compute_loss_func=cross_entropy)
    for k, v in by_label.state.params.items():
        assert torch.equal(v, by_target.state.params[k]), k


def test_label_ids_become_labels_with_the_default_collator_as_in_hf():
    cols = columns_for(bert())
    batch = with_columns(None, cols)([{"input_ids": [1, 2], "label_ids": [0, 1], "text": "x"}])
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"] and batch["labels"].tolist() == [[0, 1]]
    own = with_columns(lambda items: items, columns_for(bert(), default_collator=False))  # a user's collator decides
    assert own([{"input_ids": [1], "label": 2, "text": "x"}]) == [{"input_ids": [1], "label": 2}]


def test_signature_columns_ignore_kwargs_and_keyed_collators_stay_keyed():
    assert "kwargs" not in signature_columns(bert()) and "input_ids" in signature_columns(bert())
    wrapped = with_columns(keyed(lambda items, keys: (items, list(keys))), columns_for(torch.nn.Linear(2, 1)))
    assert wrapped([{"input": 1, "text": "a"}], [9]) == ([{"input": 1}], [9])
    assert eval_collate(wrapped, columns_for(torch.nn.Linear(2, 1)))([{"input": 1, "z": 0}]) == ([{"input": 1}], [0])


names = st.sampled_from(["input", "labels", "label", "label_ids", "length", "text", "x", "idx"])


@given(
    items=st.lists(st.dictionaries(names, st.integers(), min_size=1), min_size=1, max_size=4),
    remove=st.booleans(),
    default=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_select_keeps_exactly_the_kept_columns_and_renames_one_label(items, remove, default):
    cols = columns_for(torch.nn.Linear(2, 1), remove_unused_columns=remove, default_collator=default)
    for item in items:
        out = cols.select(item)
        assert "length" not in out
        expected = {k for k in item if k != "length" and (not remove or k in {"input", "labels", "label", "label_ids"})}
        if default and "labels" not in item and expected & {"label", "label_ids"}:
            gone = "label" if "label" in expected else "label_ids"
            assert out["labels"] == item[gone]
            expected = (expected - {gone}) | {"labels"}
        assert set(out) == expected
        assert set(cols.dropped(item)) == set(item) - set(out) - {"labels"} - ({"label", "label_ids"} & set(item))


# -- errors -------------------------------------------------------------------------------------------


def test_a_label_column_that_was_dropped_is_named_with_the_fix(tmp_path):
    rows = [{("y" if k == "label" else k): v for k, v in row.items()} for row in text_rows()]
    with pytest.raises(KeyError, match=r"no 'labels' key .*dropped \['length', 'text', 'y'\].*label_names"):
        train(bert(), _args(tmp_path), rows, compute_loss_func=cross_entropy)


def test_a_collator_that_keeps_label_says_to_name_it(tmp_path):
    def stack(items):
        return {k: torch.tensor([item[k] for item in items]) for k in items[0]}

    with pytest.raises(KeyError, match=r"has \['label'\]: set label_names=\['label'\]"):
        train(bert(), _args(tmp_path), text_rows(), data_collator=stack, compute_loss_func=cross_entropy)


def test_no_matching_column_and_several_label_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"no column of the dataset \['a', 'b'\] is an argument of Linear.forward"):
        with_columns(None, columns_for(torch.nn.Linear(2, 1)))([{"a": 1, "b": 2}])
    with pytest.raises(ValueError, match="label_names=\\['start', 'end'\\] names 2 label columns.*objective"):
        train(bert(), _args(tmp_path, label_names=["start", "end"]), text_rows(), compute_loss_func=cross_entropy)
    assert isinstance(columns_for(bert(), label_names=("start", "end")), Columns)  # an objective may take both
