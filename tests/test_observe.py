"""Observers: logging windows (also across a resume), plain observers, everything together in a fold."""

from __future__ import annotations

import json
import math
import types

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_stopping import reference_bad_evals
from torch import nn
from torch.func import functional_call

from trainfold import chain, clip_by_global_norm, init_state, make_step, sgd
from trainfold.core.fold import any_of, fit, max_steps, trajectory
from trainfold.core.losses import cross_entropy
from trainfold.core.state import Cursor, TrainState, scalar
from trainfold.core.tree import flatten, global_norm, unflatten
from trainfold.observe import (
    LOG_MARK,
    LoggingPlan,
    LogMark,
    MetricWindow,
    eval_entry,
    initial_extras,
    log_entry,
    log_if_due,
    log_mark,
    logging_plan,
    mark_logged,
    notify,
    observing,
    should_log,
    tap,
    train_summary,
)
from trainfold.observe.reporters import make_reporters
from trainfold.observe.stopping import early_stopping, patience_exhausted, record_evaluation
from trainfold.optim.schedules import linear

# -- a small classification run ----------------------------------------------------------------


def model_and_batches(n_steps: int, seed: int = 0) -> tuple[nn.Module, list[list[dict]]]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [
        [{"input": torch.randn(5, 4, generator=g), "labels": torch.randint(0, 3, (5,), generator=g)}]
        for _ in range(n_steps)
    ]
    return model, batches


def optimizer(total: int = 30):
    return chain(clip_by_global_norm(0.05), sgd(linear(0.5, 2, total)))


class Recorder:
    """A reporter that remembers what it was given."""

    def __init__(self) -> None:
        self.entries: list[tuple[dict, int]] = []
        self.closed = False

    def log(self, entry: dict, step: int) -> None:
        self.entries.append((dict(entry), step))

    def close(self) -> None:
        self.closed = True


def run_logged(model, batches, state, plan, recorder, step_losses, total):
    step = make_step(model, cross_entropy, optimizer())
    n = len(batches)

    def after(s: TrainState) -> TrainState:
        step_losses.append(float(s.metrics["loss"]))
        return log_if_due(s, plan, [recorder], last=int(s.step) == total)

    return fit(observing(step, after), state, batches) if n else state


# -- logging: concrete ---------------------------------------------------------------------------


@pytest.mark.parametrize("every", [1, 3, 10])
def test_logged_loss_is_the_mean_of_the_window_step_losses(every):
    total = 23
    model, batches = model_and_batches(total)
    state = init_state(model, optimizer(), extras={LOG_MARK: LogMark()})
    rec, losses = Recorder(), []
    final = run_logged(model, batches, state, LoggingPlan("steps", every), rec, losses, total)
    expected_steps = sorted({s for s in range(1, total + 1) if s % every == 0} | {total})
    assert [step for _, step in rec.entries] == expected_steps
    prev = 0
    for entry, s in rec.entries:
        window = losses[prev:s]
        assert entry["loss"] == pytest.approx(math.fsum(window) / len(window), rel=1e-12, abs=0)
        assert entry["step"] == s
        prev = s
    assert int(log_mark(final).step) == total
    assert len(set(losses)) > 1  # the losses really differ, so the mean is not trivially right


def test_grad_norm_is_the_pre_clip_norm_and_learning_rate_the_one_used():
    model, batches = model_and_batches(4)
    opt = optimizer(total=4)
    step = make_step(model, cross_entropy, opt)
    state = init_state(model, opt)
    schedule = linear(0.5, 2, 4)
    for k, batch in enumerate(batches):
        mb = batch[0]
        leaves = {n: t.detach().requires_grad_() for n, t in state.params.items()}
        out = functional_call(model, leaves, (mb["input"],))
        grads = torch.autograd.grad(cross_entropy(out, mb["labels"], torch.tensor(5)), list(leaves.values()))
        state = step(state, batch)
        entry = log_entry(state, LogMark(step=scalar(k), loss_total=scalar(0.0, torch.float64)))
        assert entry["grad_norm"] == pytest.approx(global_norm(grads).item(), rel=1e-6)
        assert entry["grad_norm"] > 0.05  # above the clip: the logged norm is the one before clipping
        assert entry["learning_rate"] == pytest.approx(schedule(k), rel=1e-6)


def test_logged_windows_survive_a_resume_taken_mid_window():
    total, every, cut = 11, 4, 6
    model, batches = model_and_batches(total)
    plan = LoggingPlan("steps", every)
    fresh = init_state(model, optimizer(), extras={LOG_MARK: LogMark()})
    straight, losses = Recorder(), []
    run_logged(model, batches, fresh, plan, straight, losses, total)

    first, resumed = Recorder(), Recorder()
    mid = run_logged(model, batches[:cut], fresh, plan, first, [], total)
    assert int(log_mark(mid).step) == 4 and int(mid.step) == cut  # the checkpoint is mid-window
    restored = unflatten(flatten(mid), init_state(model, optimizer(), extras={LOG_MARK: LogMark()}))
    run_logged(model, batches[cut:], restored, plan, resumed, [], total)
    assert first.entries + resumed.entries == straight.entries


def test_epoch_is_fractional_from_the_cursor():
    state = TrainState(
        params={},
        buffers={},
        opt_state=None,
        step=scalar(13),
        cursor=Cursor(scalar(2), scalar(3)),
        loss_total=scalar(1.0, torch.float64),
    )
    assert log_entry(state, steps_per_epoch=5)["epoch"] == 2.6
    assert log_entry(state)["epoch"] == 2.0


def test_mark_logged_returns_a_new_state_with_its_own_tensors():
    state = TrainState(params={}, buffers={}, opt_state=None, step=scalar(3), loss_total=scalar(2.0, torch.float64))
    marked = mark_logged(state)
    assert LOG_MARK not in state.extras
    assert marked.extras[LOG_MARK].step is not marked.step  # safetensors refuses shared tensors
    flatten(marked)  # still a valid record


def test_eval_entry_and_train_summary():
    state = TrainState(
        params={},
        buffers={},
        opt_state=None,
        step=scalar(10),
        loss_total=scalar(12.0, torch.float64),
        cursor=Cursor(scalar(1), scalar(0)),
    )
    entry = eval_entry({"loss": torch.tensor(0.5), "eval_accuracy": 0.75}, state, steps_per_epoch=10)
    assert entry == {"eval_loss": 0.5, "eval_accuracy": 0.75, "epoch": 1.0, "step": 10}
    start = attrs.evolve(state, step=scalar(4), loss_total=scalar(3.0, torch.float64))
    summary = train_summary(state, start, runtime=3.0, num_samples=60)
    assert summary["train_loss"] == pytest.approx(9.0 / 6)
    assert summary["train_steps_per_second"] == pytest.approx(2.0)
    assert summary["train_samples_per_second"] == pytest.approx(20.0)
    assert summary["train_runtime"] == 3.0
    assert math.isnan(train_summary(state, state, runtime=1.0)["train_loss"])


def test_observers_get_each_entry_and_reporters_too():
    state = TrainState(params={}, buffers={}, opt_state=None, step=scalar(2), loss_total=scalar(3.0, torch.float64))
    seen, rec = [], Recorder()
    out = log_if_due(state, LoggingPlan("steps", 2), [rec], [lambda s, logs: seen.append((int(s.step), logs["loss"]))])
    assert seen == [(2, 1.5)] and rec.entries[0][1] == 2
    assert log_if_due(out, LoggingPlan("steps", 2), [rec]) is out  # nothing new to log: unchanged
    logs = {"loss": 1.0}
    notify([lambda s, d: d.clear()], state, logs)
    assert logs == {"loss": 1.0}  # an observer cannot change the caller's entry


def test_tap_and_observing_compose_in_a_fold():
    seen: list[int] = []
    step = observing(lambda s, b: s + b, tap(seen.append), lambda s: s * 10)
    assert list(trajectory(step, 0, [1, 2])) == [10, 120]
    assert seen == [1, 12]


# -- logging: properties -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(every=st.integers(1, 7), total=st.integers(1, 30), first=st.booleans(), last=st.booleans())
def test_should_log_by_steps(every, total, first, last):
    plan = LoggingPlan("steps", every, first)
    logged, mark = [], 0
    for s in range(1, total + 1):
        if should_log(plan, s, mark, last=last and s == total):
            logged.append(s)
            mark = s
    expected = (
        {s for s in range(1, total + 1) if s % every == 0} | ({1} if first else set()) | ({total} if last else set())
    )
    assert logged == sorted(expected)


@settings(max_examples=30, deadline=None)
@given(ends=st.lists(st.booleans(), min_size=1, max_size=20))
def test_should_log_by_epoch_and_never(ends):
    plan = LoggingPlan("epoch", 1)
    assert [should_log(plan, s, s - 1, epoch_end=e) for s, e in enumerate(ends, 1)] == ends
    assert not any(should_log(LoggingPlan("no", 1), s, 0, epoch_end=True, last=True) for s in range(1, 5))
    # logging_first_step logs step 1 even under "no" (HF's DefaultFlowCallback), nothing else
    assert [s for s in range(1, 5) if should_log(LoggingPlan("no", 1, True), s, 0, epoch_end=True, last=True)] == [1]


@settings(max_examples=40, deadline=None)
@given(losses=st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=12), cut=st.integers(0, 12))
def test_window_mean_from_running_sums(losses, cut):
    cut = min(cut, len(losses) - 1)
    total = torch.zeros((), dtype=torch.float64)
    state = TrainState(params={}, buffers={}, opt_state=None)
    for k, loss in enumerate(losses, 1):
        total = total + torch.tensor(loss, dtype=torch.float32).double()
        state = attrs.evolve(state, step=scalar(k), loss_total=total)
        if k == cut:
            state = mark_logged(state)
    window = [float(torch.tensor(v, dtype=torch.float32)) for v in losses[cut:]]
    assert log_entry(state)["loss"] == pytest.approx(math.fsum(window) / len(window), rel=1e-9, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    losses=st.lists(st.sampled_from([0.5, 1.0, 2.5, math.nan, math.inf, -math.inf]), min_size=1, max_size=12),
    every=st.integers(1, 4),
)
def test_non_finite_steps_are_filtered_and_a_window_never_logs_nan_after_a_finite_step(losses, every):
    """Each logged loss is the mean of its window's finite steps, else of every finite step so far."""
    state = TrainState(params={}, buffers={}, opt_state=None)
    logged: list[tuple[int, float]] = []
    recorder = types.SimpleNamespace(log=lambda entry, step: logged.append((step, entry["loss"])))
    for k, loss in enumerate(losses, 1):
        finite = math.isfinite(loss)
        state = attrs.evolve(
            state,
            step=scalar(k),
            loss_total=state.loss_total + (loss if finite else 0.0),
            nonfinite_losses=state.nonfinite_losses + (not finite),
        )
        state = log_if_due(state, LoggingPlan("steps", every), [recorder], last=k == len(losses))
    start = 0
    for step, value in logged:
        window = [v for v in losses[start:step] if math.isfinite(v)] or [v for v in losses[:step] if math.isfinite(v)]
        if window:
            assert value == pytest.approx(sum(window) / len(window))
        else:  # nothing finite yet: nothing to stand in
            assert math.isnan(value)
        start = step


# -- logging: errors -----------------------------------------------------------------------------


def test_logging_plan_resolves_ratios_and_reports_all_errors():
    assert logging_plan("steps", 0.25, total_steps=10).steps == 3
    assert logging_plan("steps", 3.0).steps == 3
    with pytest.raises(ValueError, match=r"logging_strategy='often'(.|\n)*logging_steps=0.5 is a share of max_steps"):
        logging_plan("often", 0.5)
    with pytest.raises(ValueError, match="whole number"):
        logging_plan("steps", 2.5)
    with pytest.raises(ValueError, match="positive number of steps"):
        logging_plan("steps", 0)


def test_log_entry_refuses_an_empty_window():
    state = mark_logged(TrainState(params={}, buffers={}, opt_state=None, step=scalar(5)))
    with pytest.raises(ValueError, match="nothing to log: the state is at step 5"):
        log_entry(state)


# -- everything together in a fold ---------------------------------------------------------------


def test_a_logged_evaluated_early_stopped_fold_writes_jsonl(tmp_path):
    model, batches = model_and_batches(40)
    _, held_out = model_and_batches(1, seed=99)
    es = early_stopping("eval_loss", patience=2, threshold=0.02)
    plan = logging_plan("steps", 0.1, total_steps=40)
    step = make_step(model, cross_entropy, optimizer(40))
    state = init_state(model, optimizer(40), extras=initial_extras(es))
    evals: list[float] = []

    def evaluate(s: TrainState) -> TrainState:
        if int(s.step) % 4:
            return s
        mb = held_out[0][0]
        with torch.no_grad():
            out = functional_call(model, s.params, (mb["input"],))
        metrics = {"loss": cross_entropy(out, mb["labels"], torch.tensor(5)).item()}
        evals.append(metrics["loss"])
        entry = eval_entry(metrics, s)
        reporters.log(entry, entry["step"])
        return record_evaluation(es, s, entry)

    with make_reporters(["jsonl"], tmp_path, run_name="it") as reporters:
        log = lambda s: log_if_due(s, plan, reporters)
        final = fit(observing(step, log, evaluate), state, batches, stop=any_of(patience_exhausted(es), max_steps(40)))
    stops = [stopped for _, stopped in reference_bad_evals(evals, 2, 0.02, False)]
    assert stops[-1] and not any(stops[:-1])  # it stopped at the first evaluation the reference stops at
    assert int(final.step) == 4 * len(evals) < 40
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(4, int(final.step) + 1, 4))
    assert [r["eval_loss"] for r in rows if "eval_loss" in r] == pytest.approx(evals)


def test_metric_window_counts_each_step_once_and_skips_the_step_metrics():
    def at(step, **metrics):
        base = {
            "loss": torch.tensor(9.0),
            "grad_norm": torch.tensor(9.0),
            "learning_rate": torch.tensor(9.0),
            "num_items": torch.tensor(9.0),
            "vector": torch.ones(3),
        }
        return TrainState(
            params={},
            buffers={},
            opt_state=None,
            step=scalar(step),
            metrics={**base, **{k: torch.tensor(v) for k, v in metrics.items()}},
        )

    window = MetricWindow()
    for state in (at(1, a=1.0), at(1, a=1.0), at(2, a=2.0, b=4.0), at(3, a=6.0)):  # step 1 seen twice (a no-op step)
        window.add(state)
    assert window.take() == {"a": 3.0, "b": 4.0}  # b: over the one step that reported it
    window.add(at(4, a=5.0))
    assert window.take() == {"a": 5.0}


# -- the vocabularies: each has one owner, which the rest reads ----------------------------------


def test_the_logging_vocabularies_are_public_and_checked_against():
    from trainfold.observe import LOG_LEVELS, LOGGING_STRATEGIES, REPORTERS, TOKEN_COUNTS, counting_input_tokens
    from trainfold.observe.reporters import progress

    assert LOGGING_STRATEGIES == ("no", "steps", "epoch") and [LoggingPlan(s).strategy for s in LOGGING_STRATEGIES]
    with pytest.raises(ValueError, match=r"logging_strategy='weekly' is not one of \['no', 'steps', 'epoch'\]"):
        logging_plan("weekly")
    assert list(REPORTERS) == ["jsonl", "tensorboard", "trackio", "wandb"]
    assert "passive" in LOG_LEVELS and "warning" in LOG_LEVELS
    with pytest.raises(ValueError, match="log_level='loud' is not one of"):
        progress(3, log_level="loud")
    assert TOKEN_COUNTS == ("all", "non_padding")
    with pytest.raises(ValueError, match="mode='some' must be 'all' or 'non_padding'"):
        counting_input_tokens(lambda s, b: s, "some")


def test_state_extras_keys_are_the_owners_constants():
    from trainfold.observe import TOKENS_SEEN
    from trainfold.observe.stopping import EARLY_STOPPING

    extras = initial_extras(early_stopping("eval_loss"), tokens_seen=True)
    assert sorted(extras) == sorted([LOG_MARK, TOKENS_SEEN, EARLY_STOPPING])
