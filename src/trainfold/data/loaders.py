"""DataLoader settings as HF names them (checked in one place), and the eval set's DataLoader.

:func:`loader_errors` is the one check of ``dataloader_num_workers``, ``dataloader_persistent_workers``
and ``dataloader_prefetch_factor``; the training stream, :func:`eval_loader` and ``TrainingArguments``
all report its messages.

>>> loader_errors(0, True, None)
['dataloader_persistent_workers=True needs dataloader_num_workers > 0 (it keeps worker processes alive)']
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

__all__ = ["close_loader", "eval_loader", "ignore_sigterm", "loader_errors"]


def loader_errors(num_workers: int, persistent_workers: bool, prefetch_factor: int | None) -> list[str]:
    """Return every problem with the DataLoader worker settings (empty when they are valid).

    >>> loader_errors(2, True, 4)
    []
    >>> loader_errors(-1, False, 0)
    ['dataloader_num_workers=-1 must be an int >= 0', 'dataloader_prefetch_factor=0 must be a positive int or None']
    """
    errors = []
    if not isinstance(num_workers, int) or num_workers < 0:
        errors.append(f"dataloader_num_workers={num_workers!r} must be an int >= 0")
    elif num_workers == 0:
        if persistent_workers:
            errors.append(
                "dataloader_persistent_workers=True needs dataloader_num_workers > 0 (it keeps worker processes alive)"
            )
        if prefetch_factor is not None:
            errors.append(
                f"dataloader_prefetch_factor needs dataloader_num_workers > 0: dataloader_prefetch_factor="
                f"{prefetch_factor} needs worker processes to prefetch (set dataloader_num_workers, or leave it None)"
            )
    if prefetch_factor is not None and (not isinstance(prefetch_factor, int) or prefetch_factor <= 0):
        errors.append(f"dataloader_prefetch_factor={prefetch_factor!r} must be a positive int or None")
    return errors


def ignore_sigterm(worker_id: int) -> None:
    """Let a DataLoader worker survive SIGTERM, so the main process can finish the step and save."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _Iterated(torch.utils.data.IterableDataset):
    """An iterable that is not a torch dataset (a generator function's result, a custom reader), as one."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)


def close_loader(loader: Any) -> None:
    """Stop a DataLoader's persistent workers now.

    They would outlive the run that made the loader: its iterator sits in reference cycles, so nothing
    stops them before the interpreter exits, where ``multiprocessing`` waits for them forever.
    """
    iterator = getattr(loader, "_iterator", None)  # torch keeps a persistent-workers iterator here
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None


def eval_loader(
    dataset: Any,
    collate: Callable[[list[Any]], Any],
    batch_size: int,
    *,
    dataloader_drop_last: bool = False,
    dataloader_num_workers: int = 0,
    dataloader_persistent_workers: bool = False,
    dataloader_prefetch_factor: int | None = None,
    dataloader_pin_memory: bool = False,
) -> DataLoader:
    """Return the ``DataLoader`` of an eval set: batches of ``batch_size`` in dataset order, the HF eval options.

    As HF's eval dataloader: ``num_workers``, ``persistent_workers``, ``prefetch_factor``,
    ``pin_memory`` and, for a dataset with a length, ``drop_last`` (a torch ``IterableDataset``
    keeps its last short batch, as in HF). The order is the dataset's for any number of workers
    (a dataset without length must shard itself across workers, or items repeat). Iterate the
    loader once per evaluation: with ``persistent_workers`` the same workers serve every one.

    >>> loader = eval_loader(list(range(5)), lambda items: items, 2, dataloader_drop_last=True)
    >>> list(loader)
    [[0, 1], [2, 3]]
    """
    errors = loader_errors(dataloader_num_workers, dataloader_persistent_workers, dataloader_prefetch_factor)
    if not isinstance(batch_size, int) or batch_size <= 0:
        errors.append(f"per_device_eval_batch_size={batch_size!r} must be a positive int")
    if errors:
        raise ValueError("invalid eval dataloader options: " + "; ".join(errors))
    sized = hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    if not sized and not isinstance(dataset, torch.utils.data.IterableDataset):
        dataset = _Iterated(dataset)
    elif sized and not isinstance(dataset, torch.utils.data.IterableDataset):
        if dataloader_drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"dataloader_drop_last=True drops every row of an eval set of {len(dataset)} rows (fewer than "
                f"per_device_eval_batch_size={batch_size}); use a smaller eval batch size or dataloader_drop_last=False"
            )
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        drop_last=dataloader_drop_last and not iterable,
        collate_fn=collate,
        num_workers=dataloader_num_workers,
        persistent_workers=dataloader_persistent_workers,
        prefetch_factor=dataloader_prefetch_factor,
        pin_memory=dataloader_pin_memory,
        worker_init_fn=ignore_sigterm if dataloader_num_workers > 0 else None,
    )
