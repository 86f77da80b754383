"""The ``trainfold`` logger: training, checkpoint and resume events, on the main process by default.

Every module logs to ``logging.getLogger(__name__)``, a child of ``"trainfold"`` (``trainfold.trainer.train``,
``trainfold.ckpt.run_dir``, ...), so one line configures them all, as for any library::

    import logging
    logging.basicConfig(level=logging.INFO)            # every event, from every library
    logging.getLogger("trainfold").setLevel("DEBUG")   # or only trainfold's, finer

trainfold adds no handler (the application owns the output): until one is configured, Python prints
``WARNING`` and above to stderr and drops the rest. Events go to the logger:
a run starting or resuming, a checkpoint written, a damaged checkpoint skipped on resume, a run ending or
diverging. ``warnings.warn`` is kept for misuse of the API, something the caller should change (a setting
ignored, a sampler that cannot apply). ``train`` calls ``set_verbosity`` as the HF Trainer does with its
``log_level``: on the main process (rank 0) ``log_level`` (``passive`` keeps the level you set), on the
other ranks ``warning``, so a ``torchrun`` job logs each event once.
"""

from __future__ import annotations

import logging

__all__ = ["LOGGER_NAME", "VERBOSITY", "logger", "set_verbosity"]

LOGGER_NAME = "trainfold"
logger = logging.getLogger(LOGGER_NAME)

# HF's log_level names -> logging levels; passive: keep the level the application set
VERBOSITY: dict[str, int | None] = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
VERBOSITY |= {"error": logging.ERROR, "critical": logging.CRITICAL, "passive": None}


def set_verbosity(log_level: str = "passive", *, main_process: bool = True, log_level_replica: str = "warning") -> int:
    """Set the ``trainfold`` logger's level as the HF Trainer sets its own; return the effective level.

    The main process takes ``log_level``, every other rank ``log_level_replica`` (HF's defaults: ``passive``,
    which keeps the current level, and ``warning``). The level stays, as the Trainer's does.

    >>> previous = logger.level
    >>> set_verbosity("info") == logging.INFO, set_verbosity("info", main_process=False) == logging.WARNING
    (True, True)
    >>> set_verbosity("passive") == logging.WARNING  # kept
    True
    >>> logger.setLevel(previous)
    """
    chosen = log_level if main_process else log_level_replica
    if chosen not in VERBOSITY:
        raise ValueError(f"log_level={chosen!r} is not one of {list(VERBOSITY)}")
    level = VERBOSITY[chosen]
    if level is not None:
        logger.setLevel(level)
    return logger.getEffectiveLevel()
