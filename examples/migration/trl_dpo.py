"""The shape of TRL 1.16's example DPO script (``trl/scripts/dpo.py``), reduced to what it runs offline.

``trainfold_dpo.py`` is the same script moved to trainfold; ``tests/test_migrate.py`` counts the lines
that changed and checks that both give the same per-step losses. Both run as::

    python trl_dpo.py --model_name_or_path MODEL_DIR --dataset_name DATA_DIR --output_dir out --max_steps 20

where ``MODEL_DIR`` holds a causal LM and its tokenizer and ``DATA_DIR`` preference rows
(``prompt``/``chosen``/``rejected``) that ``datasets.load_dataset`` reads.
"""

import argparse


def main(script_args, training_args, model_args, dataset_args):
    import transformers
    from accelerate.logging import get_logger
    from datasets import load_dataset
    from packaging.version import Version
    from trl import DPOTrainer, get_dataset, get_peft_config, get_quantization_config

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

    trainer = DPOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )

    if script_args.ignore_bias_buffers:
        import torch

        # DDP: leave the boolean buffers out of the broadcast
        trainer.model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
        ]

    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("training completed")

    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"model saved to {training_args.output_dir}")

    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)

    if Version(transformers.__version__) >= Version("5.18.0"):  # trackers and the process group
        trainer.end()


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
