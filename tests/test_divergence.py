"""A run whose parameters turn inf/NaN stops as ``diverged``; a skipped float16 step does not."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch

from trainfold import TrainingArguments, train
from trainfold.ckpt import list_checkpoints
from trainfold.core.losses import causal_lm
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.state import TrainState
from trainfold.observe.divergence import diverged, nonfinite_params
from trainfold.optim import GradientTransformation, sgd

ROWS = [{"input_ids": [i, i + 1, i + 2, i + 3], "labels": [i, i + 1, i + 2, i + 3]} for i in range(8)]


def model():
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))


def args(tmp_path, **changes):
    settings = dict(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        save_strategy="steps",
        save_steps=1,
    )
    return TrainingArguments(**{**settings, **changes})


def loss_turning(value, at_call):
    """Return ``causal_lm`` whose ``at_call``-th call (1-based: the step, with no accumulation) is ``value``."""
    calls = []

    def loss(outputs, labels, num_items_in_batch=None):
        calls.append(1)
        out = causal_lm(outputs, labels, num_items_in_batch)
        return out * value if len(calls) == at_call else out

    return loss


def test_nan_loss_stops_the_run_as_diverged_and_keeps_the_finite_checkpoints(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="trainfold"):
        result = train(model(), args(tmp_path, save_total_limit=2), ROWS, compute_loss_func=loss_turning(math.nan, 3))
    assert re.search(r"diverged at step 3: .*last finite checkpoint is .*checkpoint-2", caplog.text)
    assert result.status == "diverged"
    assert result.metrics["diverged_at_step"] == 3 and result.global_step == 3  # stopped there, not at max_steps
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]  # none rotated away
    assert result.last_checkpoint.name == "checkpoint-2"
    assert nonfinite_params(result.state.params)  # the state is the diverged one; the checkpoint is not
    first, second, at_3 = result.log_history[:3]  # the NaN step is logged, filtered: the mean of the finite ones
    assert at_3["step"] == 3 and at_3["loss"] == pytest.approx((first["loss"] + second["loss"]) / 2)


def test_params_that_overflow_with_a_finite_loss_are_never_saved(tmp_path, caplog):
    """An update that writes inf (finite loss and grad norm) is caught before the checkpoint is written."""
    base = sgd(1e-2)

    def update(grads, state, params):
        updates, state = base.update(grads, state, params)
        if int(state_step[0]) == 2:
            updates = {k: torch.full_like(v, math.inf) for k, v in updates.items()}
        state_step[0] += 1
        return updates, state

    state_step = [1]
    overflowing = GradientTransformation(init=base.init, update=update)
    with caplog.at_level(logging.ERROR, logger="trainfold"):
        result = train(model(), args(tmp_path, max_steps=2), ROWS, optimizer=overflowing)
    assert re.search("diverged at step 2", caplog.text)
    assert result.status == "diverged" and result.metrics["diverged_at_step"] == 2
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1"]


def test_a_skipped_float16_step_is_not_divergence(tmp_path):
    result = train(
        model(),
        args(tmp_path, max_steps=4, fp16=True, save_strategy="no"),
        ROWS,
        compute_loss_func=loss_turning(math.inf, 2),
    )
    assert result.status == "completed" and result.global_step == 4
    assert int(result.state.nonfinite_losses) == 1 and not nonfinite_params(result.state.params)
    assert "diverged_at_step" not in result.metrics


def test_diverged_reads_the_params_only_when_the_step_looks_wrong():
    nan = torch.tensor([math.nan])
    quiet = TrainState(params={"w": nan}, buffers={}, opt_state=None)  # finite (zero) metrics
    assert not diverged(quiet) and diverged(quiet, confirm=True)
    loud = TrainState(
        params={"w": torch.ones(1)},
        buffers={},
        opt_state=None,
        metrics={"loss": torch.tensor(math.nan), "grad_norm": torch.tensor(math.nan)},
    )
    assert not diverged(loud)


def test_nonfinite_params_names_exactly_the_tensors_with_inf_or_nan():
    params = {
        "huge": torch.full((4,), 3e38),
        "nan": torch.tensor([1.0, math.nan]),
        "infs": torch.tensor([math.inf, -math.inf]),
        "half": torch.ones(3, dtype=torch.float16),
        "ints": torch.arange(3),
    }
    assert nonfinite_params(params) == ["nan", "infs"]  # a finite tensor whose sum overflows is still finite


def test_a_diverged_cli_run_exits_3(tmp_path, capsys, caplog):
    from trainfold.cli.main import main

    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS))
    config = tmp_path / "run.toml"
    config.write_text(f"""
[model]
type = "tinylm"
config = {{ vocab_size = 16, d_model = 8, n_layers = 1, n_heads = 2, max_len = 8 }}
[data]
train = "{data}"
[args]
output_dir = "{tmp_path / "out"}"
max_steps = 20
per_device_train_batch_size = 2
learning_rate = 1e30
report_to = "none"
disable_tqdm = true
save_strategy = "no"
""")
    with caplog.at_level(logging.ERROR, logger="trainfold"):
        assert main(["train", "--config", str(config)]) == 3
    assert re.search("diverged at step", caplog.text)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["status"] == "diverged"
