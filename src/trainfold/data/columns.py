"""Which dataset columns reach the model: HF's ``remove_unused_columns``, ``label_names`` and the length column.

:func:`columns_for` reads the model's ``forward`` signature once, as HF's
``Trainer._set_signature_columns_if_needed`` does, and returns a :class:`Columns` record that
:func:`with_columns` puts in front of a collator. With ``remove_unused_columns`` (the default) an
item keeps only the columns named in ``forward`` plus the label names plus ``label``/``label_ids``
— also for a ``forward(**kwargs)``, which every HF model has (the signature's named arguments
count, ``**kwargs`` does not), so a ``text`` column never reaches collation. The length column
(``length_column_name``) is for the sampler: it never reaches the model unless ``forward`` names
it, whatever ``remove_unused_columns`` says. With the default collator, ``label`` or ``label_ids``
becomes ``labels`` (HF's ``default_data_collator`` and ``DataCollatorWithPadding`` rename them).
A micro-batch that ends without its labels says which columns were dropped.

>>> import torch
>>> cols = columns_for(torch.nn.Linear(2, 1), label_names=("labels",))
>>> sorted(cols.keep)
['input', 'label', 'label_ids', 'labels']
>>> collate = with_columns(lambda items: items, cols)
>>> collate([{"input": 1, "label": 0, "text": "hi", "length": 3}])
[{'input': 1, 'labels': 0}]
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from torch import nn

from trainfold.data.collate import KeyedCollate, keyed, pad_collate

__all__ = ["Columns", "columns_for", "eval_collate", "padded_to_multiple", "signature_columns", "with_columns"]

HF_LABEL_COLUMNS = ("label", "label_ids")  # kept always; the default collators rename them to "labels"


def signature_columns(model: nn.Module) -> tuple[str, ...]:
    """Return the argument names of ``model.forward`` (PEFT models: the base model's), ``*args``/``**kwargs`` left out.

    >>> import torch
    >>> signature_columns(torch.nn.Linear(2, 1))
    ('input',)
    """
    base_model = getattr(model, "get_base_model", None)
    inspected = model if base_model is None else base_model()
    params = inspect.signature(inspected.forward).parameters.values()
    variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    return tuple(p.name for p in params if p.kind not in variadic)


@attrs.frozen
class Columns:
    """What happens to an item's columns before collation. Make one with :func:`columns_for`.

    ``keep``: the columns kept (``None``: all, i.e. ``remove_unused_columns=False``); ``drop``:
    columns dropped even then (the length column); ``label_key``: where the loss reads labels;
    ``rename_labels``: ``label``/``label_ids`` become ``labels`` (the default collator);
    ``labels_required``: a micro-batch without ``label_key`` is an error (training with a loss).

    >>> c = Columns(keep=frozenset({"x", "labels"}), drop=frozenset(), label_key="labels", model_name="M")
    >>> c.select({"x": 1, "y": 2, "labels": 3})
    {'x': 1, 'labels': 3}
    """

    keep: frozenset[str] | None
    drop: frozenset[str]
    label_key: str
    model_name: str
    rename_labels: bool = False
    labels_required: bool = False

    def select(self, item: Any) -> Any:
        """Return ``item`` with only the columns that reach the collator (non-mappings pass as they are)."""
        if not isinstance(item, Mapping):
            return item
        out = {k: v for k, v in item.items() if (self.keep is None or k in self.keep) and k not in self.drop}
        if self.rename_labels and self.label_key == "labels" and "labels" not in out:
            for name in HF_LABEL_COLUMNS:
                if name in out:
                    out["labels"] = out.pop(name)
                    break
        return out

    def dropped(self, item: Mapping[str, Any]) -> list[str]:
        """Return the columns of ``item`` that :meth:`select` leaves out."""
        return sorted(k for k in item if (self.keep is not None and k not in self.keep) or k in self.drop)

    def check(self, item: Any, selected: Any, batch: Any) -> None:
        """Raise when the first item lost every column, or the collated ``batch`` lacks the labels."""
        if not isinstance(item, Mapping):
            return
        if item and not selected:
            raise ValueError(
                f"no column of the dataset {sorted(item)} is an argument of {self.model_name}.forward "
                f"({sorted(self.keep or ())}), so remove_unused_columns dropped them all; rename the columns to the "
                "model's argument names, or set remove_unused_columns=False"
            )
        if not self.labels_required or not isinstance(batch, Mapping) or self.label_key in batch:
            return
        _refuse_text_labels(item, self.label_key)
        dropped = self.dropped(item)
        hint = [f"remove_unused_columns dropped {dropped} (not arguments of {self.model_name}.forward)"] * bool(dropped)
        present = [k for k in (*HF_LABEL_COLUMNS, "labels") if k in batch and k != self.label_key]
        if present:
            hint.append(f"the collated batch has {present}: set label_names=[{present[0]!r}] or rename the column")
        else:
            hint.append("name the label column with label_names=[...] (it is kept), or pass an objective")
        raise KeyError(f"micro-batch has no {self.label_key!r} key (keys: {sorted(batch)}); " + "; ".join(hint))


def _refuse_text_labels(item: Mapping[str, Any], label_key: str) -> None:
    """Refuse labels that are text (class names): no collator makes tensors of them, so they were dropped.

    >>> try:
    ...     _refuse_text_labels({"input_ids": [1], "label": "pos"}, "labels")
    ... except TypeError as err:
    ...     print(str(err).split(";")[0])
    the rows' 'label' holds text ('pos'), not class ids
    """
    for name in (label_key, *HF_LABEL_COLUMNS):
        value = item.get(name)
        first = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(first, str):
            raise TypeError(
                f"the rows' {name!r} holds text ({value!r:.40}), not class ids; map the names to ids, e.g. "
                "label2id = {name: i for i, name in enumerate(sorted(set(names)))} and dataset.map(lambda r: "
                f"{{{name!r}: label2id[r[{name!r}]]}}) (or dataset.class_encode_column({name!r}): a "
                "datasets.ClassLabel), and give the model num_labels=len(label2id), label2id and id2label"
            )


def columns_for(
    model: nn.Module,
    *,
    label_names: Sequence[str] = ("labels",),
    remove_unused_columns: bool = True,
    length_column_name: str | None = "length",
    default_collator: bool = True,
    labels_required: bool = False,
    reads: Sequence[str] = (),
) -> Columns:
    """Return the :class:`Columns` of training ``model`` with these HF settings.

    ``reads`` names columns an objective reads besides the model's inputs (DPO's ``prompt_ids``,
    ``chosen_ids``, ...: ``objective.columns``); they are kept too.

    ``default_collator``: the collator is trainfold's padding one, which (like HF's default
    collators) takes ``label``/``label_ids`` as ``labels``. ``labels_required``: the run trains
    with a loss on ``label_names[0]`` (not an objective), so a micro-batch without it is an error.

    >>> import torch
    >>> c = columns_for(torch.nn.Linear(2, 1), remove_unused_columns=False)
    >>> c.keep, sorted(c.drop), c.label_key
    (None, ['length'], 'labels')
    """
    names = tuple(label_names)
    if not names:
        raise ValueError("label_names must name at least one column, e.g. ['labels']")
    if len(names) > 1 and labels_required:
        raise ValueError(
            f"label_names={list(names)} names {len(names)} label columns, but a loss takes one labels tensor; "
            "pass an objective (it gets every column of the micro-batch), or name one label column"
        )
    forward = signature_columns(model)
    keep = frozenset(forward) | set(names) | set(HF_LABEL_COLUMNS) | set(reads) if remove_unused_columns else None
    drop = frozenset({length_column_name}) if length_column_name and length_column_name not in forward else frozenset()
    return Columns(
        keep=keep,
        drop=drop - set(names),
        label_key=names[0],
        model_name=type(model).__name__,
        rename_labels=default_collator,
        labels_required=labels_required,
    )


@attrs.frozen
class _Selecting:
    """A collator that passes each item through ``Columns.select`` first (HF's ``RemoveColumnsCollator``)."""

    collate: Callable[[list[Any]], Any]
    columns: Columns

    def __call__(self, items: list[Any]) -> Any:
        selected = [self.columns.select(item) for item in items]
        batch = self.collate(selected)
        if items:
            self.columns.check(items[0], selected[0], batch)
        return batch


@attrs.frozen
class _KeyedSelecting:
    """``_Selecting`` for a keyed collator ``fn(items, keys)``."""

    collate: Callable[[Sequence[Any], Sequence[int]], Any]
    columns: Columns

    def __call__(self, items: Sequence[Any], keys: Sequence[int]) -> Any:
        selected = [self.columns.select(item) for item in items]
        batch = self.collate(selected, keys)
        if items:
            self.columns.check(items[0], selected[0], batch)
        return batch


def with_columns(collate: Callable[..., Any] | None, columns: Columns) -> Callable[..., Any]:
    """Wrap ``collate`` (default: :func:`~trainfold.data.collate.pad_collate`) so it sees only the selected columns.

    A keyed collator stays keyed.

    >>> import torch
    >>> c = with_columns(None, columns_for(torch.nn.Linear(2, 1)))
    >>> c([{"input": [1.0, 2.0], "label": 1, "text": "a"}])["labels"].tolist()
    [1]
    """
    collate = collate or pad_collate()
    if isinstance(collate, KeyedCollate):
        return keyed(_KeyedSelecting(collate.fn, columns))
    return _Selecting(collate, columns)


def eval_collate(collate: Callable[..., Any] | None, columns: Columns) -> Callable[[list[Any]], Any]:
    """Return the evaluation collator: labels optional, and a keyed collator gets fixed keys (eval draws nothing).

    >>> import torch
    >>> c = eval_collate(None, columns_for(torch.nn.Linear(2, 1), labels_required=True))
    >>> sorted(c([{"input": [1.0, 2.0]}]))
    ['input']
    """
    wrapped = with_columns(collate, attrs.evolve(columns, labels_required=False))
    if isinstance(wrapped, KeyedCollate):
        return _FixedKeys(wrapped)
    return wrapped


@attrs.frozen
class _FixedKeys:
    collate: KeyedCollate

    def __call__(self, items: list[Any]) -> Any:
        return self.collate(items, [0] * len(items))


def padded_to_multiple(collate: Callable[..., Any] | None, pad_to_multiple_of: int | None) -> Callable[..., Any] | None:
    """Return ``collate`` padding each batch's width to a multiple of ``pad_to_multiple_of`` (TRL's config setting).

    ``None`` (the default collator) becomes ``pad_collate(pad_to_multiple_of=...)``; a collator
    with a ``pad_to_multiple_of`` field left unset (``pad_collate``, ``preference_collate``,
    ``packed_collate``) gets the value. A collator that sets another value, or has no such
    field, is an error: the setting would not apply.

    >>> from trainfold.dpo.objective import preference_collate
    >>> padded_to_multiple(preference_collate(2), 8).pad_to_multiple_of
    8
    >>> padded_to_multiple(None, None) is None
    True
    """
    if pad_to_multiple_of is None:
        return collate
    if collate is None:
        return pad_collate(pad_to_multiple_of=pad_to_multiple_of)
    cls = type(collate)
    if not (attrs.has(cls) and "pad_to_multiple_of" in attrs.fields_dict(cls)):
        raise TypeError(
            f"pad_to_multiple_of={pad_to_multiple_of} cannot apply to data_collator "
            f"{type(collate).__name__}, which has no pad_to_multiple_of field; pad inside the collator "
            "and leave TrainingArguments.pad_to_multiple_of=None"
        )
    padding: Any = collate  # an attrs collator with the field (checked above; type(collate) does not narrow it)
    current = padding.pad_to_multiple_of
    if current not in (None, pad_to_multiple_of):
        raise ValueError(
            f"TrainingArguments.pad_to_multiple_of={pad_to_multiple_of} but data_collator "
            f"{type(collate).__name__} pads to a multiple of {current}; set one of them"
        )
    return attrs.evolve(padding, pad_to_multiple_of=pad_to_multiple_of)
