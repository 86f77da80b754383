"""`transformers.TrainerCallback` objects in `train(callbacks=...)`: the events, their order and arguments
match a real `transformers.Trainer` run; control flags are honoured; hooks needing a mutable trainer are refused."""

from __future__ import annotations

import pytest
import torch
from resume_fixture import ListDataset

from trainfold import TrainingArguments, train

transformers = pytest.importorskip("transformers")

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_step_end",
    "on_log",
    "on_evaluate",
    "on_save",
)


class Recorder(transformers.TrainerCallback):
    """Records (event, global_step) and what the callbacks read most."""

    def __init__(self):
        self.calls, self.seen = [], []

    def _record(self, name, args, state, control, **kwargs):
        self.calls.append((name, state.global_step))
        self.seen.append(
            {
                "event": name,
                "output_dir": args.output_dir,
                "logging_steps": args.logging_steps,
                "epoch": state.epoch,
                "max_steps": state.max_steps,
                "best_metric": state.best_metric,
                "best_model_checkpoint": state.best_model_checkpoint,
                "log_history": len(state.log_history),
                "logs": kwargs.get("logs"),
                "metrics": kwargs.get("metrics"),
            }
        )


for _name in EVENTS:
    setattr(
        Recorder, _name, lambda self, args, state, control, _n=_name, **kw: self._record(_n, args, state, control, **kw)
    )


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def rows(n=8, t=8):
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": (ids := torch.randint(0, 64, (t,), generator=g)), "labels": ids.clone()} for _ in range(n)]


SETTINGS = dict(
    max_steps=6,
    per_device_train_batch_size=2,
    learning_rate=1e-3,
    logging_steps=2,
    eval_strategy="steps",
    eval_steps=3,
    save_strategy="steps",
    save_steps=3,
    metric_for_best_model="loss",
    seed=7,
    train_sampling_strategy="sequential",
    report_to="none",
    disable_tqdm=True,
)


def hf_run(out, callbacks, compute_metrics=None, n_rows=8, **changes):
    settings = {**SETTINGS, **changes}
    args = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, **settings)
    trainer = transformers.Trainer(
        model=llama(),
        args=args,
        train_dataset=ListDataset(rows(n_rows)),
        eval_dataset=ListDataset(rows(4)),
        callbacks=callbacks,
        compute_metrics=compute_metrics,
    )
    trainer.train()
    return trainer


def our_run(out, callbacks, compute_metrics=None, n_rows=8, **changes):
    settings = {**SETTINGS, **changes}
    return train(
        llama(),
        TrainingArguments(output_dir=str(out), **settings),
        rows(n_rows),
        rows(4),
        callbacks=callbacks,
        compute_metrics=compute_metrics,
    )


def test_events_and_their_steps_match_the_hf_trainer(tmp_path):
    theirs, ours = Recorder(), Recorder()
    hf_run(tmp_path / "hf", [theirs])
    result = our_run(tmp_path / "tf", [ours])
    assert result.status == "completed"
    assert ours.calls == theirs.calls
    assert [c for c in ours.calls if c[0] in ("on_log", "on_evaluate", "on_save", "on_epoch_end")] == [
        ("on_log", 2),
        ("on_log", 3),
        ("on_evaluate", 3),
        ("on_save", 3),
        ("on_log", 4),
        ("on_epoch_end", 4),
        ("on_log", 6),
        ("on_log", 6),
        ("on_evaluate", 6),
        ("on_save", 6),
        ("on_epoch_end", 6),
        ("on_log", 6),
    ]


def test_callbacks_see_hf_shaped_args_state_and_logs(tmp_path):
    theirs, ours = Recorder(), Recorder()
    hf_run(tmp_path / "hf", [theirs])
    our_run(tmp_path / "tf", [ours])
    for mine, hf in zip(ours.seen, theirs.seen, strict=True):
        assert mine["event"] == hf["event"]
        if mine["event"] == "on_init_end":  # HF's state then is a blank one, replaced when train() starts
            continue
        assert mine["logging_steps"] == hf["logging_steps"] and mine["max_steps"] == hf["max_steps"]
        assert mine["epoch"] == pytest.approx(hf["epoch"]), mine["event"]
        assert mine["log_history"] == hf["log_history"], mine["event"]
        assert (mine["best_metric"] is None) == (hf["best_metric"] is None), mine["event"]
        assert (mine["best_model_checkpoint"] or "").rsplit("/", 1)[-1] == (hf["best_model_checkpoint"] or "").rsplit(
            "/", 1
        )[-1], mine["event"]
        for key in ("logs", "metrics"):
            assert (mine[key] is None) == (hf[key] is None)
            if hf[key] is not None:
                extra = {"total_flos", "eval_token_loss"}  # eval_token_loss: trainfold's named extra (the token mean)
                assert set(mine[key]) - extra == set(hf[key]) - extra, (mine["event"], key)
    assert ours.seen[0]["output_dir"] == str(tmp_path / "tf")


def test_early_stopping_callback_stops_at_the_same_step_as_hf(tmp_path):
    scores = [3.0, 2.0, 2.5, 2.2, 2.1, 1.0, 0.5, 0.2]  # best 2.0 at eval 2; evals 3 and 4 do not improve

    def scripted():
        count = iter(scores)
        return lambda prediction: {"score": next(count)}

    settings = dict(
        max_steps=16, eval_steps=2, save_steps=2, metric_for_best_model="score", greater_is_better=False, n_rows=10
    )  # 5 steps an epoch: no evaluation falls on an epoch's last step before step 10
    trainer = hf_run(
        tmp_path / "hf", [transformers.EarlyStoppingCallback(early_stopping_patience=2)], scripted(), **settings
    )
    ours = our_run(
        tmp_path / "tf", [transformers.EarlyStoppingCallback(early_stopping_patience=2)], scripted(), **settings
    )
    assert trainer.state.global_step == 8
    assert ours.status == "stopped" and ours.global_step == trainer.state.global_step


def test_control_flags_set_by_a_callback_are_honoured(tmp_path):
    class Steer(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_evaluate = state.global_step == 1
            control.should_save = state.global_step == 2
            control.should_training_stop = state.global_step == 5

    recorder = Recorder()
    result = our_run(tmp_path / "tf", [Steer(), recorder])
    assert result.status == "stopped" and result.global_step == 5
    assert [c for c in recorder.calls if c[0] in ("on_evaluate", "on_save")] == [
        ("on_evaluate", 1),
        ("on_save", 2),
        ("on_evaluate", 3),
        ("on_save", 3),
    ]
    assert sorted(p.name for p in (tmp_path / "tf").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert recorder.calls[-1] == ("on_train_end", 5)


def test_the_callback_sees_the_trained_tensors_in_trainfold_state(tmp_path):
    class Norms(transformers.TrainerCallback):
        norms = []

        def on_step_end(self, args, state, control, trainfold_state=None, model=None, **kwargs):
            assert model is None
            self.norms.append(float(trainfold_state.params["lm_head.weight"].norm()))

    our_run(tmp_path, [Norms()], max_steps=3, eval_strategy="no", save_strategy="no", metric_for_best_model=None)
    assert len(Norms.norms) == 3 and len(set(Norms.norms)) == 3  # the weights change step by step


# -- refusals --------------------------------------------------------------------------------------


def test_hooks_that_need_a_mutable_trainer_are_refused_by_name(tmp_path):
    class Clipper(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            pass

        def on_optimizer_step(self, args, state, control, **kwargs):
            pass

    refused = "Clipper overrides on_pre_optimizer_step.*\n.*Clipper overrides on_optimizer_step"
    with pytest.raises(TypeError, match=refused):
        our_run(tmp_path, [Clipper()])
    assert not (tmp_path / "log.jsonl").exists() and not list(tmp_path.glob("checkpoint-*"))


def test_a_callback_as_an_observer_and_a_function_as_a_callback_are_refused_with_the_fix(tmp_path):
    with pytest.raises(TypeError, match=r"Recorder is not callable \(a transformers.TrainerCallback goes in callbacks"):
        train(llama(), TrainingArguments(output_dir=str(tmp_path), **SETTINGS), rows(), rows(4), observers=[Recorder()])
    with pytest.raises(TypeError, match=r"got function .*pass it as observers"):
        our_run(tmp_path, [lambda state, logs: None])


def test_early_stopping_callback_needs_a_metric_and_evaluation(tmp_path):
    with pytest.raises(ValueError, match="needs metric_for_best_model"):
        our_run(tmp_path, [transformers.EarlyStoppingCallback()], metric_for_best_model=None)
    with pytest.raises(ValueError, match="once"):
        from trainfold.observe.stopping import early_stopping

        train(
            llama(),
            TrainingArguments(output_dir=str(tmp_path), **SETTINGS),
            rows(),
            rows(4),
            callbacks=[transformers.EarlyStoppingCallback()],
            early_stopping=early_stopping("eval_loss"),
        )


def test_should_epoch_stop_is_refused(tmp_path):
    class EpochStop(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_epoch_stop = True

    with pytest.raises(ValueError, match="should_epoch_stop in on_step_end.*should_training_stop"):
        our_run(tmp_path, [EpochStop()])


def test_early_stopping_callback_threshold_counts_from_the_last_counted_improvement(tmp_path):
    def scripted():
        count = iter([10.0, 9.6, 9.2, 8.8, 8.4, 8.0, 7.6, 7.2])  # steady progress of 0.4 an evaluation
        return lambda prediction: {"score": next(count)}

    settings = dict(
        max_steps=16, eval_steps=2, save_steps=2, metric_for_best_model="score", greater_is_better=False, n_rows=10
    )

    def stopper():
        return transformers.EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.5)

    trainer = hf_run(tmp_path / "hf", [stopper()], scripted(), **settings)
    ours = our_run(tmp_path / "tf", [stopper()], scripted(), **settings)
    assert trainer.state.global_step == 6  # HF: its best moved to 9.6, so 9.2 "gained only 0.4": stopped
    assert ours.status == "completed" and ours.global_step == 16  # 0.8 gained over 2 evaluations > 0.5


@pytest.mark.parametrize(
    "changes",
    [
        dict(eval_strategy="epoch", save_strategy="epoch"),  # steps logs; epoch evaluations and saves
        dict(logging_strategy="epoch", eval_steps=2, save_strategy="epoch"),  # epoch logs and saves, steps evaluations
    ],
    ids=["eval-save-by-epoch", "log-save-by-epoch"],
)
def test_on_epoch_end_comes_where_the_hf_trainer_calls_it_at_an_epochs_last_step(tmp_path, changes):
    # HF at an epoch's last step: on_step_end, the step's logs/evaluations/saves, on_epoch_end, then those by epoch
    theirs, ours = Recorder(), Recorder()
    hf_run(tmp_path / "hf", [theirs], **changes)
    our_run(tmp_path / "tf", [ours], **changes)
    assert ours.calls == theirs.calls
    at_epoch_end = [c for c in ours.calls if c[1] == 4 and c[0] != "on_step_begin"]
    assert at_epoch_end.index(("on_epoch_end", 4)) < at_epoch_end.index(("on_save", 4))


@pytest.mark.parametrize("level", ["error", "info", "passive"])
def test_log_level_sets_the_transformers_logger_as_the_hf_trainer_does(tmp_path, level):
    logging = transformers.utils.logging
    before = logging.get_verbosity()
    try:
        logging.set_verbosity(logging.WARNING)
        hf_run(tmp_path / "hf", [], log_level=level, max_steps=1, eval_strategy="no", save_strategy="no")
        theirs = logging.get_verbosity()
        logging.set_verbosity(logging.WARNING)
        our_run(tmp_path / "tf", [], log_level=level, max_steps=1, eval_strategy="no", save_strategy="no")
        assert logging.get_verbosity() == theirs == {"error": 40, "info": 20, "passive": 30}[level]
    finally:
        logging.set_verbosity(before)
