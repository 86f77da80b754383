"""The reward-model run: TRL 1.16 ``RewardTrainer``'s model, data and Bradley–Terry loss, then ``trainfold.train``.

>>> import tempfile, torch, transformers
>>> config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
...                                   num_attention_heads=2, num_labels=1, pad_token_id=0)
>>> _ = torch.manual_seed(0)
>>> model = transformers.LlamaForSequenceClassification(config)
>>> rows = [{"chosen_ids": [1, 2, 3], "rejected_ids": [4, 5]}] * 4
>>> args = RewardArguments(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2, bf16=False,
...                        gradient_checkpointing=False, report_to="none", disable_tqdm=True, save_strategy="no",
...                        logging_steps=1)
>>> result = train(model, args, rows)
>>> result.global_step, round(result.log_history[0]["loss"], 4), sorted(result.log_history[0])[:3]
(2, 0.7321, ['accuracy', 'epoch', 'grad_norm'])
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from trainfold.reward.args import RewardArguments
from trainfold.reward.data import reward_collate, reward_rows
from trainfold.reward.loss import reward_objective
from trainfold.trainer.model_source import processing_class_for, without_dropout
from trainfold.trainer.trl_runs import PreparedStream, TRLInputs, TRLPrepared, TRLRun

__all__ = ["prepare_reward_dataset", "prepare_reward", "reward_model", "pad_id_for", "train"]


def reward_model(model: nn.Module | str, args: RewardArguments, peft_config: Any = None) -> nn.Module:
    """Return the model a reward run trains, as ``RewardTrainer`` builds it: a name or path loaded with
    ``AutoModelForSequenceClassification`` and ``num_labels=1`` (its head drawn from ``args.seed``), a module
    checked to have one label; wrapped by ``peft_config``; its dropout off with ``disable_dropout``."""
    labels = getattr(getattr(model, "config", None), "num_labels", 1)
    if not isinstance(model, str) and labels != 1:
        raise ValueError(
            f"the model has num_labels={labels}, but a reward model outputs one score per sequence: build it "
            "with num_labels=1, or pass its name or path to have it loaded so"
        )
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
        torch.manual_seed(args.seed)  # TRL's set_seed(args.seed) before loading: the new head, the adapter
        built: Any = model
        if isinstance(model, str):
            from transformers import AutoModelForSequenceClassification

            kwargs = {**(args.model_init_kwargs or {}), "num_labels": 1}
            built = AutoModelForSequenceClassification.from_pretrained(model, **kwargs)
        elif args.model_init_kwargs:
            raise ValueError("model_init_kwargs apply when the model is a name or path; drop them for a built module")
        if peft_config is not None:
            from peft import get_peft_model

            built = get_peft_model(built, peft_config)
    return without_dropout(built) if args.disable_dropout else built  # TRL's default: off


def pad_id_for(model: Any, tokenizer: Any, args: RewardArguments) -> int:
    """Return the pad id, as TRL picks it (``pad_token``, the tokenizer's, its EOS), and make it the model's:
    a sequence-classification model scores the last token that is not padding (TRL sets it the same way)."""
    if tokenizer is None:
        return int(getattr(model.config, "pad_token_id", None) or 0)
    token = args.pad_token or tokenizer.pad_token or tokenizer.eos_token
    if token not in tokenizer.get_vocab():
        raise ValueError(f"pad_token {token!r} is not in the tokenizer's vocabulary; set pad_token to one that is")
    pad_id = int(tokenizer.convert_tokens_to_ids(token))
    config = getattr(model, "config", None)
    if config is not None:
        config.pad_token_id = pad_id
    return pad_id


def prepare_reward_dataset(dataset: Any, tokenizer: Any, args: RewardArguments) -> Any:
    """Return ``dataset``'s preference rows tokenized and filtered as ``RewardTrainer`` does
    (``trainfold.reward.data``); a dataset without a length (streaming) is prepared as it is read."""
    if dataset is None:
        return None
    if not hasattr(dataset, "__len__"):
        return PreparedStream(dataset, lambda rows: reward_rows(rows, tokenizer, args.max_length, args.eos_token))
    rows = (dataset[i] for i in range(len(dataset))) if hasattr(dataset, "__getitem__") else dataset
    return reward_rows(rows, tokenizer, args.max_length, args.eos_token)


def prepare_reward(given: TRLInputs) -> TRLPrepared:
    """Return what a reward run trains, as TRL's ``RewardTrainer(...).train()`` does: the model
    (:func:`reward_model`), the rows tokenized and filtered, ``data_collator`` (else the reward collator) and the
    Bradley–Terry objective. The model's ``config.pad_token_id`` is set to the pad id (as TRL does)."""
    args = cast(RewardArguments, given.args)
    model = reward_model(given.model, args, given.peft_config)
    tok = processing_class_for(model, given.processing_class)
    collate = given.own.get("data_collator") or reward_collate(pad_id_for(model, tok, args), args.pad_to_multiple_of)
    train_rows = prepare_reward_dataset(given.train_dataset, tok, args)
    eval_rows = prepare_reward_dataset(given.eval_dataset, tok, args)
    objective = given.objective or reward_objective(args.center_rewards_coefficient)
    run = dict(objective=objective, processing_class=tok)  # checkpoints hold the tokenizer
    return TRLPrepared(model, args, train_rows, eval_rows, collate, run)


train = TRLRun(RewardArguments, "reward", prepare_reward, own=("data_collator",))
"""Train a reward model on preference rows as TRL's ``RewardTrainer(...).train()`` does (:func:`prepare_reward`);
return the run's record."""
