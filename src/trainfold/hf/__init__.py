"""The HF-compatible surface: TrainingArguments, train/evaluate/predict, TrainerCallbacks, GRPO runs."""
