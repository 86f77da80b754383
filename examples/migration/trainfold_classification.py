"""``hf_classification.py`` moved to trainfold: 8 lines changed (the ones marked ``# trainfold``, and the call).

``diff hf_classification.py trainfold_classification.py`` shows them (the docstring aside). Both run as::

    python hf_classification.py --model_name_or_path MODEL_DIR --output_dir out --max_steps 20

where ``MODEL_DIR`` holds a ``...ForSequenceClassification`` model and its tokenizer
(``tests/test_migrate.py`` makes a tiny one). The data is a toy task built in the script: is the
first word of a sentence among the first half of the vocabulary?
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    HfArgumentParser,
    TrainingArguments,
    set_seed,
)

import trainfold  # trainfold


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a local directory or a Hub name"})
    num_samples: int = field(default=64, metadata={"help": "sentences in the toy training set"})


def sentences(tokenizer, count, seed):
    """Return tokenized rows of the toy task: label 1 when the first word is in the lower half of the vocabulary."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w not in tokenizer.all_special_tokens]
    words.sort(key=tokenizer.convert_tokens_to_ids)
    rows = []
    for _ in range(count):
        chosen = [rng.choice(words) for _ in range(rng.randint(2, 8))]
        label = int(words.index(chosen[0]) < len(words) // 2)
        rows.append({**tokenizer(" ".join(chosen)), "label": label})
    return rows


def main(argv=None):
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    script_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(script_args.model_name_or_path)
    train_dataset = sentences(tokenizer, script_args.num_samples, seed=0)

    args = trainfold.TrainingArguments.from_hf(training_args)  # trainfold
    ckpt = training_args.resume_from_checkpoint  # trainfold
    train_result = trainfold.train(model, args, train_dataset, processing_class=tokenizer, resume_from_checkpoint=ckpt)
    train_result.exit_if_preempted()  # trainfold: a preempted run exits 143, so the scheduler requeues it
    trainfold.save_model(model, training_args.output_dir, tokenizer)  # trainfold
    metrics = train_result.metrics
    trainfold.log_metrics("train", metrics)  # trainfold
    trainfold.save_metrics("train", metrics, training_args.output_dir)  # trainfold
    return metrics


if __name__ == "__main__":
    main()
