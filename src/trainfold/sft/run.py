"""SFT in one place (``trainfold.sft``): TRL 1.16 ``SFTTrainer``'s data preparation, then ``trainfold.train``.

:func:`train` prepares the datasets as ``SFTTrainer`` does (``trainfold.sft.data``: formats, EOS,
``completion_only_loss``, ``assistant_only_loss``, truncation), then trains with the causal-LM token-mean
loss; ``packing`` and ``padding_free`` are ``TrainingArguments``' (``trainfold.data.llm``). The model may
be a module or a name/path (loaded with ``model_init_kwargs``); ``peft_config`` wraps it with PEFT.

>>> import tempfile, torch
>>> from trainfold.core.models import TinyLM, TinyLMConfig
>>> _ = torch.manual_seed(0)
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
>>> rows = [{"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]}] * 4
>>> args = SFTArguments(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2, bf16=False,
...                     gradient_checkpointing=False, report_to="none", disable_tqdm=True, save_strategy="no")
>>> train(model, args, rows).global_step
2
"""

from __future__ import annotations

import functools
from typing import Any, cast

from trainfold.data.hfstream import as_source
from trainfold.data.llm import DEFAULT_MAX_LENGTH
from trainfold.data.mixture import is_stream_source
from trainfold.data.packing import pack
from trainfold.sft.args import SFTArguments
from trainfold.sft.data import sft_collate, sft_loss, sft_rows
from trainfold.trainer.model_source import model_from, processing_class_for
from trainfold.trainer.trl_runs import PreparedStream, TRLInputs, TRLPrepared, TRLRun


def _shuffled(rows: list, seed: int) -> Any:
    from datasets import Dataset  # TRL shuffles with datasets' seeded permutation

    return Dataset.from_list(rows).shuffle(seed=seed)


def _formatted(rows: Any, formatting_func: Any) -> Any:
    """``rows`` with TRL's ``formatting_func(row)`` as their ``text`` (rows of token ids as they are)."""
    return (row if "input_ids" in row else {**row, "text": formatting_func(row)} for row in rows)


def _first_row(dataset: Any) -> Any:
    """Return the dataset's first row (TRL reads ``next(iter(dataset))``), or ``None`` for a one-pass iterator."""
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return dataset[0] if len(dataset) else None
    if iter(dataset) is dataset:  # a generator: reading its first row would lose it
        return None
    return next(iter(dataset), None)


def _formatting_problem(row: Any, completion_only_loss: bool | None) -> str | None:
    """Why ``formatting_func`` cannot make these rows' text, as TRL decides it from the first row."""
    if row is None or "input_ids" in row or not ("prompt" in row and "completion" in row):
        return None
    if completion_only_loss is None or completion_only_loss:  # TRL: None is on for prompt-completion rows
        return (
            "formatting_func turns the rows into text, which has no completion to train on alone "
            "(TRL refuses it: 'A formatting function was provided while `completion_only_loss=True`, which is "
            "incompatible'); apply your formatting function before passing the dataset, or set "
            "completion_only_loss=False with rows that have no prompt and completion columns"
        )
    return (  # TRL tokenizes the prompt and completion and drops the formatted text without a word
        "formatting_func would be ignored: rows with prompt and completion columns are tokenized from those, "
        "not from the formatted text (TRL drops it silently); remove the prompt and completion columns "
        "(rename them), or drop formatting_func"
    )


def _skipped_problems(datasets: dict[str, Any], data_collator: Any) -> list[str]:
    """TRL's refusal of rows with mask columns and no labels when ``skip_prepare_dataset`` skips label building."""
    trl_collator = type(data_collator).__name__ == "DataCollatorForLanguageModeling"
    if data_collator is not None and not trl_collator:
        return []  # a collator of the user's own reads the masks itself
    out = []
    for name, dataset in datasets.items():
        if dataset is None:
            continue
        columns = getattr(dataset, "column_names", None) or list(_first_row(dataset) or ())
        if "labels" not in columns and ("completion_mask" in columns or "assistant_masks" in columns):
            masks = [c for c in ("completion_mask", "assistant_masks") if c in columns]
            out.append(
                f"the {name} dataset has mask columns {masks} but no 'labels', and "
                "dataset_kwargs={'skip_prepare_dataset': True} skips label building, so it would train on the "
                "full sequence (TRL refuses it); add a 'labels' column (-100 for non-loss tokens) or drop "
                "skip_prepare_dataset"
            )
    return out


def prepare_dataset(
    dataset: Any, processing_class: Any, args: SFTArguments, packing: bool, formatting_func: Any = None
) -> Any:
    """Return ``dataset`` prepared as ``SFTTrainer._prepare_dataset`` does (packing only cuts, in ``train``); a
    dataset without a length (streaming) is prepared as it is read, in its order, as TRL reads it.
    ``formatting_func(row) -> str`` makes each row's text, as TRL's; with prompt-completion rows it is refused."""
    if dataset is None or (args.dataset_kwargs or {}).get("skip_prepare_dataset"):
        return dataset
    problem = None if formatting_func is None else _formatting_problem(_first_row(dataset), args.completion_only_loss)
    if problem is not None:
        raise ValueError(problem)
    if formatting_func is not None and args.completion_only_loss:
        raise ValueError(
            "formatting_func turns the rows into text, which has no completion to train on alone "
            "(as TRL refuses it): format the rows into prompt and completion yourself, or set completion_only_loss=None"
        )
    prepare = functools.partial(
        sft_rows,
        tokenizer=processing_class,
        max_length=args.max_length,
        truncation_mode=args.truncation_mode,
        packing=packing,
        dataset_text_field=args.dataset_text_field,
        completion_only_loss=args.completion_only_loss,
        assistant_only_loss=args.assistant_only_loss,
        eos_token=args.eos_token,
    )
    if formatting_func is not None:
        prepare = functools.partial(lambda base, rows: base(_formatted(rows, formatting_func)), prepare)
    dataset = as_source(dataset)  # a datasets stream of local files: read by files(), so a resume seeks
    if is_stream_source(dataset):  # trainfold.data.files / mix: each row prepared at its position (dropped: none)
        return dataset.map(functools.partial(_prepared_row, prepare)).filter(_is_row)
    if not hasattr(dataset, "__len__"):
        return PreparedStream(dataset, prepare)
    rows = prepare((dataset[i] for i in range(len(dataset))) if hasattr(dataset, "__getitem__") else dataset)
    return _shuffled(rows, args.seed) if args.shuffle_dataset else rows


def _prepared_row(prepare: Any, row: Any) -> Any:
    prepared = prepare([row])
    return prepared[0] if prepared else None  # a row left without labels is dropped, as TRL drops it


def _is_row(row: Any) -> bool:
    return row is not None


def _pad_id(processing_class: Any, args: SFTArguments) -> int:
    if processing_class is None:
        return 0
    token = args.pad_token or processing_class.pad_token or processing_class.eos_token
    return int(processing_class.convert_tokens_to_ids(token))


def prepare_eval_dataset(dataset: Any, processing_class: Any, args: SFTArguments, formatting_func: Any = None) -> Any:
    """Return an eval ``dataset`` prepared as ``SFTTrainer`` prepares it (packed with ``eval_packing``)."""
    eval_packing = args.packing if args.eval_packing is None else args.eval_packing
    rows = prepare_dataset(dataset, processing_class, args, eval_packing, formatting_func)
    if rows is not None and eval_packing:
        rows = pack(iter(rows), args.max_length or DEFAULT_MAX_LENGTH, truncate=args.packing_strategy == "bfd")
    return rows


def default_collator(processing_class: Any, args: SFTArguments, data_collator: Any = None) -> Any:
    """Return ``data_collator``, or TRL's padding collator where rows are neither packed nor padding-free."""
    if data_collator is None and not (args.packing or args.padding_free):
        return sft_collate(_pad_id(processing_class, args), args.pad_to_multiple_of)
    return data_collator


def prepare_sft(given: TRLInputs) -> TRLPrepared:
    """Return what an SFT run trains, as TRL's ``SFTTrainer(...).train()`` does: the model (loaded by name with
    ``model_init_kwargs``, wrapped by PEFT), the rows prepared (``formatting_func`` makes their text), the
    collator (``data_collator``, else TRL's padding one) and SFT's loss unless an ``objective`` is given."""
    args = cast(SFTArguments, given.args)
    data_collator, formatting_func = given.own.get("data_collator"), given.own.get("formatting_func")
    if (args.dataset_kwargs or {}).get("skip_prepare_dataset"):
        problems = _skipped_problems({"train": given.train_dataset, "eval": given.eval_dataset}, data_collator)
        if problems:
            raise ValueError("cannot train on these rows as given:\n  - " + "\n  - ".join(problems))
    model = model_from(given.model, args.model_init_kwargs, given.peft_config, seed=args.seed)
    tok = processing_class_for(model, given.processing_class)
    train_rows = prepare_dataset(given.train_dataset, tok, args, args.packing, formatting_func)
    eval_rows = prepare_eval_dataset(given.eval_dataset, tok, args, formatting_func)
    run: dict[str, Any] = {"processing_class": tok}  # checkpoints hold the tokenizer, as the Trainer's
    if given.objective is not None:
        run["objective"] = given.objective
    elif not args.loss_chunk_size:  # SFT's loss, whatever wraps the model (PEFT)
        run["compute_loss_func"] = sft_loss  # causal_lm, logging TRL's entropy and mean_token_accuracy
    return TRLPrepared(model, args, train_rows, eval_rows, default_collator(tok, args, data_collator), run)


train = TRLRun(SFTArguments, "sft", prepare_sft, own=("data_collator", "formatting_func"))
"""Fine-tune a model on rows as TRL's ``SFTTrainer(...).train()`` does (:func:`prepare_sft`); return the run's
record. ``data_collator`` and ``formatting_func`` are TRL's."""
