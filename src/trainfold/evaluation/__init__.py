"""Evaluation: reducers (transducers over batches), evaluate/predict (one process or sharded), schedules."""

from trainfold.evaluation.evaluation import evaluate_batches, predict_batches
from trainfold.evaluation.gather import gather_rows
from trainfold.evaluation.metrics import (
    EvalPrediction,
    PredictionOutput,
    check_metrics,
    eval_sets,
    final_metrics,
    prefix_metrics,
    throughput,
    to_numpy,
)
from trainfold.evaluation.pipeline import resolve_forward
from trainfold.evaluation.schedule import check_eval_schedule, should_evaluate
from trainfold.evaluation.spec import EvalSpec

__all__ = [
    "EvalPrediction",
    "EvalSpec",
    "PredictionOutput",
    "check_eval_schedule",
    "check_metrics",
    "eval_sets",
    "evaluate_batches",
    "final_metrics",
    "gather_rows",
    "predict_batches",
    "prefix_metrics",
    "resolve_forward",
    "should_evaluate",
    "throughput",
    "to_numpy",
]
