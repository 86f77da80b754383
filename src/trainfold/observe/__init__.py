"""Logging, reporters, the metric history, early stopping and divergence checks."""

from trainfold.observe.entries import (
    LOG_MARK,
    LogMark,
    MetricWindow,
    eval_entry,
    filtered_mean_loss,
    log_entry,
    log_mark,
    mark_logged,
    train_summary,
)
from trainfold.observe.log_plan import LOGGING_STRATEGIES, LoggingPlan, logging_plan, should_log
from trainfold.observe.observers import Observer, initial_extras, log_if_due, notify, observing, tap
from trainfold.observe.progress import LOG_LEVELS
from trainfold.observe.reporters import REPORTERS
from trainfold.observe.tokens import TOKEN_COUNTS, TOKENS_SEEN, counting_input_tokens

__all__ = [
    "LOG_MARK",
    "TOKENS_SEEN",
    "LoggingPlan",
    "LogMark",
    "MetricWindow",
    "logging_plan",
    "should_log",
    "log_mark",
    "log_entry",
    "filtered_mean_loss",
    "mark_logged",
    "eval_entry",
    "train_summary",
    "initial_extras",
    "Observer",
    "notify",
    "log_if_due",
    "observing",
    "tap",
    "counting_input_tokens",
    "LOGGING_STRATEGIES",
    "LOG_LEVELS",
    "REPORTERS",
    "TOKEN_COUNTS",
]
