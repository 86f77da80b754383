"""Warm up the element-wise kernels whose first call in a process can differ between processes.

On CPU builds of torch that route element-wise math through MKL's vector library (``torch.tanh``,
``exp``, ``erf``, ``log``, ``sqrt``, ``sin``, ``cos``, ... on float32/float64), the *first* call of
such a kernel in a process, split over several OpenMP threads, was seen to return values off by
hundreds of ulps in one thread's share (torch 2.13 CPU, 2 threads; issue 23). Later calls agree
with each other, so a process that meets its first ``tanh`` at the first step of a resumed run
(GPT-2's ``gelu_new``) drifts from the run it resumes. ``warm_up_kernels()`` makes every such
first call happen here, on a throw-away input: first on the calling thread alone (a tensor below
the parallel grain, so no two threads initialise a kernel at once), then split over all intra-op
threads, and checks that two split calls agree bitwise. ``train`` calls it before its first step.

>>> report = warm_up_kernels(dtypes=(torch.float32,))
>>> "tanh" in report.ops, report.inconsistent
(True, ())
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DEFAULT_OPS", "KernelWarmup", "WARM_OPS", "warm_up_kernels"]

_GRAIN = 32768  # at::internal::GRAIN_SIZE; MKL-backed unary kernels split at 2048 elements


def _unit(x: Tensor) -> Tensor:
    return x / (x.abs().amax() + 1)


def _positive(x: Tensor) -> Tensor:
    return x.abs() + 0.25


def _rows(fn: Callable[..., Tensor]) -> Callable[[Tensor], Tensor]:
    return lambda x: fn(x.view(-1, 256), dim=-1)


# name -> (kernel, the input's domain). The MKL-backed unary kernels of ATen's vml.h, then the
# activations and normalisations HF models call (gelu exact and tanh-approximate, silu, ...).
WARM_OPS: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor] | None]] = {
    "tanh": (torch.tanh, None),
    "exp": (torch.exp, None),
    "expm1": (torch.expm1, None),
    "erf": (torch.erf, None),
    "erfc": (torch.erfc, None),
    "erfinv": (torch.erfinv, _unit),
    "log": (torch.log, _positive),
    "log2": (torch.log2, _positive),
    "log10": (torch.log10, _positive),
    "log1p": (torch.log1p, _positive),
    "sqrt": (torch.sqrt, _positive),
    "rsqrt": (torch.rsqrt, _positive),
    "sin": (torch.sin, None),
    "cos": (torch.cos, None),
    "tan": (torch.tan, _unit),
    "asin": (torch.asin, _unit),
    "acos": (torch.acos, _unit),
    "atan": (torch.atan, None),
    "sigmoid": (torch.sigmoid, None),
    "gelu": (F.gelu, None),
    "gelu_tanh": (functools.partial(F.gelu, approximate="tanh"), None),
    "silu": (F.silu, None),
    "mish": (F.mish, None),
    "softplus": (F.softplus, None),
    "elu": (F.elu, None),
    "softmax": (_rows(torch.softmax), None),
    "log_softmax": (_rows(torch.log_softmax), None),
}


# What ``train`` warms up: the MKL-backed kernels transformer models call (GPT-2's ``gelu_new`` is
# ``tanh``; rotary embeddings ``sin``/``cos``; ``exp``/``log``/``sqrt`` in losses and optimizers), and
# the activations and softmaxes of HF models.
DEFAULT_OPS = (
    "tanh",
    "exp",
    "erf",
    "log",
    "sqrt",
    "sin",
    "cos",
    "sigmoid",
    "gelu",
    "gelu_tanh",
    "silu",
    "softmax",
    "log_softmax",
)


@attrs.frozen
class KernelWarmup:
    """What ``warm_up_kernels`` ran: the ops, dtypes and thread count, and any op still inconsistent."""

    ops: tuple[str, ...]
    dtypes: tuple[str, ...]
    threads: int
    inconsistent: tuple[str, ...] = ()  # "op/dtype" whose split calls still disagreed after the warm-up


def warm_up_kernels(
    ops: Sequence[str] = DEFAULT_OPS,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    *,
    attempts: int = 3,
) -> KernelWarmup:
    """Call each element-wise kernel (forward and backward) once alone, then on every thread; return a report.

    ``ops`` are names in ``WARM_OPS`` (default ``DEFAULT_OPS``). Call it after ``torch.set_num_threads``
    and before the first step. It draws from its own
    generator (never the global one) and changes no state a run reads; ``inconsistent`` lists the
    ``op/dtype`` pairs whose two split calls still differed after ``attempts`` tries (then that
    kernel is not deterministic on this build, whatever the warm-up).

    >>> warm_up_kernels(["tanh", "gelu_tanh"], dtypes=(torch.float32, torch.bfloat16)).dtypes
    ('float32', 'bfloat16')
    >>> warm_up_kernels(["tanhh"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown kernel names ['tanhh']; choose among WARM_OPS: ['acos', 'asin', ...]
    """
    unknown = [n for n in ops if n not in WARM_OPS]
    if unknown:
        raise ValueError(f"unknown kernel names {unknown}; choose among WARM_OPS: {sorted(WARM_OPS)}")
    return _warm_up(tuple(ops), tuple(dtypes), torch.get_num_threads(), attempts)


@functools.cache  # the race is in a process's first calls: once per process, ops, dtypes and thread count
def _warm_up(names: tuple[str, ...], dtypes: tuple[torch.dtype, ...], threads: int, attempts: int) -> KernelWarmup:
    g = torch.Generator().manual_seed(0)
    alone = torch.randn(256, generator=g) * 3  # under every grain: runs on this thread only
    split = torch.randn(_GRAIN * max(2, threads), generator=g) * 3  # one grain per thread: split over all
    inconsistent: list[str] = []
    with torch.enable_grad():
        for dtype in dtypes:
            for name in names:
                fn, domain = WARM_OPS[name]
                _forward_backward(fn, _domain(alone, domain, dtype))
                x = _domain(split, domain, dtype)
                if not _agrees(fn, x, attempts):
                    inconsistent.append(f"{name}/{str(dtype).removeprefix('torch.')}")
    return KernelWarmup(
        tuple(names), tuple(str(d).removeprefix("torch.") for d in dtypes), threads, tuple(inconsistent)
    )


def _domain(x: Tensor, domain: Callable[[Tensor], Tensor] | None, dtype: torch.dtype) -> Tensor:
    return (domain(x) if domain is not None else x).to(dtype)


def _forward_backward(fn: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    leaf = x.detach().requires_grad_(True)
    y = fn(leaf)
    (grad,) = torch.autograd.grad(y, leaf, torch.ones_like(y))
    return y.detach(), grad


def _agrees(fn: Callable[[Tensor], Tensor], x: Tensor, attempts: int) -> bool:
    """Say whether two split calls (forward and backward) agree bitwise within ``attempts`` tries."""
    before = _forward_backward(fn, x)
    for _ in range(max(1, attempts)):
        now = _forward_backward(fn, x)
        if all(torch.equal(a, b) for a, b in zip(before, now)):
            return True
        before = now
    return False
