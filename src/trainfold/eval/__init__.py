"""Evaluation: reducers (transducers over batches), evaluate/predict, schedules."""
