"""Events go to the ``trainfold`` logger (children per module), from the main process; warnings stay for misuse."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from trainfold import TrainingArguments, train
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.observe.logging import LOGGER_NAME, logger, set_verbosity

ROWS = [{"input_ids": [i, i + 1, i + 2, i + 3], "labels": [i, i + 1, i + 2, i + 3]} for i in range(8)]


def model():
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))


def args(tmp_path, **changes):
    settings = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to="none")
    settings |= dict(disable_tqdm=True, save_strategy="steps", save_steps=1)
    return TrainingArguments(**{**settings, **changes})


@pytest.fixture
def restored_level():
    level = logger.level
    yield
    logger.setLevel(level)


def events(caplog) -> list[tuple[str, str]]:
    return [(r.name, r.getMessage()) for r in caplog.records if r.name.startswith(LOGGER_NAME)]


def test_a_run_logs_its_start_saves_and_end_as_info_events_without_warnings(tmp_path, caplog, restored_level):
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME), warnings.catch_warnings():
        warnings.simplefilter("error")  # a normal run warns about nothing
        train(model(), args(tmp_path), ROWS)
    got = events(caplog)
    assert ("trainfold.trainer.train", f"training 2 optimizer steps into {tmp_path}") in got
    assert [m for n, m in got if n == "trainfold.trainer.run"] == [
        f"saving checkpoint {tmp_path / f'checkpoint-{k}'}" for k in (1, 2)
    ]
    assert got[-1] == ("trainfold.trainer.train", f"training completed at step 2 ({tmp_path})")
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name.startswith(LOGGER_NAME))


def test_a_resume_logs_where_it_resumes(tmp_path, caplog, restored_level):
    train(model(), args(tmp_path, max_steps=1), ROWS)
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME), pytest.warns(UserWarning, match="max_steps 1 -> 2"):
        train(model(), args(tmp_path, max_steps=2), ROWS, resume_from_checkpoint=True)  # misuse: still a warning
    assert ("trainfold.trainer.train", f"resuming from {tmp_path / 'checkpoint-1'} at step 1 of 2") in events(caplog)


def test_log_level_sets_the_trainfold_logger_and_replicas_log_warnings_only(caplog, restored_level):
    child = logging.getLogger("trainfold.ckpt.writer")
    with caplog.at_level(logging.DEBUG):
        assert set_verbosity("debug") == logging.DEBUG
        child.debug("main")
        assert set_verbosity("debug", main_process=False) == logging.WARNING
        child.info("replica info")
        child.warning("replica warning")
    assert [r.getMessage() for r in caplog.records] == ["main", "replica warning"]


def test_an_unknown_log_level_names_the_choices():
    with pytest.raises(ValueError, match=r"log_level='loud' is not one of \['debug', 'info', "):
        set_verbosity("loud")
