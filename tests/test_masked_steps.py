"""Steps whose labels are all -100: every drawn step counts, fully masked data is refused up front.

(The step-level rule — step and cursor advance, params and optimizer state unchanged, the step
counted in ``nonfinite_losses`` — is tested in test_step.py, test_compiled.py and test_ensemble.py.)
"""

from __future__ import annotations

import warnings

import pytest
import torch

from trainfold import TrainingArguments, train
from trainfold.core.models import TinyLM, TinyLMConfig


def lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))


def rows(n: int, masked: set[int] = frozenset()) -> list[dict]:
    out = []
    for i in range(n):
        ids = [(i + j) % 16 for j in range(5)]
        out.append({"input_ids": ids, "labels": [-100] * 5 if i in masked else list(ids)})
    return out


def settings(tmp_path, **over) -> TrainingArguments:
    base = dict(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        train_sampling_strategy="sequential",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
    )
    return TrainingArguments(**{**base, **over})


def at_most(calls: int):
    """A stop predicate that fails the test if the run is still going after ``calls`` checks (no hang)."""
    seen = []

    def stop(state) -> bool:
        seen.append(int(state.step))
        assert len(seen) <= calls, f"the run did not end: steps seen {seen[-5:]}"
        return False

    return stop


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items * 50)


def test_fully_masked_map_style_data_is_refused_before_training(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"every one of the 6 rows of train_dataset has no 'labels' that causal_lm "
        r"counts \(all -100, or only the first token",
    ):
        train(lm(), settings(tmp_path, max_steps=3), rows(6, masked=set(range(6))), stop=at_most(10))


def test_fully_masked_streamed_data_ends_at_max_steps_with_a_warning(tmp_path):
    with pytest.warns(RuntimeWarning, match="had no labels other than -100.*the step counts") as caught:
        result = train(lm(), settings(tmp_path, max_steps=3), Stream(rows(4, masked=set(range(4)))), stop=at_most(10))
    assert result.status == "completed" and result.global_step == 3
    assert int(result.state.nonfinite_losses) == 3
    assert sum("no labels other than -100" in str(w.message) for w in caught) == 3
    before = lm().state_dict()
    assert all(torch.equal(result.state.params[k], before[k]) for k in result.state.params)


def test_a_masked_batch_does_not_evaluate_or_save_a_step_twice(tmp_path):
    data = rows(10, masked={2, 3})  # the second step's batch (sequential, 2 rows a step) is fully masked
    args = settings(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = train(lm(), args, data, eval_dataset=rows(2), stop=at_most(20))
    evals = [h["step"] for h in result.log_history if "eval_loss" in h]
    logged = [h["step"] for h in result.log_history if "loss" in h and "train_loss" not in h]
    assert evals == [1, 2, 3, 4] and logged == [1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (1, 2, 3, 4)]
    assert int(result.state.nonfinite_losses) == 1 and result.global_step == 4
