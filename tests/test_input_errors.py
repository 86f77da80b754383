"""One table of bad inputs to ``train``: each is refused with the built-in error type that fits, a message that
names the problem (and the offending value), and the fix. Before ``hf.validate`` most of them surfaced from inside
torch (``IndexError: index out of range in self``) or as an ``AttributeError`` on the user's own object."""

from __future__ import annotations

import warnings

import pytest
import torch

from trainfold import TrainingArguments, train
from trainfold.core.models import TinyLM, TinyLMConfig

ROWS = [{"input_ids": [i, i + 1, i + 2, i + 3], "labels": [i, i + 1, i + 2, i + 3]} for i in range(8)]


def model():
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))


def rows(**row):
    return [dict(row) for _ in range(8)]


def run(tmp_path, dataset=ROWS, *, on=None, args_as_dict=False, **kwargs):
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2, report_to="none")
    settings |= dict(disable_tqdm=True, save_strategy="no", **kwargs.pop("args", {}))
    args = settings if args_as_dict else TrainingArguments(**settings)
    return train(on if on is not None else model(), args, dataset, **kwargs)


def classifier():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_labels=3
    )
    return LlamaForSequenceClassification(config.__class__(**{**config.to_dict(), "pad_token_id": 0}))


def a_file(tmp_path):
    (tmp_path / "out").write_text("not a directory")


CASES = {
    "input ids past the vocabulary": (
        dict(dataset=rows(input_ids=[1, 2, 99, 3], labels=[1, 2, 3, 4])),
        ValueError,
        r"ids outside the model's vocabulary of 16 \(0\.\.15\): min 1, max 99; .*resize_token_embeddings",
    ),
    "negative input ids": (
        dict(dataset=rows(input_ids=[1, -5, 2, 3], labels=[1, 2, 3, 4])),
        ValueError,
        r"vocabulary of 16 \(0\.\.15\): min -5, max 3; use the tokenizer the model was trained with",
    ),
    "no input_ids": (
        dict(dataset=rows(labels=[1, 2, 3, 4])),
        ValueError,
        r"the batch has no 'input_ids' \(its keys: \['labels'\]\), which TinyLM.forward needs; tokenize the rows",
    ),
    "float input_ids": (
        dict(dataset=rows(input_ids=[1.0, 2.0, 3.0, 4.0], labels=[1, 2, 3, 4])),
        TypeError,
        r"input_ids are torch.float32, but token ids are integers; convert them \(ids.long\(\)\)",
    ),
    "bool input_ids": (
        dict(dataset=rows(input_ids=[True, False, True, True], labels=[1, 2, 3, 4])),
        TypeError,
        r"input_ids are torch.bool, but token ids are integers",
    ),
    "a loss that is not reduced": (
        dict(compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.sum(-1)),
        ValueError,
        r"compute_loss_func returned a tensor of shape \(2, 4\), not a scalar; reduce it: .*/ num_items_in_batch",
    ),
    "a loss that is a python float": (
        dict(compute_loss_func=lambda outputs, labels, num_items_in_batch=None: 1.0),
        TypeError,
        r"compute_loss_func returned a float \(1.0\), not a tensor; return the loss as a 0-d tensor",
    ),
    "tuple rows": (
        dict(dataset=[([1, 2, 3, 4], [1, 2, 3, 4])] * 8),
        TypeError,
        r"train_dataset\[0\] is a tuple .*: a \(features, label\) pair: write it as \{'input_ids': features",
    ),
    "None rows": (
        dict(dataset=[None] * 8),
        TypeError,
        r"train_dataset\[0\] is a NoneType .*a row is a dict of columns",
    ),
    "text rows": (dict(dataset=["hello"] * 8), TypeError, r"train_dataset\[0\] is a str \('hello'\): .*tokenize it"),
    "a dict of columns": (
        dict(dataset={"input_ids": [[1, 2, 3, 4]] * 8, "labels": [[1, 2, 3, 4]] * 8}),
        TypeError,
        r"train_dataset is a dict of columns \['input_ids', 'labels'\], .*datasets.Dataset.from_dict",
    ),
    "scalar labels for a causal LM": (
        dict(dataset=rows(input_ids=[1, 2, 3, 4], labels=1)),
        ValueError,
        r"train_dataset\[0\]\['labels'\] \(1\) has shape \(\) but TinyLM predicts every token.*shaped like input_ids",
    ),
    "a collator returning a list": (
        dict(data_collator=lambda batch: [torch.ones(2, 4)]),
        TypeError,
        r"the data collator returned a list .*; a collator returns a dict of tensors",
    ),
    "a collator returning None": (
        dict(data_collator=lambda batch: None),
        TypeError,
        r"the data collator returned a NoneType",
    ),
    "a model on meta": (
        dict(on=model().to("meta")),
        ValueError,
        r"the model's parameters are on the meta device .*\['tok.weight', .*model.to_empty\(device=...\)",
    ),
    "resume_from_checkpoint=123": (
        dict(resume_from_checkpoint=123),
        TypeError,
        r"resume_from_checkpoint=123 \(int\) is not a checkpoint; pass True .*, a checkpoint directory",
    ),
    "an output_dir that is a file": (
        dict(setup=a_file),
        ValueError,
        r"output_dir='.*out' is a file; name a directory",
    ),
    "metric_for_best_model without compute_metrics": (
        dict(args=dict(metric_for_best_model="accuracy", eval_strategy="steps", eval_steps=1), eval_dataset=ROWS),
        ValueError,
        r"metric_for_best_model='accuracy', but without compute_metrics evaluation reports only the loss; pass "
        r"compute_metrics=fn .*\{'accuracy': value\}\), or metric_for_best_model='loss'",
    ),
    "rows that are lists": (
        dict(dataset=[[1, 2, 3, 4]] * 8),
        TypeError,
        r"train_dataset\[0\] is a list .*: a list: name its columns, \{'input_ids': \[...\], 'labels': \[...\]\}",
    ),
    "eval rows that are text": (
        dict(args=dict(eval_strategy="steps", eval_steps=1), eval_dataset=["hello"] * 4),
        TypeError,
        r"eval_dataset\[0\] is a str \('hello'\): it is text: tokenize it first",
    ),
    "an empty dataset": (dict(dataset=[]), ValueError, r"train_dataset is empty \(0 rows\); pass the rows to train on"),
    "no dataset": (dict(dataset=None), TypeError, r"train_dataset is None; pass the rows to train on"),
    "args given as a dict": (
        dict(args_as_dict=True),
        TypeError,
        r"args is a dict, not trainfold's TrainingArguments; pass trainfold.TrainingArguments\(\*\*settings\)",
    ),
    "float labels for a classification head": (
        dict(on=classifier(), dataset=rows(input_ids=[1, 2, 3, 4], labels=1.0)),
        ValueError,
        r"do not fit labels of shape \(2,\) \(torch.float32\): float labels mean multi-label targets .*; if they are "
        r"class ids, make them integers .*ClassLabel.* for single-label cross-entropy",
    ),
    "text labels for a classification head": (
        dict(on=classifier(), dataset=rows(input_ids=[1, 2, 3, 4], label="positive")),
        TypeError,
        r"the rows' 'label' holds text \('positive'\), not class ids; map the names to ids, e.g. label2id = .*"
        r"class_encode_column\('label'\): a datasets.ClassLabel\), and give the model num_labels=len\(label2id\)",
    ),
    "a generator as the dataset": (
        dict(dataset=(row for row in ROWS)),
        TypeError,
        r"train_dataset is a generator, which is read once and has no length.*; pass train_dataset=list\(rows\), or "
        r"datasets.Dataset.from_generator\(fn\)",
    ),
    "a generator as the eval dataset": (
        dict(args=dict(eval_strategy="steps", eval_steps=1), eval_dataset=iter(ROWS)),
        TypeError,
        r"eval_dataset is a list_iterator, which is read once",
    ),
    "a torch.optim optimizer object": (
        dict(optimizer=torch.optim.SGD(model().parameters(), lr=0.1, momentum=0.9)),
        TypeError,
        r"optimizer is a torch.optim.SGD object; .* write optimizer=trainfold.optim.from_torch\(torch.optim.SGD, "
        r"lr=0.1, \.\.\.\) with the same keyword arguments",
    ),
    "an optimizer that is no optimizer": (
        dict(optimizer="adamw"),
        TypeError,
        r"optimizer is a str, not a trainfold optimizer \(init/update\); pass trainfold.optim.adamw",
    ),
    "a function instead of a module": (
        dict(on=lambda input_ids: input_ids),
        TypeError,
        r"model is a function, not a torch.nn.Module; pass the module whose parameters train",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_input_is_refused_naming_the_problem_and_the_fix(case, tmp_path):
    kwargs, error, message = CASES[case]
    kwargs = dict(kwargs)
    kwargs.pop("setup", lambda tmp_path: None)(tmp_path)
    with pytest.raises(error, match=message), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(tmp_path, **kwargs)


def test_the_checks_let_good_inputs_through_unchanged(tmp_path):
    """The same call with the table's arguments corrected trains (the checks do not refuse what works)."""
    done = run(tmp_path, compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.float().mean())
    assert done.status == "completed" and done.global_step == 1


def test_a_loss_defined_by_exec_without_a_module_name_is_checked_and_trains(tmp_path):
    # exec() in a namespace without __name__ (a doc runner, some notebook kernels) leaves __module__ None, which
    # the check read as a string: AttributeError before any work
    namespace: dict = {}
    exec("def loss(outputs, labels, num_items_in_batch=None):\n    return outputs.float().mean()", namespace)
    assert namespace["loss"].__module__ is None
    done = run(tmp_path, compute_loss_func=namespace["loss"])
    assert done.status == "completed" and done.global_step == 1
    namespace2: dict = {}
    exec("def loss(outputs, labels, num_items_in_batch=None):\n    return 1.0", namespace2)
    with pytest.raises(TypeError, match=r"compute_loss_func returned a float \(1.0\), not a tensor"):
        run(tmp_path / "b", compute_loss_func=namespace2["loss"])


def test_transformers_training_arguments_are_taken_as_from_hf_converts_them(tmp_path):
    # was NotAnAttrsClassError from deep inside the plan; TrainingArguments.from_hf is exact (it refuses by name
    # what trainfold cannot honour), so train takes the HF object as the user would convert it
    import transformers

    settings = dict(
        max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, report_to="none", save_strategy="no"
    )
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **settings)
    taken = train(model(), hf_args, ROWS)
    converted = train(model(), TrainingArguments.from_hf(hf_args, output_dir=str(tmp_path / "ours")), ROWS)
    assert taken.status == "completed" and taken.global_step == 2
    assert all(torch.equal(taken.state.params[k], converted.state.params[k]) for k in converted.state.params)
    refused = transformers.TrainingArguments(output_dir=str(tmp_path / "x"), push_to_hub=True, report_to="none")
    with pytest.raises(TypeError, match=r"push_to_hub=True is a transformers.TrainingArguments setting"):
        train(model(), refused, ROWS)


def test_an_empty_eval_set_warns_naming_it(tmp_path):
    with pytest.warns(UserWarning, match=r"eval_dataset is empty \(0 rows\): every evaluation reports no loss"):
        run(tmp_path, args=dict(eval_strategy="steps", eval_steps=1), eval_dataset=[])


def test_eval_rows_without_labels_warn_naming_the_columns(tmp_path):
    unlabelled = [{"input_ids": row["input_ids"]} for row in ROWS]
    with pytest.warns(UserWarning, match=r"eval_dataset\[0\] has no label column \(\['labels', 'label', 'label_ids'\]; "
                      r"its keys: \['input_ids'\]\): evaluation computes no eval_loss"):  # fmt: skip
        run(tmp_path, args=dict(eval_strategy="steps", eval_steps=1), eval_dataset=unlabelled)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(tmp_path / "b", args=dict(eval_strategy="steps", eval_steps=1), eval_dataset=ROWS)
        run(
            tmp_path / "c",
            args=dict(eval_strategy="steps", eval_steps=1),
            eval_dataset=[{"input_ids": [1, 2], "label": [1, 2]}] * 2,
        )
    assert not [w for w in caught if "eval_dataset" in str(w.message)]  # labelled rows, 'label' renamed: no warning
