"""K LoRA adapters on one frozen base, trained in one step: the base's weights are held once and shared.

An *adapter ensemble state* is a ``TrainState`` whose ``params`` (the adapters: a PEFT model's
trainable tensors) carry a leading member axis of size K, while ``buffers`` (the frozen base) are
held once, unstacked. The step runs the forward pass of all K members at once with
``torch.func.vmap`` over the adapter params only (the base enters every member's forward as the same
tensors: one matmul over the K members' rows), scores each member with the loss, takes all members'
gradients with one ``torch.autograd.grad`` of the summed losses (members share no trainable tensor, so
each gets exactly its own), and applies the optimizer to the stacked tensors. That is each member's own
update when the optimizer is element-wise with shared hyperparameters (SGD with momentum and weight decay,
AdamW: the update count is shared, the members step together); a global-norm clip would mix the members
and is refused. Each member's micro-batches are its own (a leading member axis on every tensor).

Each member equals its own ``make_step`` run up to float rounding of the batched matmuls (see
``tests/test_ensemble_lora.py``); :func:`save_adapters` writes each as a PEFT adapter directory
that ``PeftModel.from_pretrained(base, directory)`` loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import attrs
import safetensors.torch
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils import _pytree as pytree

from trainfold.core.adapters import ADAPTER_CONFIG_FILE, ADAPTER_FILE, adapter_config_text, adapter_keys
from trainfold.core.forward import training_flags
from trainfold.core.losses import counter_for, default_loss_for
from trainfold.core.state import TrainState, init_state
from trainfold.core.tree import global_norm
from trainfold.optim import GradientTransformation
from trainfold.optim.transform import apply_updates
from trainfold.step.driver import advanced

__all__ = ["adapter_count", "init_adapter_ensemble", "make_adapter_ensemble_step", "save_adapters"]

Batch = Sequence[Mapping[str, Tensor]]
_ELEMENTWISE = {"adamw", "sgd", "add_decayed_weights", "trace", "scale_by_learning_rate", "scale_by_adam"}


def adapter_count(state: TrainState) -> int:
    """Return K, the number of adapters of an adapter ensemble state (the leading axis of its params)."""
    sizes = {v.shape[0] if v.dim() else None for v in state.params.values()}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"not an adapter ensemble state: the params' leading sizes are {sorted(map(str, sizes))}")
    return int(next(s for s in sizes if s is not None))


def _parts(optimizer: Any) -> list[Any]:
    inner = getattr(optimizer, "parts", None)
    return [optimizer] if inner is None else [p for part in inner for p in _parts(part)]


def _check_optimizer(optimizer: GradientTransformation) -> None:
    parts = _parts(optimizer)
    bad = [getattr(p, "name", type(p).__name__) for p in parts if getattr(p, "name", None) not in _ELEMENTWISE]
    if bad:
        raise ValueError(
            f"an adapter ensemble applies one optimizer to the K stacked adapters, which is each adapter's own update "
            f"only for element-wise transformations ({sorted(_ELEMENTWISE)}); {bad} would mix the members (a "
            "global-norm clip scales all K by one norm): use sgd(...) or adamw(...) without clipping"
        )


def init_adapter_ensemble(
    model: nn.Module,
    optimizer: GradientTransformation,
    adapters: Sequence[Mapping[str, Tensor]] | None = None,
    *,
    size: int | None = None,
    seed: int = 0,
) -> TrainState:
    """Return the first adapter ensemble state of ``model`` (a PEFT model): K adapters, the base once.

    ``adapters`` are K dicts of the model's trainable tensors (e.g. ``init_state(peft_model_m, opt).params``
    of K PEFT models on one base); without them, ``size`` copies of the model's own adapter.

    >>> import torch
    >>> from trainfold import sgd
    >>> base = torch.nn.Linear(3, 2).requires_grad_(False)
    >>> model = torch.nn.Sequential(base, torch.nn.Linear(2, 2))     # stands for a PEFT model
    >>> state = init_adapter_ensemble(model, sgd(0.1), size=4)
    >>> state.params["1.weight"].shape, state.buffers["0.weight"].shape, adapter_count(state)
    (torch.Size([4, 2, 2]), torch.Size([2, 3]), 4)
    """
    _check_optimizer(optimizer)
    one = init_state(model, optimizer, seed=seed)
    if adapters is None:
        if size is None or size < 1:
            raise ValueError(f"give size=K >= 1 (got {size}) or a list of K adapters")
        adapters = [one.params] * size
    for i, a in enumerate(adapters):
        if a.keys() != one.params.keys():
            raise KeyError(
                f"adapter {i} has keys {sorted(a)[:4]}...; the model's trainable tensors are "
                f"{sorted(one.params)[:4]}...: give each adapter as init_state(peft_model, opt).params"
            )
    params = {k: torch.stack([a[k].detach() for a in adapters]).clone() for k in one.params}
    k = len(adapters)
    metrics = {name: v.expand(k).clone() if name != "learning_rate" else v for name, v in one.metrics.items()}
    return attrs.evolve(
        one,
        params=params,
        opt_state=optimizer.init(params),
        metrics=metrics,
        loss_total=one.loss_total.expand(k).clone(),
        nonfinite_losses=one.nonfinite_losses.expand(k).clone(),
    )


def make_adapter_ensemble_step(
    model: nn.Module,
    loss: Callable[..., Tensor] | None = None,
    optimizer: GradientTransformation | None = None,
    *,
    label_key: str = "labels",
) -> Callable[[TrainState, Batch], TrainState]:
    """Return ``step(state, batch) -> state`` training the K adapters of an adapter ensemble state at once.

    Every tensor of each micro-batch has a leading member axis (``trainfold.step.ensemble.stack_batches``
    builds it). ``loss(outputs, labels, num_items)`` as ``make_step``'s, counted per member; ``optimizer``
    is the one ``init_adapter_ensemble`` got. Dropout draws are vmap's (``randomness="different"``), not
    those of each member's own step: compare members with their single runs without dropout.
    """
    if optimizer is None:
        raise TypeError("make_adapter_ensemble_step needs an optimizer, e.g. trainfold.sgd(1e-2, momentum=0.9)")
    _check_optimizer(optimizer)
    loss = loss or default_loss_for(model)
    count = counter_for(loss)

    def step(state: TrainState, batch: Batch) -> TrainState:
        k = adapter_count(state)
        sums = [sum(count(mb[label_key][m]) for mb in batch) for m in range(k)]
        counts = torch.stack(cast(list[Tensor], sums))  # cast: sum()'s stubs add its start, 0, to the type
        leaves = {n: p.detach().requires_grad_() for n, p in state.params.items()}
        buffers = state.buffers

        def forward(p: dict[str, Tensor], x: dict[str, Tensor]) -> Any:
            return functional_call(model, (p, buffers), args=(), kwargs=x, strict=True)

        losses, grads = torch.zeros(k), None
        with training_flags(list(model.modules()), True):
            for mb in batch:
                each = _member_losses(forward, loss, leaves, mb, label_key, counts)
                found = torch.autograd.grad(each.sum(), list(leaves.values()), allow_unused=True)
                new = [torch.zeros_like(p) if g is None else g for g, p in zip(found, leaves.values())]
                grads = new if grads is None else [a + b for a, b in zip(grads, new)]
                losses += each.detach().float()
        assert grads is not None  # counts (above) refuses a step of no micro-batches
        tree = dict(zip(leaves, grads))
        params = {n: p.detach() for n, p in state.params.items()}
        updates, opt_state = optimizer.update(tree, state.opt_state, params)
        norms = torch.stack([global_norm({n: g[m] for n, g in tree.items()}) for m in range(k)])
        metrics = {
            "loss": losses,
            "grad_norm": norms,
            "learning_rate": torch.tensor(optimizer.learning_rate(state.opt_state), dtype=torch.float64),
            "num_items": counts.float(),
        }
        cursor = getattr(batch, "cursor", state.cursor)
        return advanced(state, metrics, params=apply_updates(params, updates), opt_state=opt_state, cursor=cursor)

    return step


def _member_losses(
    forward: Callable[..., Any],
    loss: Callable[..., Tensor],
    leaves: dict[str, Tensor],
    micro_batch: Mapping[str, Tensor],
    label_key: str,
    counts: Tensor,
) -> Tensor:
    """Return each member's loss on its slice of ``micro_batch``: one forward vmapped over the members."""
    inputs = {key: v for key, v in micro_batch.items() if key != label_key}
    outputs = vmap(forward, in_dims=(0, 0), randomness="different")(leaves, inputs)
    labels = micro_batch[label_key]
    members = [
        pytree.tree_map(lambda t, m=m: t[m] if isinstance(t, Tensor) else t, outputs) for m in range(len(counts))
    ]
    return torch.stack([loss(out, labels[m], counts[m]) for m, out in enumerate(members)])


def save_adapters(state: TrainState, model: nn.Module, directories: Sequence[str | os.PathLike]) -> list[Path]:
    """Write adapter m of ``state`` to ``directories[m]`` as ``PeftModel.save_pretrained`` does; return the paths.

    Each directory holds ``adapter_model.safetensors`` (peft's key names) and ``adapter_config.json``,
    so ``PeftModel.from_pretrained(base, directory)`` loads adapter m. ``model`` (the PEFT model the
    state was made from) names the tensors and gives the config; it is not changed.
    """
    k = adapter_count(state)
    if len(directories) != k:
        raise ValueError(f"the state holds {k} adapters; give {k} directories, got {len(directories)}")
    written = []
    for m, directory in enumerate(directories):
        weights = {n: p[m].contiguous() for n, p in state.params.items()}
        keys = adapter_keys(model, weights)
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file({key: weights[name] for name, key in keys.items()}, str(out / ADAPTER_FILE))
        (out / ADAPTER_CONFIG_FILE).write_text(adapter_config_text(model))
        written.append(out)
    return written
