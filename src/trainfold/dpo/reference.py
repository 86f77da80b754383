"""DPO's reference log-probs computed once, before training, and cached beside the run.

:func:`precompute_ref_logps` scores a list of preference items with the reference (one pass, eval
mode, no grad, in item order) and returns copies carrying ``ref_chosen_logps`` and
``ref_rejected_logps``. :func:`prepare_reference` is what ``dpo_objective(precompute_ref_log_probs=True)``
does inside ``train``: it scores the train set and every eval set, stores the values in
``output_dir/ref_logps/{set}-{fingerprint}.safetensors`` and returns the datasets with the two
columns added and an objective that runs no reference forward. The fingerprint
(:func:`reference_fingerprint`) hashes what fixes the numbers: the preference columns of the
dataset (their contents, not an object id), the reference's parameters and buffers, the model
type, the collator's settings and the log-prob path; a resumed run (or a second run on the same
data and reference) finds the file and computes nothing. A file whose fingerprint or length does
not match is recomputed and replaced, never trusted. Files are written to a temporary name and
renamed, so a crash never leaves half a file under the real name.

>>> import torch
>>> from trainfold.dpo.objective import preference_collate
>>> from trainfold.core.models import TinyLM, TinyLMConfig
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
>>> items = [{"prompt_ids": [1], "chosen_ids": [4], "rejected_ids": [5]}]
>>> out = precompute_ref_logps(model, dict(model.named_parameters()), items, preference_collate(2))
>>> sorted(out[0]), "ref_chosen_logps" in items[0]
(['chosen_ids', 'prompt_ids', 'ref_chosen_logps', 'ref_rejected_logps', 'rejected_ids'], False)
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from trainfold.core.chunked_loss import OutputHead
from trainfold.core.logps import check_sized, completion_logps, score_with_reference
from trainfold.data.lengths import PREFERENCE_COLUMNS
from trainfold.dpo.logps import MODEL_KEYS, REF_KEYS, halves

__all__ = [
    "CACHE_DIR",
    "precompute_ref_logps",
    "prepare_reference",
    "reference_fingerprint",
    "reference_logps",
    "with_reference",
]

CACHE_DIR = "ref_logps"  # under output_dir


def reference_logps(
    model: nn.Module,
    ref_params: Mapping[str, Tensor],
    dataset: Any,
    collate: Callable[[list[Any]], Mapping[str, Tensor]],
    *,
    batch_size: int = 16,
    buffers: Mapping[str, Tensor] | None = None,
    head: OutputHead | None = None,
    chunk_size: int = 0,
) -> tuple[Tensor, Tensor]:
    """Return the reference's summed completion log-probs of every pair of ``dataset``: ``(chosen, rejected)``, float32.

    Each batch is scored as ``trainfold.core.logps.score_with_reference`` gives it, with the same log-prob code as the
    objective (``head``/``chunk_size``).
    """

    def score(forward: Callable[..., Any], params: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Any:
        inputs = {k: batch[k] for k in MODEL_KEYS if k in batch}
        return halves(completion_logps(forward, params, inputs, batch, head, chunk_size)[0])

    chosen, rejected = score_with_reference(
        model, ref_params, dataset, collate, score, columns=2, batch_size=batch_size, buffers=buffers, drop=REF_KEYS
    )
    return chosen, rejected


def precompute_ref_logps(
    model: nn.Module,
    ref_params: Mapping[str, Tensor],
    items: Sequence[Mapping[str, Any]],
    collate: Callable[[list[Any]], Mapping[str, Tensor]],
    batch_size: int = 16,
    buffers: Mapping[str, Tensor] | None = None,
) -> list[dict[str, Any]]:
    """Return copies of ``items`` with ``ref_chosen_logps``/``ref_rejected_logps`` (floats) added (see module doc)."""
    chosen, rejected = reference_logps(model, ref_params, items, collate, batch_size=batch_size, buffers=buffers)
    return with_reference(list(items), chosen, rejected)


@attrs.frozen(eq=False)
class _WithReference:
    """A map-style dataset whose items carry the reference log-probs (for datasets that are neither lists nor arrow)."""

    dataset: Any
    chosen: Tensor
    rejected: Tensor

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            **dict(self.dataset[index]),
            REF_KEYS[0]: float(self.chosen[index]),
            REF_KEYS[1]: float(self.rejected[index]),
        }


def with_reference(dataset: Any, chosen: Tensor, rejected: Tensor) -> Any:
    """Return ``dataset`` with the columns ``ref_chosen_logps`` and ``ref_rejected_logps`` (exact float32 values).

    A list gives a list of new dicts, a ``datasets.Dataset`` a dataset with the two columns (its
    arrow columns stay, so length grouping reads them fast), anything else a wrapper. Nothing
    passed in is changed.

    >>> import torch
    >>> with_reference([{"prompt_ids": [1]}], torch.tensor([-1.5]), torch.tensor([-2.0]))
    [{'prompt_ids': [1], 'ref_chosen_logps': -1.5, 'ref_rejected_logps': -2.0}]
    """
    if len(chosen) != len(dataset) or len(rejected) != len(dataset):
        raise ValueError(f"{len(chosen)} and {len(rejected)} reference log-probs for a dataset of {len(dataset)} pairs")
    if isinstance(dataset, (list, tuple)):
        return [
            {**dict(it), REF_KEYS[0]: c, REF_KEYS[1]: r}
            for it, c, r in zip(dataset, chosen.tolist(), rejected.tolist())
        ]
    if hasattr(dataset, "add_column") and hasattr(dataset, "column_names"):
        present = [k for k in REF_KEYS if k in dataset.column_names]
        out = dataset.remove_columns(present) if present else dataset
        return out.add_column(REF_KEYS[0], chosen.tolist()).add_column(REF_KEYS[1], rejected.tolist())
    return _WithReference(dataset, chosen, rejected)


def _column_digest(dataset: Any, h: Any) -> None:
    """Hash the preference columns of ``dataset``: per column its row lengths, then its values (the same bytes through
    arrow for a ``datasets.Dataset`` as item by item for anything else)."""
    with_format = getattr(dataset, "with_format", None)
    if with_format is not None and all(k in getattr(dataset, "column_names", ()) for k in PREFERENCE_COLUMNS):
        import pyarrow.compute as pc

        table = with_format("arrow")[:]
        columns = {
            k: (pc.list_value_length(table[k]).to_numpy(), pc.list_flatten(table[k]).to_numpy())
            for k in PREFERENCE_COLUMNS
        }
    else:
        rows = [dataset[i] for i in range(len(dataset))]
        lists = {
            k: [r[k].tolist() if isinstance(r[k], Tensor) else list(r[k]) for r in rows] for k in PREFERENCE_COLUMNS
        }
        columns = {k: ([len(v) for v in vs], [x for v in vs for x in v]) for k, vs in lists.items()}
    for k, (lengths, values) in columns.items():
        h.update(k.encode())
        h.update(np.asarray(lengths, dtype=np.int64).tobytes())
        h.update(np.asarray(values, dtype=np.int64).tobytes())


def _tensor_digest(tensors: Mapping[str, Tensor], h: Any) -> None:
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def reference_fingerprint(
    dataset: Any, model: nn.Module, ref_params: Mapping[str, Tensor], collate: Any, chunk_size: int = 0
) -> str:
    """Return the hex digest that keys a cache of reference log-probs (see the module doc).

    >>> import torch
    >>> from trainfold.dpo.objective import preference_collate
    >>> lin = torch.nn.Linear(1, 1)
    >>> rows = [{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}]
    >>> a = reference_fingerprint(rows, lin, dict(lin.named_parameters()), preference_collate(2))
    >>> a == reference_fingerprint([dict(rows[0])], lin, dict(lin.named_parameters()), preference_collate(2))
    True
    >>> a == reference_fingerprint(rows, lin, dict(lin.named_parameters()), preference_collate(3))
    False
    """
    h = hashlib.sha256()
    settings = repr(collate) if attrs.has(type(collate)) else type(collate).__qualname__
    h.update(f"{type(model).__qualname__}|{settings}|chunk={chunk_size}|{len(dataset)}".encode())
    _column_digest(dataset, h)
    _tensor_digest(ref_params, h)
    _tensor_digest({k: v for k, v in model.named_buffers() if k not in ref_params}, h)
    return h.hexdigest()


def _load(path: Path, fingerprint: str, rows: int) -> tuple[Tensor, Tensor] | None:
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except Exception:  # unreadable: recompute and replace it
        return None
    if meta.get("fingerprint") != fingerprint or any(tensors.get(k, torch.zeros(0)).shape != (rows,) for k in REF_KEYS):
        return None
    return tensors[REF_KEYS[0]], tensors[REF_KEYS[1]]


def _store(path: Path, fingerprint: str, chosen: Tensor, rejected: Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    save_file(
        {REF_KEYS[0]: chosen.contiguous(), REF_KEYS[1]: rejected.contiguous()},
        str(tmp),
        metadata={"fingerprint": fingerprint, "rows": str(len(chosen))},
    )
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _refuse_other_reference(cache_dir: Path, name: str, path: Path) -> None:
    """With ``ref_params=None`` the reference is the model as passed: after a run (or in a resume
    that passes the trained module) that is not the model before training, so scoring it again
    silently would train against the wrong reference."""
    others = sorted(p.name for p in cache_dir.glob(f"{name}-*.safetensors") if p != path)
    if others:
        raise ValueError(
            f"precompute_ref_log_probs=True with ref_params=None: {cache_dir} holds reference log-probs {others} "
            f"of another reference model or dataset, and the model passed now would become the reference (after "
            f"training, or when resuming with the trained module, it is not the model before training). Pass "
            f"ref_params=<the reference weights> to dpo_objective, or delete {cache_dir} to score this model as "
            f"the reference"
        )


def _cached(
    name: str,
    dataset: Any,
    model: nn.Module,
    ref_params: Mapping[str, Tensor],
    collate: Any,
    cache_dir: Path,
    batch_size: int,
    buffers: Mapping[str, Tensor],
    head: OutputHead | None,
    chunk_size: int,
    model_is_reference: bool = False,
) -> Any:
    check_sized(dataset)
    fingerprint = reference_fingerprint(dataset, model, ref_params, collate, chunk_size)
    path = cache_dir / f"{name}-{fingerprint[:20]}.safetensors"
    found = _load(path, fingerprint, len(dataset))
    if found is None and model_is_reference:
        _refuse_other_reference(cache_dir, name, path)
    if found is None:
        found = reference_logps(
            model,
            ref_params,
            dataset,
            collate,
            batch_size=batch_size,
            buffers=buffers,
            head=head,
            chunk_size=chunk_size,
        )
        _store(path, fingerprint, *found)
    return with_reference(dataset, *found)


def prepare_reference(
    objective: Any,
    model: nn.Module,
    train_dataset: Any,
    eval_dataset: Any,
    collate: Callable[[list[Any]], Any] | None,
    *,
    output_dir: str | os.PathLike,
    device: torch.device,
    train_batch_size: int,
    eval_batch_size: int,
) -> tuple[Any, Any, Any]:
    """Return ``(objective, train_dataset, eval_dataset)`` with the reference log-probs stored in the datasets.

    The reference is ``objective.ref_params``, or with none the model's own parameters as they are
    now (before training: TRL's ``ref_model=None``). ``eval_dataset`` may be one set or a dict of
    them; each is scored and cached under its own name. The returned objective holds no reference
    params, so training runs no reference forward and keeps no second copy of the weights.
    """
    if collate is None:
        raise ValueError(
            "precompute_ref_log_probs=True scores the pairs through the run's collator: pass "
            "data_collator=preference_collate(eos_token_id=...) to train"
        )
    ref = objective.ref_params
    model_is_reference = ref is None
    if ref is None:
        ref = {k: v.detach().to(device) for k, v in model.named_parameters()}
    ref = {k: v.to(device) for k, v in ref.items()}
    buffers = {k: v.to(device) for k, v in model.named_buffers()}
    size = objective.precompute_ref_batch_size
    options = dict(
        model=model,
        ref_params=ref,
        collate=collate,
        cache_dir=Path(output_dir) / CACHE_DIR,
        buffers=buffers,
        head=objective.head,
        chunk_size=objective.chunk_size,
        model_is_reference=model_is_reference,
    )
    train_dataset = _cached("train", train_dataset, batch_size=size or train_batch_size, **options)
    if isinstance(eval_dataset, Mapping):
        eval_dataset = {
            name: _cached(f"eval_{name}", ds, batch_size=size or eval_batch_size, **options)
            for name, ds in eval_dataset.items()
        }
    elif eval_dataset is not None:
        eval_dataset = _cached("eval", eval_dataset, batch_size=size or eval_batch_size, **options)
    return attrs.evolve(objective, ref_params=None, precompute_ref_log_probs=False), train_dataset, eval_dataset
