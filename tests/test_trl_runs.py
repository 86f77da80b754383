"""The one shape of the TRL runs (``trainer.trl_runs.TRLRun``): what goes to the algorithm, what to ``train``."""

from __future__ import annotations

import pytest
import torch

import trainfold
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.data import pad_collate
from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.trl_runs import TRLInputs, TRLPrepared, TRLRun

ROWS = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}] * 4


def _args(tmp_path, **kw):
    return TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, bf16=False, report_to="none",
        disable_tqdm=True, save_strategy="no", **kw,
    )  # fmt: skip


def _recording_run(seen: list[TRLInputs]) -> TRLRun:
    def prepare(given: TRLInputs) -> TRLPrepared:
        seen.append(given)
        return TRLPrepared(given.model, given.args, ROWS, None, pad_collate(), {"processing_class": None})

    return TRLRun(TrainingArguments, "toy", prepare, own=("ref_model",))


def test_the_algorithms_keywords_go_to_prepare_and_the_rest_to_train(tmp_path):
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    seen: list[TRLInputs] = []
    steps = []
    result = _recording_run(seen)(
        model, _args(tmp_path), ROWS, ref_model="the reference", observers=[lambda state, entry: steps.append(entry)]
    )
    assert result.global_step == 1 and steps  # observers= reached trainfold.train
    (given,) = seen
    assert given.own == {"ref_model": "the reference"} and given.objective is None and given.peft_config is None


def test_only_the_shared_first_five_are_positional_and_other_arguments_are_refused_by_name(tmp_path):
    run = _recording_run([])
    with pytest.raises(TypeError, match="positional"):
        run(torch.nn.Linear(1, 1), _args(tmp_path), ROWS, None, None, "a PEFT config by position")
    with pytest.raises(TypeError, match=r"trainfold.toy.train takes TrainingArguments .* not dict"):
        run(torch.nn.Linear(1, 1), {"max_steps": 1}, ROWS)


@pytest.mark.parametrize("package", ["sft", "dpo", "kto", "reward"])
def test_each_trl_algorithm_runs_as_one_trl_run(package):
    run = getattr(trainfold, package).train
    assert isinstance(run, TRLRun) and run.package == package
