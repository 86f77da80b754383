"""``trl_dpo.py`` moved to trainfold: 8 lines changed, and what has no counterpart deleted.

``diff trl_dpo.py trainfold_dpo.py`` shows them (the docstring aside): the model is loaded here (to save
it after the run), ``DPOTrainer(...)`` + ``train()`` is ``trainfold.dpo.train``, the config converts with
``DPOArguments.from_hf``. Deleted: the DDP buffer hack (DDP needs none here), the hub push
(``from_hf`` refuses ``push_to_hub=True`` by name) and ``trainer.end()``. Both run as::

    python trl_dpo.py --model_name_or_path MODEL_DIR --dataset_name DATA_DIR --output_dir out --max_steps 20

where ``MODEL_DIR`` holds a causal LM and its tokenizer and ``DATA_DIR`` preference rows
(``prompt``/``chosen``/``rejected``) that ``datasets.load_dataset`` reads.
"""

import argparse


def main(script_args, training_args, model_args, dataset_args):
    import transformers
    from accelerate.logging import get_logger
    from datasets import load_dataset
    from trl import get_dataset, get_peft_config

    import trainfold

    logger = get_logger(__name__)

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    # the data: a mixture of datasets, or one by name
    if dataset_args.datasets and script_args.dataset_name:
        logger.warning("both datasets and dataset_name are given: the mixture in datasets is used")
        dataset = get_dataset(dataset_args)
    elif dataset_args.datasets and not script_args.dataset_name:
        dataset = get_dataset(dataset_args)
    elif not dataset_args.datasets and script_args.dataset_name:
        dataset = load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        raise ValueError("give datasets or dataset_name")

    model = transformers.AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **model_init_kwargs)
    trainfold.dpo.train(
        model=model,
        args=trainfold.dpo.DPOArguments.from_hf(training_args),
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        resume_from_checkpoint=training_args.resume_from_checkpoint,
        peft_config=get_peft_config(model_args),
    )

    trainfold.save_model(model, training_args.output_dir)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None):
    from trl import DatasetMixtureConfig, DPOConfig, ModelConfig, ScriptArguments, TrlParser

    dataclass_types = (ScriptArguments, DPOConfig, ModelConfig, DatasetMixtureConfig)
    if subparsers is not None:
        parser = subparsers.add_parser("dpo", help="Run the DPO training script", dataclass_types=dataclass_types)
    else:
        parser = TrlParser(dataclass_types, prog=prog)
    return parser


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    main(script_args, training_args, model_args, dataset_args)
