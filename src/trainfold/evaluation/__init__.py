"""Evaluation: reducers (transducers over batches), evaluate/predict (one process or sharded), schedules."""

from trainfold.evaluation.evaluation import (
    EvalPrediction,
    EvalSpec,
    PredictionOutput,
    check_metrics,
    eval_sets,
    evaluate_batches,
    evaluate_with,
    final_metrics,
    predict_batches,
    predict_with,
    prefix_metrics,
    resolve_forward,
    throughput,
    to_numpy,
)
from trainfold.evaluation.gather import gather_rows
from trainfold.evaluation.schedule import check_eval_schedule, should_evaluate

__all__ = [
    "EvalPrediction",
    "EvalSpec",
    "PredictionOutput",
    "check_eval_schedule",
    "check_metrics",
    "eval_sets",
    "evaluate_batches",
    "evaluate_with",
    "final_metrics",
    "gather_rows",
    "predict_batches",
    "predict_with",
    "prefix_metrics",
    "resolve_forward",
    "should_evaluate",
    "throughput",
    "to_numpy",
]
