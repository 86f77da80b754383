"""float16 with dynamic loss scaling: torch.amp.GradScaler's algorithm as a pure step."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from trainfold import adamw, init_state, make_step
from trainfold.core.losses import causal_lm, count_shifted_labels
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.core.tree import flatten
from trainfold.step.amp import SCALER, LossScaling, initial_scaler

CFG = TinyLMConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, max_len=16)


def lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(CFG)


def batches(n: int) -> list[list[dict]]:
    g = torch.Generator().manual_seed(1)
    return [[{"input_ids": (x := torch.randint(0, 32, (4, 16), generator=g)), "labels": x}] for _ in range(n)]


def test_the_scale_and_the_params_follow_torch_grad_scaler():
    scaling = LossScaling(init_scale=2.0**30, growth_interval=3)  # overflows at first, then backs off
    data = batches(12)
    ref = copy.deepcopy(lm())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0, foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=scaling.init_scale, growth_interval=scaling.growth_interval)
    ref_scales = []
    for (micro,) in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = causal_lm(ref(input_ids=micro["input_ids"]), micro["labels"], count_shifted_labels(micro["labels"]))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        ref_scales.append(scaler.get_scale())

    model, ours = lm(), adamw(1e-3, mask=None, foreach=True)
    step = make_step(model, causal_lm, ours, autocast=torch.float16, loss_scaling=scaling)
    state = init_state(model, ours, extras={SCALER: initial_scaler(scaling)})
    scales, skipped = [], 0
    for batch in data:
        new = step(state, batch)
        skipped += int(new.opt_state.count) == int(state.opt_state.count)
        state = new
        scales.append(state.extras[SCALER].scale.item())
    assert scales == ref_scales
    assert skipped >= 2 and int(state.step) == 12  # skipped steps still count as steps
    for name, p in ref.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name  # the same ops as torch.amp in the same order


def test_a_skipped_step_keeps_params_and_optimizer_state_and_the_inputs_are_untouched():
    scaling = LossScaling(init_scale=2.0**60)  # certain overflow in float16
    model, opt = lm(), adamw(1e-3)
    step = make_step(model, causal_lm, opt, autocast=torch.float16, loss_scaling=scaling)
    state = init_state(model, opt, extras={SCALER: initial_scaler(scaling)})
    before = {k: (v._version, v.clone()) for k, v in flatten(state).items()}
    new = step(state, batches(1)[0])
    assert all(torch.equal(new.params[k], state.params[k]) for k in state.params)
    assert int(new.opt_state.count) == 0 and int(new.step) == 1
    assert new.extras[SCALER].scale.item() == 2.0**59 and not torch.isfinite(new.metrics["grad_norm"])
    assert all(
        v._version == ver and torch.equal(v, c) for (k, v), (ver, c) in zip(flatten(state).items(), before.values())
    )


def test_the_scaler_must_be_in_the_state_and_is_refused_with_compile():
    model, opt = lm(), adamw(1e-3)
    step = make_step(model, causal_lm, opt, autocast=torch.float16, loss_scaling=LossScaling())
    with pytest.raises(KeyError, match="loss_scaling needs the scaler in state.extras"):
        step(init_state(model, opt), batches(1)[0])
    with pytest.raises(ValueError, match="with compile is not supported yet"):
        make_step(model, causal_lm, opt, loss_scaling=LossScaling(), compile=True)
    with pytest.raises(ValueError, match="growth_factor > 1"):
        LossScaling(growth_factor=1.0)


def test_train_with_fp16_scales_checkpoints_and_resumes_the_scaler(tmp_path):
    from trainfold import TrainingArguments, train
    from trainfold import ckpt as checkpoint

    rows = [{"input_ids": list(range(i, i + 12)), "labels": list(range(i, i + 12))} for i in range(16)]
    base = {
        "max_steps": 4,
        "per_device_train_batch_size": 4,
        "logging_steps": 1,
        "report_to": "none",
        "disable_tqdm": True,
        "learning_rate": 1e-2,
        "fp16": True,
        "save_strategy": "steps",
        "save_steps": 2,
    }
    straight = train(lm(), TrainingArguments(output_dir=str(tmp_path / "a"), **base), rows)
    assert (
        straight.state.extras[SCALER].scale.item() == 2.0**16 and int(straight.state.extras[SCALER].growth_tracker) == 4
    )
    saved = checkpoint.load(tmp_path / "a" / "checkpoint-2", like=straight.state)
    assert int(saved.extras[SCALER].growth_tracker) == 2
    out = tmp_path / "b"
    train(lm(), TrainingArguments(output_dir=str(out), **base), rows, stop=lambda s: int(s.step) >= 2)
    resumed = train(lm(), TrainingArguments(output_dir=str(out), **base), rows, resume_from_checkpoint=True)
    for k in straight.state.params:
        assert torch.equal(resumed.state.params[k], straight.state.params[k]), k
    assert int(resumed.state.extras[SCALER].growth_tracker) == 4
    for settings_, message in [
        ({"fp16": True, "bf16": True}, "choose one"),
        ({"fp16": True, "torch_compile": True}, "fp16 .loss scaling. with torch_compile"),
    ]:
        with pytest.raises(ValueError, match=message):
            TrainingArguments(**settings_)


def test_an_overflowing_loss_is_skipped_and_left_out_of_the_logged_means():
    from trainfold.observe import LogMark, log_entry, train_summary

    def objective(forward, params, micro, num_items, key):  # the second batch's loss overflows
        inputs = {"input_ids": micro["input_ids"]}
        return causal_lm(forward(params, inputs), micro["labels"], num_items) * micro["factor"][0], {}

    scaling = LossScaling(init_scale=1.0)
    model, opt = lm(), adamw(1e-3)
    step = make_step(model, optimizer=opt, objective=objective, loss_scaling=scaling)
    start = state = init_state(model, opt, extras={SCALER: initial_scaler(scaling)})
    losses = []
    for i, (micro,) in enumerate(batches(4)):
        new = step(state, [{**micro, "factor": torch.full((4,), float("inf") if i == 1 else 1.0)}])
        if i == 1:
            assert all(torch.equal(new.params[k], state.params[k]) for k in state.params)
        losses.append(new.metrics["loss"].item())
        state = new
    assert not torch.isfinite(torch.tensor(losses[1])) and int(state.nonfinite_losses) == 1
    finite = [x for x in losses if math.isfinite(x)]
    assert log_entry(state, LogMark())["loss"] == pytest.approx(sum(finite) / 3, rel=1e-6)
    assert train_summary(state, start, 1.0)["train_loss"] == pytest.approx(sum(finite) / 3, rel=1e-6)
