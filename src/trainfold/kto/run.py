"""The KTO run: TRL 1.16 ``KTOTrainer``'s data preparation and reference, then ``trainfold.train``.

>>> import tempfile, torch
>>> from trainfold.core.models import TinyLM, TinyLMConfig
>>> _ = torch.manual_seed(0)
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
>>> rows = [{"prompt_ids": [1, 2], "completion_ids": [3 + i % 3], "label": i % 2 == 0} for i in range(4)]
>>> args = KTOArguments(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2, bf16=False,
...                     gradient_checkpointing=False, report_to="none", disable_tqdm=True, save_strategy="no")
>>> result = train(model, args, rows)
>>> result.global_step, round(result.log_history[0]["loss"], 6)  # the reference is the model before training: 1 - σ(0)
(2, 0.5)
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from trainfold.kto.args import KTOArguments
from trainfold.kto.collate import unpaired_collate
from trainfold.kto.objective import kto_objective
from trainfold.kto.rows import unpaired_rows
from trainfold.trainer.model_source import processing_class_for
from trainfold.trainer.trl_runs import TRLInputs, TRLPrepared, TRLRun, policy_model, reference_params

__all__ = ["kto_reference_objective", "prepare_kto", "prepare_unpaired_dataset", "train", "unpaired_collator"]


def prepare_unpaired_dataset(dataset: Any, processing_class: Any, args: KTOArguments) -> Any:
    """Return ``dataset``'s rows prepared as ``KTOTrainer`` prepares them (``trainfold.kto.rows``); the KL
    completions rotate within blocks of ``per_device_train_batch_size`` rows, for the eval set too (as TRL)."""
    if dataset is None:
        return None
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"trainfold.kto.train needs a map-style dataset (a list or a datasets.Dataset), got "
            f"{type(dataset).__name__}: a streamed dataset is not supported; load it (datasets.load_dataset without "
            "streaming) or materialise it with list(...)"
        )
    kl = None if args.loss_type == "apo_zero_unpaired" else args.per_device_train_batch_size
    rows = (dataset[i] for i in range(len(dataset)))
    return unpaired_rows(rows, processing_class, args.max_length, kl)


def kto_reference_objective(model: nn.Module, args: KTOArguments, ref_model: nn.Module | None = None) -> Any:
    """Return the KTO objective of ``args``, its reference ``ref_model`` or ``model`` as it is now (copied)."""
    return kto_objective(
        args.beta,
        args.loss_type,
        reference_params(model, ref_model, precomputed=args.precompute_ref_log_probs),
        desirable_weight=args.desirable_weight,
        undesirable_weight=args.undesirable_weight,
        precompute_ref_log_probs=args.precompute_ref_log_probs,
        precompute_ref_batch_size=args.precompute_ref_batch_size,
    )


def unpaired_collator(args: KTOArguments, tok: Any) -> Any:
    """Return the run's collator: unpaired rows padded with the tokenizer's pad (else eos) token, as TRL pads."""
    pad = (tok.pad_token or tok.eos_token) if tok is not None else None
    pad_id = 0 if pad is None else int(tok.convert_tokens_to_ids(pad))
    return unpaired_collate(pad_id, args.max_length, args.pad_to_multiple_of)


def prepare_kto(given: TRLInputs) -> TRLPrepared:
    """Return what a KTO run trains, as ``KTOTrainer(...).train()`` does: the policy (``policy_model``: loaded by name,
    wrapped by PEFT, dropout off), the rows prepared (an eval dict each), the collator and the objective.

    The reference is ``ref_model`` when given, else the model as it is before training (TRL reloads it from its
    path; this needs none); ``precompute_ref_log_probs`` scores the datasets with it once.
    """
    args = cast(KTOArguments, given.args)
    model = policy_model(given.model, args, given.peft_config)
    objective = given.objective or kto_reference_objective(model, args, given.own.get("ref_model"))  # a facade's
    tok = processing_class_for(model, given.processing_class)
    train_rows = prepare_unpaired_dataset(given.train_dataset, tok, args)
    if isinstance(given.eval_dataset, dict):
        eval_rows: Any = {k: prepare_unpaired_dataset(v, tok, args) for k, v in given.eval_dataset.items()}
    else:
        eval_rows = prepare_unpaired_dataset(given.eval_dataset, tok, args)
    run = dict(objective=objective, processing_class=tok)  # checkpoints hold the tokenizer
    return TRLPrepared(model, args, train_rows, eval_rows, unpaired_collator(args, tok), run)


train = TRLRun(KTOArguments, "kto", prepare_kto, own=("ref_model",))
"""Train a model with KTO on unpaired (or paired) rows as ``KTOTrainer(...).train()`` does (:func:`prepare_kto`),
``ref_model`` the reference (None: the model before training); return the run's record."""
