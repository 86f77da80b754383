"""Evaluation data (issue 15, item 11): HF's eval DataLoader settings, and a dict of eval sets as HF names them."""

from __future__ import annotations

import copy
import multiprocessing
import os

import pytest
import torch
from resume_fixture import ListDataset

from trainfold import TrainingArguments, evaluate, predict, train
from trainfold.core.losses import causal_lm
from trainfold.data import eval_loader, pad_collate
from trainfold.distributed.distributed import shard
from trainfold.evaluation.metrics import eval_sets

transformers = pytest.importorskip("transformers")


def llama():  # not GPT-2: HF counts its unshifted labels, so its losses are off by (t - 1) / t
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def rows(n, seed=0, t=8):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 40, (t,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


SETTINGS = dict(
    max_steps=2,
    per_device_train_batch_size=2,
    per_device_eval_batch_size=2,
    learning_rate=1e-2,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    seed=3,
    train_sampling_strategy="sequential",
)


def ours(tmp_path, **over):
    return TrainingArguments(output_dir=str(tmp_path / "tf"), **{**SETTINGS, **over})


def hf(tmp_path, **over):
    return transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, **{**SETTINGS, **over})


def eval_keys(history):
    return [
        sorted(k for k in h if k not in ("epoch", "step") and not k.endswith("_token_loss"))  # trainfold's extra
        for h in history
        if any("runtime" in k for k in h) and not any(k.startswith("train_") for k in h)
    ]


# -- a dict of eval sets -----------------------------------------------------------------------------


def test_a_dict_of_eval_sets_is_logged_set_by_set_with_hfs_metric_names(tmp_path):
    sets = {"short": rows(3, 1), "long": rows(5, 2)}
    over = dict(eval_strategy="steps", eval_steps=1)
    trainer = transformers.Trainer(
        model=llama(),
        args=hf(tmp_path, **over),
        train_dataset=ListDataset(rows(8)),
        eval_dataset={k: ListDataset(v) for k, v in sets.items()},
    )
    trainer.train()
    r = train(llama(), ours(tmp_path, **over), rows(8), sets)
    assert eval_keys(r.log_history) == eval_keys(trainer.state.log_history)
    assert eval_keys(r.log_history)[0] == [
        "eval_short_loss",
        "eval_short_runtime",
        "eval_short_samples_per_second",
        "eval_short_steps_per_second",
    ]
    hf_evals = [h for h in trainer.state.log_history if "eval_long_loss" in h or "eval_short_loss" in h]
    our_evals = [h for h in r.log_history if "eval_long_loss" in h or "eval_short_loss" in h]
    assert [h["step"] for h in our_evals] == [h["step"] for h in hf_evals] == [1, 1, 2, 2]
    for h, o in zip(hf_evals, our_evals):  # equal-length rows: HF's mean of batch means is the token mean
        key = next(k for k in h if k.endswith("_loss"))
        assert o[key] == pytest.approx(h[key], rel=1e-5)


def test_the_best_model_metric_names_one_set_and_a_bare_loss_is_refused_as_hf_does(tmp_path):
    sets = {"a": rows(3, 1), "b": rows(4, 2)}
    over = dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True)
    r = train(llama(), ours(tmp_path, metric_for_best_model="b_loss", **over), rows(8), sets)
    assert r.best_checkpoint is not None
    with pytest.raises(KeyError, match="eval_loss.*eval_a_loss.*eval_{name}_"):
        train(llama(), ours(tmp_path / "x", **over), rows(8), sets)
    trainer = transformers.Trainer(
        model=llama(),
        args=hf(tmp_path, **over),
        train_dataset=ListDataset(rows(8)),
        eval_dataset={k: ListDataset(v) for k, v in sets.items()},
    )
    with pytest.raises(KeyError, match="eval_loss"):
        trainer.train()


def test_evaluate_takes_a_dict_of_sets_and_each_is_its_own_evaluation(tmp_path):
    net, a, b = llama(), rows(3, 1), rows(5, 2)
    both = evaluate(net, ours(tmp_path), {"a": a, "b": b})
    assert both["eval_a_loss"] == evaluate(net, ours(tmp_path), a)["eval_loss"]
    assert both["eval_b_loss"] == evaluate(net, ours(tmp_path), b)["eval_loss"]
    assert not any(k.startswith("eval_loss") for k in both)
    with pytest.raises(TypeError, match="predict takes one dataset"):
        predict(net, ours(tmp_path), {"a": a})
    with pytest.raises(ValueError, match="empty dict"):
        eval_sets({})


def test_evaluate_and_predict_refuse_a_keyword_they_lack_naming_the_ones_they_take(tmp_path):
    """They share one declared set of keywords (``EvalOptions``); a misspelt one is refused, never ignored."""
    net, a = llama(), rows(2, 1)
    for fn in (evaluate, predict):
        with pytest.raises(TypeError, match=r"\['compute_metric'\]; it takes metric_key_prefix, state, data_collator"):
            fn(net, ours(tmp_path), a, compute_metric=None)
    assert set(predict(net, ours(tmp_path), a, metric_key_prefix="t", state=None).metrics) >= {"t_loss"}


# -- the DataLoader settings reach evaluation ----------------------------------------------------------


def test_dataloader_drop_last_drops_the_last_short_eval_batch_as_hf_does(tmp_path):
    data, net = rows(7, 4), llama()
    trainer = transformers.Trainer(model=copy.deepcopy(net), args=hf(tmp_path, dataloader_drop_last=True))
    hf_out = trainer.predict(ListDataset(data))
    out = predict(net, ours(tmp_path, dataloader_drop_last=True), data)
    assert out.predictions.shape[0] == hf_out.predictions.shape[0] == 6
    kept = evaluate(net, ours(tmp_path, dataloader_drop_last=True), data)["eval_loss"]
    assert kept == pytest.approx(evaluate(net, ours(tmp_path), data[:6])["eval_loss"], rel=1e-12)
    assert kept != pytest.approx(evaluate(net, ours(tmp_path), data)["eval_loss"], rel=1e-6)
    r = train(llama(), ours(tmp_path, dataloader_drop_last=True, eval_strategy="steps", eval_steps=2), rows(8), data)
    assert r.log_history[-2]["eval_loss"] == pytest.approx(
        evaluate(llama(), ours(tmp_path), data[:6], state=r.state)["eval_loss"], rel=1e-6
    )


class PidModel(torch.nn.Module):
    """An LM whose forward takes ``**kwargs`` and records the ``pid`` the collator put in each batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(40, 40)
        self.pids: list[int] = []

    def forward(self, input_ids, attention_mask=None, **kwargs):
        if "pid" in kwargs and not torch.is_grad_enabled():  # evaluation only
            self.pids += kwargs["pid"].tolist()
        return self.emb(input_ids)


_pad = pad_collate()


def in_a_worker(items):
    assert torch.utils.data.get_worker_info() is not None, "the eval collator ran in the main process"
    batch = _pad(items)
    batch["pid"] = torch.full((len(items),), os.getpid())
    return batch


@pytest.mark.parametrize("persistent", [False, True])
def test_eval_batches_are_loaded_by_dataloader_workers(tmp_path, persistent):
    net = PidModel()
    args = ours(
        tmp_path,
        eval_strategy="steps",
        eval_steps=1,
        dataloader_num_workers=2,
        dataloader_persistent_workers=persistent,
        dataloader_prefetch_factor=2,
    )
    r = train(net, args, rows(8), rows(4, 5), data_collator=in_a_worker, compute_loss_func=causal_lm)
    assert r.global_step == 2 and len(net.pids) == 8  # 2 evaluations of 4 rows
    # no worker outlives the run (a persistent one left behind blocks the interpreter's exit forever)
    assert not multiprocessing.active_children()
    first, second = set(net.pids[:4]), set(net.pids[4:])
    assert os.getpid() not in first | second and len(first) == 2
    assert (first == second) is persistent  # persistent workers serve every evaluation


def test_eval_order_is_the_datasets_for_any_number_of_workers():
    data = list(range(11))
    plain = [b for b in eval_loader(data, lambda items: items, 3)]
    assert plain == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]]
    assert [b for b in eval_loader(data, lambda items: items, 3, dataloader_num_workers=2)] == plain
    # an IterableDataset keeps its last short batch under dataloader_drop_last, as in HF
    kept = [b for b in eval_loader(iter_rows(5), lambda items: items, 2, dataloader_drop_last=True)]
    assert kept == [[0, 1], [2, 3], [4]]
    assert [b for b in eval_loader((i for i in range(3)), lambda items: items, 2)] == [[0, 1], [2]]  # any iterable


class iter_rows(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def test_sharded_eval_with_drop_last_splits_whole_global_batches():
    data = list(range(11))
    parts = [list(shard(data, r, 2, multiple_of=2 * 2)) for r in range(2)]
    assert parts == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 11 rows, eval batch 2 x 2 ranks: 8 rows, 2 batches a rank


def test_eval_loader_errors_name_the_setting():
    with pytest.raises(ValueError, match="dataloader_drop_last=True drops every row of an eval set of 1 rows"):
        eval_loader([1], lambda items: items, 2, dataloader_drop_last=True)
    with pytest.raises(ValueError, match="dataloader_persistent_workers=True needs dataloader_num_workers > 0"):
        eval_loader([1], lambda items: items, 2, dataloader_persistent_workers=True)
    with pytest.raises(ValueError, match="leaves 0"):
        shard([1, 2, 3], 0, 2, multiple_of=4)
