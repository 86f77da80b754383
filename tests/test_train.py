"""``train``: bitwise resume in a fresh process, logging across resume, the command line, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tolerance import reordered

from trainfold import TrainingArguments, train
from trainfold import ckpt as checkpoint
from trainfold.core.tree import flatten
from trainfold.observe.history import HISTORY_FILE, LogHistory

ROOT = Path(__file__).resolve().parents[1]

from resume_fixture import collate, endless_cli_config, model, rows  # noqa: E402 - tests/ is on sys.path under pytest


def settings(tmp: Path, strategy: str, **over) -> TrainingArguments:
    base = dict(
        output_dir=str(tmp),
        max_steps=8,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        warmup_steps=2,
        weight_decay=0.1,
        max_grad_norm=1.0,
        seed=11,
        train_sampling_strategy=strategy,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    return TrainingArguments(**{**base, **over})


def losses_of(history):
    return [(h["step"], h["loss"]) for h in history if "loss" in h and "train_loss" not in h]


# 22 rows, global batch 4 -> 6 steps per epoch (the last one short): k=3 is mid-epoch, k=6 an epoch boundary.
CASES = [(s, k) for s in ("random", "group_by_length", "batch_rebalance") for k in (3, 6)]


def test_resume_in_a_fresh_process_is_bitwise(tmp_path):
    straight = {}
    for strategy in ("random", "group_by_length", "batch_rebalance"):
        r = train(model(), settings(tmp_path / f"straight-{strategy}", strategy), rows(), data_collator=collate)
        straight[strategy] = r
    for strategy, k in CASES:  # first part: stop at k with a checkpoint there
        out = tmp_path / f"{strategy}-{k}"
        r = train(
            model(),
            settings(out, strategy, save_strategy="steps", save_steps=k),
            rows(),
            data_collator=collate,
            stop=lambda s, k=k: int(s.step) >= k,
        )
        assert r.status == "stopped" and r.global_step == k
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from resume_fixture import collate, model, rows
        from trainfold import TrainingArguments, train
        for strategy, k in {CASES!r}:
            out = {str(tmp_path)!r} + f"/{{strategy}}-{{k}}"
            args = TrainingArguments(
                output_dir=out, max_steps=8, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                learning_rate=1e-2, warmup_steps=2, weight_decay=0.1, max_grad_norm=1.0, seed=11,
                train_sampling_strategy=strategy, logging_steps=1, save_strategy="steps", save_steps=100,
                report_to="none", disable_tqdm=True)
            r = train(model(), args, rows(), data_collator=collate, resume_from_checkpoint=True)
            assert r.global_step == 8, r.global_step
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=300)
    for strategy, k in CASES:
        out = tmp_path / f"{strategy}-{k}"
        ref = straight[strategy]
        like = ref.state
        resumed = checkpoint.load(out / "checkpoint-8", like=like)
        a, b = flatten(ref.state), flatten(resumed)
        for key in a:
            if key.startswith("extras.") or key == "metrics.num_items":
                continue
            assert torch.equal(a[key], b[key]), f"{strategy} k={k}: {key}"
        at = checkpoint.read_metadata(out / "checkpoint-8")["metadata"]["log"]  # where the history file stood
        history = LogHistory(out / HISTORY_FILE, at["offset"], at["entries"])
        assert losses_of(history) == losses_of(ref.log_history), f"{strategy} k={k}"


def test_logged_loss_is_the_window_mean_across_a_resume(tmp_path):
    per_step = losses_of(train(model(), settings(tmp_path / "a", "random"), rows(), data_collator=collate).log_history)
    step_loss = dict(per_step)
    out = tmp_path / "b"
    train(
        model(),
        settings(out, "random", logging_steps=3, save_strategy="steps", save_steps=4),
        rows(),
        data_collator=collate,
        stop=lambda s: int(s.step) >= 4,
    )  # checkpoint mid-window (window 4..6)
    r = train(
        model(), settings(out, "random", logging_steps=3), rows(), data_collator=collate, resume_from_checkpoint=True
    )
    logged = losses_of(r.log_history)
    assert [s for s, _ in logged] == [3, 6, 8]
    for s, value in logged:
        window = range(s - 2, s + 1) if s != 8 else range(7, 9)
        assert value == pytest.approx(sum(step_loss[i] for i in window) / len(window), rel=1e-6)


def test_an_objectives_metrics_are_logged_as_window_means(tmp_path):
    from trainfold.core.losses import causal_lm

    def objective(forward, params, micro, num_items, key):  # aux: the summed loss of the micro-batch, x2
        inputs = {k: v for k, v in micro.items() if k != "labels"}
        loss = causal_lm(forward(params, inputs), micro["labels"], num_items)
        return loss, {"double": 2 * loss.detach()}

    objective.aux_reduction = "sum"  # its aux are divided by num_items, as its loss: summed over micro-batches

    def metric(history):
        return [(h["step"], h["double"]) for h in history if "double" in h]

    per_step = dict(
        metric(
            train(
                model(), settings(tmp_path / "a", "random"), rows(), data_collator=collate, objective=objective
            ).log_history
        )
    )
    losses = dict(
        losses_of(train(model(), settings(tmp_path / "b", "random"), rows(), data_collator=collate).log_history)
    )
    assert sorted(per_step) == list(range(1, 9))
    for s, value in per_step.items():
        assert value == pytest.approx(2 * losses[s], rel=1e-6)
    history = train(
        model(),
        settings(tmp_path / "c", "random", logging_steps=3),
        rows(),
        data_collator=collate,
        objective=objective,
    ).log_history
    windows = metric(h for h in history if "loss" in h)
    assert [s for s, _ in windows] == [3, 6, 8]
    for s, value in windows:
        window = range(s - 2, s + 1) if s != 8 else range(7, 9)
        assert value == pytest.approx(sum(per_step[i] for i in window) / len(window), rel=1e-6)
    # the last window, logged only because the run ended, is in the end-of-training entry too (as TRL's)
    assert "train_loss" in history[-1] and history[-1]["double"] == windows[-1][1]


def test_a_named_schedule_with_its_kwargs_drives_the_learning_rate(tmp_path):
    from trainfold.optim.schedules import named

    args = settings(
        tmp_path, "random", lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}
    )
    logged = [
        h["learning_rate"]
        for h in train(model(), args, rows(), data_collator=collate).log_history
        if "learning_rate" in h
    ]
    expected = named("cosine_with_min_lr", 1e-2, 2, 8, min_lr_rate=0.1)
    assert logged == pytest.approx([expected(k) for k in range(8)], rel=1e-12)
    assert logged[-1] > 1e-3  # held above the floor, where plain cosine would near 0


def test_a_compiled_run_follows_the_eager_one(tmp_path):
    import warnings

    from trainfold.step.compiled import CompileFallbackWarning

    assert TrainingArguments(torch_compile_backend="aot_eager").compile == "aot_eager"  # the backend turns it on
    assert TrainingArguments(torch_compile_mode="default").compile is True
    with pytest.raises(ValueError, match=r"torch_compile_mode='fast' is not one of \[None, 'default'"):
        TrainingArguments(torch_compile_mode="fast")
    eager = losses_of(train(model(), settings(tmp_path / "eager", "random"), rows(), data_collator=collate).log_history)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        compiled = train(
            model(),
            settings(tmp_path / "compiled", "random", torch_compile_backend="aot_eager"),
            rows(),
            data_collator=collate,
        )
    assert compiled.status == "completed"
    assert [s for s, _ in losses_of(compiled.log_history)] == [s for s, _ in eager]
    # Warmup gives step 1 a learning rate of 0 (params unchanged, bitwise), so steps 1 and 2 take their losses at the
    # same params on both runs: the same token losses (positive) summed in other orders (aot_eager decomposes ops),
    # within reordered(tokens of a step, loss), a step holding at most 4 rows of the longest length. Later steps
    # follow chained AdamW steps, whose one-step difference test_compiled.py bounds from the same state.
    assert [h["learning_rate"] for h in compiled.log_history if "loss" in h][0] == 0.0
    terms = 4 * max(len(r["input_ids"]) for r in rows())
    for (_, got), (_, want) in zip(losses_of(compiled.log_history)[:2], eager[:2]):
        assert got == pytest.approx(want, abs=reordered(terms, want), rel=0)


def test_input_tokens_seen_are_counted_logged_and_resumed(tmp_path):
    from trainfold.observe import TOKENS_SEEN

    data = rows()
    one_epoch = {"max_steps": -1, "num_train_epochs": 1, "logging_steps": 2}
    real = train(
        model(),
        settings(tmp_path / "real", "sequential", include_num_input_tokens_seen="non_padding", **one_epoch),
        data,
        data_collator=collate,
    )
    assert int(real.state.extras[TOKENS_SEEN]) == sum(len(r["input_ids"]) for r in data)  # every row once
    everything = train(
        model(),
        settings(tmp_path / "all", "sequential", include_num_input_tokens_seen=True, **one_epoch),
        data,
        data_collator=collate,
    )
    micro_batches = [data[i : i + 2] for i in range(0, len(data), 2)]
    padded = sum(len(mb) * max(len(r["input_ids"]) for r in mb) for mb in micro_batches)
    assert int(everything.state.extras[TOKENS_SEEN]) == padded  # each micro-batch padded to its longest row
    logged = [h[TOKENS_SEEN] for h in real.log_history if TOKENS_SEEN in h]
    assert logged == sorted(logged) and logged[-1] == int(real.state.extras[TOKENS_SEEN])

    out = tmp_path / "resumed"
    counting = {"include_num_input_tokens_seen": "non_padding", "logging_steps": 1}
    straight = train(model(), settings(tmp_path / "straight", "random", **counting), data, data_collator=collate)
    train(
        model(),
        settings(out, "random", save_strategy="steps", save_steps=3, **counting),
        data,
        data_collator=collate,
        stop=lambda st: int(st.step) >= 3,
    )
    resumed = train(
        model(), settings(out, "random", **counting), data, data_collator=collate, resume_from_checkpoint=True
    )
    assert int(resumed.state.extras[TOKENS_SEEN]) == int(straight.state.extras[TOKENS_SEEN])
    assert [h[TOKENS_SEEN] for h in resumed.log_history if TOKENS_SEEN in h] == [
        h[TOKENS_SEEN] for h in straight.log_history if TOKENS_SEEN in h
    ]


def test_preempted_cli_run_exits_143_and_resumes(tmp_path):
    config = endless_cli_config(tmp_path, tmp_path / "out")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainfold.cli", "train", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = tmp_path / "out" / "log.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    latest = checkpoint.latest_checkpoint(tmp_path / "out")
    assert latest is not None and checkpoint.is_complete(latest)
    meta = checkpoint.read_metadata(latest)
    assert meta["step"] >= 3


def test_bad_input_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="eval_on_start"):
        train(model(), settings(tmp_path, "random", eval_on_start=True, eval_strategy="steps", eval_steps=2), rows())
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        train(model(), settings(tmp_path / "empty", "random"), rows(), resume_from_checkpoint=True)


def test_weights_only_checkpoint_cannot_resume_silently(tmp_path):
    out = tmp_path / "w"
    train(
        model(),
        settings(out, "random", save_strategy="steps", save_steps=4, save_only_model=True),
        rows(),
        data_collator=collate,
        stop=lambda s: int(s.step) >= 4,
    )
    with pytest.raises(ValueError, match="model.safetensors|weights only|save_only_model"):
        train(
            model(),
            settings(out, "random", save_only_model=True),
            rows(),
            data_collator=collate,
            resume_from_checkpoint=True,
        )
    with pytest.warns(UserWarning):
        r = train(
            model(),
            settings(out, "random", save_only_model=True),
            rows(),
            data_collator=collate,
            resume_from_checkpoint=True,
            weights_only_warm_start=True,
        )
    assert r.global_step == 8


def test_changed_accumulation_on_resume_keeps_the_checkpoints_global_batch(tmp_path):
    # the elastic rule (issue 44 item 7): whenever the command's split makes another global batch than the
    # checkpoint's, the checkpoint's is kept, said in a warning; the run goes on as the one that never stopped
    out = tmp_path / "ga"
    first = settings(out, "random", save_strategy="steps", save_steps=2)
    train(model(), first, rows(), stop=lambda s: int(s.step) >= 2)
    with pytest.warns(UserWarning, match="gradient_accumulation_steps 1 -> 2 keep its global batch"):
        resumed = train(model(), first.replace(gradient_accumulation_steps=1), rows(), resume_from_checkpoint=True)
    whole = train(model(), settings(tmp_path / "whole", "random", save_strategy="no"), rows())
    assert resumed.global_step == whole.global_step
    assert all(torch.equal(resumed.state.params[k], whole.state.params[k]) for k in whole.state.params)


def test_hf_datasets_and_unused_columns(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(rows())
    r = train(model(), settings(tmp_path, "group_by_length", max_steps=3), ds)
    assert r.global_step == 3 and r.status == "completed"


def test_early_stopping_ends_the_run(tmp_path):
    from trainfold.observe.stopping import early_stopping

    ev = rows(8)
    r = train(
        model(),
        settings(
            tmp_path, "random", max_steps=40, eval_strategy="steps", eval_steps=1, learning_rate=0.0, warmup_steps=0
        ),
        rows(),
        ev,
        early_stopping=early_stopping("loss", patience=2, threshold=0.0, greater_is_better=False),
    )
    assert r.status == "stopped"
    assert r.global_step == 3  # lr 0: evals 1, 2, 3 never improve on the first -> stop after 2 without improvement


def test_apply_to_copies_trained_tensors_into_a_module(tmp_path):
    r = train(model(), settings(tmp_path, "random", max_steps=2), rows())
    target = model()
    r.apply_to(target)
    for name, p in target.named_parameters():
        assert torch.equal(p.detach(), r.state.params[name])


def test_reporter_files_exist(tmp_path):
    r = train(model(), settings(tmp_path, "random", max_steps=2, report_to=["jsonl"]), rows())
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines if "loss" in e and "train_loss" not in e] == [1, 2]
    assert r.metrics["train_loss"] > 0
    assert os.path.basename(str(tmp_path))


# -- the module given to train ends with the trained weights (issue 15, item 8) --------------------


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=40, n_positions=24, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    net = transformers.GPT2LMHeadModel(config)
    net.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter
    return transformers, net


def _assert_module_holds(net, state):
    weights = {**state.buffers, **state.params}
    for name, t in [*net.named_parameters(), *net.named_buffers()]:
        assert torch.equal(t.detach(), weights[name].to(t.device)), name


def test_train_writes_the_final_weights_into_the_module_and_save_pretrained_keeps_them(tmp_path):
    transformers, net = _tiny_gpt2()
    assert net.lm_head.weight is net.transformer.wte.weight  # tied
    before = {k: v.clone() for k, v in net.state_dict().items()}
    data = [{k: v for k, v in r.items() if k != "note"} for r in rows()]
    from trainfold.data import pad_collate

    # GPT-2 has no pad id: ragged rows need a collator that pads (the default one refuses, as HF's)
    r = train(net, settings(tmp_path / "run", "random", max_steps=3), data, data_collator=pad_collate())
    _assert_module_holds(net, r.state)
    assert net.lm_head.weight is net.transformer.wte.weight  # still tied, to the trained tensor
    assert not torch.equal(net.state_dict()["transformer.wte.weight"], before["transformer.wte.weight"])
    assert torch.equal(net.state_dict()["transformer.wpe.weight"], before["transformer.wpe.weight"])  # frozen
    net.save_pretrained(tmp_path / "saved")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    for k, v in again.state_dict().items():
        assert torch.equal(v, net.state_dict()[k]), k
    assert torch.equal(again.transformer.wte.weight, r.state.params["transformer.wte.weight"])


def test_with_load_best_model_at_end_the_module_holds_the_best_weights(tmp_path):
    net = model()
    # greater_is_better=True on the loss: the best evaluation is the first one (the loss falls)
    args = settings(
        tmp_path,
        "random",
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,
        warmup_steps=0,
    )
    r = train(net, args, rows(), rows(6), data_collator=collate)
    assert r.best_checkpoint is not None and r.best_checkpoint.name == "checkpoint-1" and r.global_step == 4
    best = checkpoint.load_weights(r.best_checkpoint, like=r.state)
    _assert_module_holds(net, best)
    last = checkpoint.load(tmp_path / "checkpoint-4", like=r.state)
    assert not torch.equal(net.tok.weight, last.params["tok.weight"])


def test_a_stopped_run_leaves_its_last_state_in_the_module_and_make_step_stays_pure(tmp_path):
    from trainfold.core.fold import fit, max_steps
    from trainfold.core.losses import causal_lm
    from trainfold.core.state import init_state
    from trainfold.data import stream
    from trainfold.data.samplers import make_sampler
    from trainfold.optim import sgd
    from trainfold.step import make_step

    net = model()
    r = train(
        net, settings(tmp_path, "random", max_steps=8), rows(), data_collator=collate, stop=lambda s: int(s.step) >= 2
    )
    assert r.status == "stopped" and r.global_step == 2
    _assert_module_holds(net, r.state)
    net, opt = model(), sgd(0.1)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    data = [{k: v for k, v in row.items() if k != "note"} for row in rows()]
    sampler = make_sampler("random", data, per_device_train_batch_size=2)
    fit(make_step(net, causal_lm, opt), init_state(net, opt), stream(data, sampler, collate), stop=max_steps(2))
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())  # the functional parts never write
