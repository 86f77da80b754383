"""Sharded training on torch's FSDP2: ``fully_shard`` per transformer block, then the root, on a 1-D mesh.

``TrainingArguments(fsdp="full_shard")`` wraps the module with :func:`fully_shard_model` before its
state is made, so the state is *lent* (``init_state(model, optimizer, copy=False)``): its params are
the module's own DTensor shards and its optimizer state DTensors of the same layout. The eager step
runs the FSDP module as it is (torch gathers each block's params for its forward and backward and
reduce-scatters its gradients); trainfold adds what FSDP does not do:

* gradients are *summed* over ranks (``set_gradient_divide_factor(1.0)``): trainfold's losses are
  already divided by the global ``num_items_in_batch``, so the gradients are what one process gets on
  the global batch (to the summation order);
* during gradient accumulation only the last micro-batch synchronises
  (``set_requires_gradient_sync(False)`` on the others), as DDP's ``no_sync``.

A model the user wrapped with ``fully_shard`` trains the same way (``make_step`` on a lent, donated
state, or ``train``). Checkpoints go through DCP (``trainfold.ckpt.sharded``): each rank writes its
shards, and they load onto any number of ranks.

>>> FullShard.from_args("full_shard offload", {"reshard_after_forward": False})
FullShard(layer_classes=(), reshard_after_forward=False, offload=True, param_dtype=None)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from trainfold.step.plan import is_fully_sharded
from trainfold.step.recompute import checkpoint_blocks

__all__ = [
    "FullShard",
    "FSDP_OPTIONS",
    "FSDP_CONFIG_KEYS",
    "make_mesh",
    "layer_blocks",
    "fully_shard_model",
    "placed_like",
    "refuse_engine_options",
]

# fsdp= words trainfold does exactly with fully_shard ("auto_wrap": it wraps per block anyway)
FSDP_OPTIONS = ("full_shard", "auto_wrap", "offload")
# fsdp_config keys trainfold takes; what transformers fills in by itself (at these values) asks for nothing
FSDP_CONFIG_KEYS = ("transformer_layer_cls_to_wrap", "reshard_after_forward", "cpu_offload")
FSDP_CONFIG_PASSIVE = {
    "min_num_params": 0,
    "xla": False,
    "xla_fsdp_v2": False,
    "xla_fsdp_grad_ckpt": False,
    "version": 2,
}


def fsdp_words(value: Any) -> tuple[str, ...]:
    """Return the words of an ``fsdp`` setting, sorted (``"full_shard auto_wrap"`` or a list of them).

    >>> fsdp_words("full_shard auto_wrap"), fsdp_words(None)
    (('auto_wrap', 'full_shard'), ())
    """
    words = value.split() if isinstance(value, str) else list(value or ())
    return tuple(sorted(str(w) for w in words))


def fsdp_problems(fsdp: Any, config: Mapping[str, Any] | None) -> list[str]:
    """Return why ``fsdp`` / ``fsdp_config`` ask for what torch's ``fully_shard`` cannot do exactly (empty: nothing).

    >>> fsdp_problems("full_shard", None), fsdp_problems("shard_grad_op", None)[0][:38]
    ([], "fsdp='shard_grad_op' is not supported:")
    """
    words, out = fsdp_words(fsdp), []
    other = [w for w in words if w not in FSDP_OPTIONS]
    if other or (words and "full_shard" not in words):
        out.append(
            f"fsdp={fsdp!r} is not supported: {', '.join(repr(w) for w in other) or 'it needs full_shard'}; "
            "trainfold applies torch's fully_shard (FSDP2) per transformer block: write fsdp='full_shard' "
            "(+ ' offload' for CPU offload; fsdp_config={'reshard_after_forward': False} for SHARD_GRAD_OP)"
        )
    for key, value in (config or {}).items():
        if key not in FSDP_CONFIG_KEYS and FSDP_CONFIG_PASSIVE.get(key, object()) != value:
            out.append(
                f"fsdp_config[{key!r}]={value!r} is not supported: trainfold takes "
                f"{', '.join(FSDP_CONFIG_KEYS)} (torch's fully_shard does the rest itself)"
            )
    if not words and any(FSDP_CONFIG_PASSIVE.get(k, object()) != v for k, v in (config or {}).items()):
        out.append("fsdp_config is set but fsdp is not: write fsdp='full_shard' to shard")
    return out


@attrs.frozen
class FullShard:
    """How ``train`` wraps a module with ``fully_shard``: which blocks, resharding, offload, mixed precision.

    ``layer_classes``: the names of the block classes wrapped one by one (default: the model's
    ``_no_split_modules``, else the blocks activation checkpointing finds); ``reshard_after_forward``:
    free each block's gathered params after its forward (FULL_SHARD; False: SHARD_GRAD_OP);
    ``offload`` (``fsdp="full_shard offload"``, or transformers 5's ``fsdp_config["cpu_offload"]``):
    ``CPUOffloadPolicy``; ``param_dtype``: ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``.
    """

    layer_classes: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    offload: bool = False
    param_dtype: torch.dtype | None = None

    @classmethod
    def from_args(cls, fsdp: Any, config: Mapping[str, Any] | None = None, bf16: bool = False) -> FullShard:
        """Return the ``FullShard`` of HF's ``fsdp`` and ``fsdp_config`` (``bf16``: bf16 params, fp32 reduce)."""
        config = config or {}
        layers = config.get("transformer_layer_cls_to_wrap") or ()
        return cls(
            layer_classes=(layers,) if isinstance(layers, str) else tuple(layers),
            reshard_after_forward=bool(config.get("reshard_after_forward", True)),
            offload="offload" in fsdp_words(fsdp) or bool(config.get("cpu_offload", False)),
            param_dtype=torch.bfloat16 if bf16 else None,
        )


def make_mesh(group: Any = None, device_type: str | None = None) -> Any:
    """Return the 1-D ``DeviceMesh`` over the ranks of ``group`` (default: the world).

    Under torchrun without an open process group (``--nproc_per_node=1``: nothing joined one), it joins
    torchrun's group first: a one-rank mesh is a valid FSDP run.

    ``device_type`` defaults to ``"cuda"`` when the group's backend is NCCL, else ``"cpu"`` (gloo).
    """
    from torch.distributed.device_mesh import DeviceMesh

    from trainfold.distributed.distributed import join_torchrun_group, launched_by_torchrun

    if not dist.is_initialized() and launched_by_torchrun():  # torchrun --nproc_per_node=1: a one-rank mesh
        join_torchrun_group()
    if not dist.is_initialized():
        raise ValueError(
            "fsdp='full_shard' shards over the ranks of a torchrun job: run it under torchrun "
            "(python -m torch.distributed.run --nproc_per_node N your_script.py; N=1 is a one-rank mesh), or "
            "drop fsdp to train in one process"
        )
    group = group if group is not None else dist.group.WORLD
    if device_type is None:
        device_type = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    return DeviceMesh.from_group(group, device_type)


def layer_blocks(model: nn.Module, layer_classes: Sequence[str] = ()) -> list[nn.Module]:
    """Return the blocks ``fully_shard`` wraps one by one: modules of the classes named, else of the model's
    ``_no_split_modules``, else the blocks activation checkpointing finds (``recompute.checkpoint_blocks``).

    >>> from trainfold.core.models import TinyLM, TinyLMConfig
    >>> len(layer_blocks(TinyLM(TinyLMConfig(vocab_size=8, d_model=4, n_layers=3, n_heads=1, max_len=4))))
    3
    """
    names = tuple(layer_classes) or tuple(getattr(model, "_no_split_modules", None) or ())
    if names:
        blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
        if not blocks and layer_classes:
            found = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"fsdp_config['transformer_layer_cls_to_wrap']={list(layer_classes)} names no module of "
                f"{type(model).__name__}; its classes: {found[:12]}"
            )
        if blocks:
            return blocks
    return [block for _, block in checkpoint_blocks(model)]


def fully_shard_model(model: nn.Module, mesh: Any, spec: FullShard = FullShard()) -> nn.Module:
    """Wrap ``model`` with ``fully_shard`` per block (``layer_blocks``), then the root, on ``mesh``; return it.

    The module is changed in place (its class becomes an ``FSDPModule``, its params DTensor shards);
    a module already wrapped is returned as it is.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if is_fully_sharded(model):
        return model
    if spec.offload and mesh.device_type == "cpu":
        raise ValueError(
            "fsdp offload (CPUOffloadPolicy) keeps params on the CPU between their uses on an accelerator; this run "
            "is on the CPU already (a 'cpu' mesh): drop 'offload'"
        )
    options: dict[str, Any] = dict(
        mesh=mesh,
        reshard_after_forward=spec.reshard_after_forward,
        offload_policy=CPUOffloadPolicy() if spec.offload else OffloadPolicy(),
    )
    if spec.param_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=spec.param_dtype, reduce_dtype=torch.float32)
    for block in layer_blocks(model, spec.layer_classes):
        fully_shard(block, **options)
    # the root's params (embeddings, head) are needed again at once by backward: torch's own choice (None)
    # keeps them gathered after forward, as a hand fully_shard(model) does (True re-gathered them per micro-batch)
    fully_shard(model, **{**options, "reshard_after_forward": None if spec.reshard_after_forward else False})
    return model


def fsdp_modules(model: nn.Module) -> list[Any]:
    """Return the FSDP2 modules of ``model`` (those ``fully_shard`` wrapped: ``FSDPModule``), outermost first."""
    return [m for m in model.modules() if hasattr(m, "set_requires_gradient_sync")]


def summing(model: nn.Module) -> bool:
    """Make every FSDP2 module of ``model`` sum its reduce-scattered gradients (FSDP divides by the world size;
    trainfold's losses are already divided by the global item count); say whether there was one.

    >>> summing(torch.nn.Linear(2, 2))
    False
    """
    modules = fsdp_modules(model)
    for module in modules:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return bool(modules)


def syncing_last(model: nn.Module, micro: Callable[..., Any], count: int) -> Callable[..., Any]:
    """Return ``micro`` with the gradient reduce-scatter of ``model`` (FSDP2) off for all but the last of
    ``count`` micro-batches: the others accumulate unsharded gradients, as DDP's ``no_sync``."""
    calls = iter(range(count))

    def run(*positional: Any) -> Any:
        last = next(calls, count - 1) == count - 1
        _set_sync(model, last)
        return micro(*positional)

    return run


def _set_sync(model: nn.Module, sync: bool) -> None:
    for module in fsdp_modules(model)[:1]:  # the root's call reaches every FSDP module below it
        module.set_requires_gradient_sync(sync, recurse=True)


def placed_like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Return ``value`` laid out as ``target``: a DTensor's full tensor for a plain target (a collective: every
    rank calls it), a plain tensor cut to a DTensor target's placement (each rank its own part of the whole
    tensor it holds), else ``value``.

    >>> placed_like(torch.ones(2), torch.zeros(2)).tolist()
    [1.0, 1.0]
    """
    if hasattr(value, "full_tensor") and not hasattr(target, "full_tensor"):
        return value.full_tensor()
    if hasattr(target, "full_tensor") and not hasattr(value, "full_tensor"):
        from torch.distributed.tensor import distribute_tensor

        mesh, placements = getattr(target, "device_mesh"), getattr(target, "placements")  # noqa: B009  # a DTensor
        return distribute_tensor(value, mesh, placements, src_data_rank=None)
    return value


def refuse_engine_options(model: nn.Module, *, sharding: Any = None, compile: Any = False) -> None:
    """Raise ``TypeError`` for ``make_step(sharding=...)`` (shard with ``fully_shard`` instead) and for ``compile``
    with a ``fully_shard`` module, each naming the fix.

    >>> refuse_engine_options(torch.nn.Linear(2, 2), compile=True) is None
    True
    """
    if sharding is not None:
        raise TypeError(
            f"make_step(sharding={sharding!r}) is not taken: shard with torch's FSDP2 instead: wrap the module "
            "with torch.distributed.fsdp.fully_shard per block, then the root "
            "(trainfold.step.fsdp.fully_shard_model(model, mesh)), make a lent state (init_state(model, "
            "optimizer, copy=False)) and step it donated (step(state, batch, donate=True); fit and train donate)"
        )
    if compile and is_fully_sharded(model):
        raise TypeError(
            f"compile={compile!r} with a fully_shard (FSDP2) module is not supported: the compiled step traces "
            "the pure path, which cannot run FSDP's hooks; drop compile (torch_compile) for a sharded run"
        )
