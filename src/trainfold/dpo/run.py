"""The DPO run: TRL 1.16 ``DPOTrainer``'s data preparation and reference, then ``trainfold.train``.

>>> import tempfile, torch
>>> from trainfold.core.models import TinyLM, TinyLMConfig
>>> _ = torch.manual_seed(0)
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
>>> rows = [{"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5]}] * 4
>>> args = DPOArguments(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2, bf16=False,
...                     gradient_checkpointing=False, report_to="none", disable_tqdm=True, save_strategy="no")
>>> result = train(model, args, rows)
>>> result.global_step, round(result.log_history[0]["loss"], 4)  # the reference is the model before training
(2, 0.6931)
"""

from __future__ import annotations

import functools
from typing import Any, cast

from torch import nn

from trainfold.data.hfstream import as_source
from trainfold.data.mixture import is_stream_source
from trainfold.data.packing import check_packable
from trainfold.dpo.args import DPOArguments
from trainfold.dpo.data import padding_free_preference_collate, preference_rows
from trainfold.dpo.objective import dpo_objective, preference_collate
from trainfold.trainer.model_source import processing_class_for
from trainfold.trainer.trl_runs import PreparedStream, TRLInputs, TRLPrepared, TRLRun, policy_model, reference_params

__all__ = [
    "prepare_dpo",
    "prepare_preference_dataset",
    "preference_collator",
    "reference_objective",
    "train",
]


def prepare_preference_dataset(dataset: Any, processing_class: Any, args: DPOArguments) -> Any:
    """Return ``dataset``'s rows tokenized as ``DPOTrainer`` does (``trainfold.dpo.data``); a dataset
    without a length (streaming) is tokenized as it is read, in its order, as TRL reads it."""
    if dataset is None:
        return None
    dataset = as_source(dataset)  # a datasets stream of local files: read by files(), so a resume seeks
    if is_stream_source(dataset):  # trainfold.data.files / mix: each row tokenized at its position (dropped: none)
        prepare = functools.partial(_preference_row, processing_class, args.max_length)
        return dataset.map(prepare).filter(_is_row)
    if not hasattr(dataset, "__len__"):
        return PreparedStream(dataset, lambda rows: preference_rows(rows, processing_class, args.max_length))
    rows = (dataset[i] for i in range(len(dataset))) if hasattr(dataset, "__getitem__") else dataset
    return preference_rows(rows, processing_class, args.max_length)


def reference_objective(model: nn.Module, args: DPOArguments, ref_model: nn.Module | None = None) -> Any:
    """Return the DPO objective of ``args``, its reference ``ref_model`` or ``model`` as it is now (copied)."""
    return dpo_objective(
        args.beta,
        list(args.loss_type),
        args.label_smoothing,
        reference_params(model, ref_model, precomputed=args.precompute_ref_log_probs),
        loss_weights=args.loss_weights,
        discopop_tau=args.discopop_tau,
        precompute_ref_log_probs=args.precompute_ref_log_probs,
        precompute_ref_batch_size=args.precompute_ref_batch_size,
    )


def preference_collator(model: nn.Module, args: DPOArguments, tok: Any) -> tuple[Any, DPOArguments]:
    """Return the run's preference collator and its arguments (padding-free rows are the collator's, not the run's)."""
    pad = (args.pad_token or tok.pad_token or tok.eos_token) if tok else None
    if args.padding_free:  # the run's own flattened rows (TrainingArguments' padding_free is for LM rows)
        check_packable(model)
        return padding_free_preference_collate(None, args.max_length), args.replace(padding_free=False)
    pad_id = 0 if pad is None else int(tok.convert_tokens_to_ids(pad))
    return preference_collate(None, pad_id, args.max_length, args.pad_to_multiple_of), args


def _preference_row(processing_class: Any, max_length: int | None, row: Any) -> Any:
    rows = preference_rows([row], processing_class, max_length)
    return rows[0] if rows else None  # a prompt as long as max_length is dropped, as TRL drops it


def _is_row(row: Any) -> bool:
    return row is not None


def prepare_dpo(given: TRLInputs) -> TRLPrepared:
    """Return what a DPO run trains, as ``DPOTrainer(...).train()`` does: the policy (``policy_model``), the rows
    tokenized, the preference collator and the objective against the reference.

    The reference is ``ref_model`` when given, else the model as it is before training (TRL reloads it
    from its path; this needs none); ``precompute_ref_log_probs`` scores the datasets with it once.
    """
    args = cast(DPOArguments, given.args)
    model = policy_model(given.model, args, given.peft_config)
    objective = given.objective or reference_objective(model, args, given.own.get("ref_model"))  # a facade's own
    tok = processing_class_for(model, given.processing_class)
    collate, args = preference_collator(model, args, tok)
    train_rows = prepare_preference_dataset(given.train_dataset, tok, args)
    eval_rows = prepare_preference_dataset(given.eval_dataset, tok, args)
    run = dict(objective=objective, processing_class=tok)  # checkpoints hold the tokenizer
    return TRLPrepared(model, args, train_rows, eval_rows, collate, run)


train = TRLRun(DPOArguments, "dpo", prepare_dpo, own=("ref_model",))
"""Train a model with DPO on preference rows as ``DPOTrainer(...).train()`` does (:func:`prepare_dpo`), ``ref_model``
the reference (None: the model before training); return the run's record."""


# ``trainfold.sft.prepare_dataset`` is SFT's (one meaning per public name)
