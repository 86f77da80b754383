"""Tolerances derived from float32 rounding, for tests that compare runs whose sums differ only in order.

Two float32 sums of the same ``n`` numbers ``x_i`` added in different orders (ranks against one
process, micro-batch splits, packed against padded rows, a chunked against a whole loss) each lie
within ``gamma(n - 1) * sum|x_i|`` of the exact sum, ``gamma(k) = k u / (1 - k u)`` with the unit
roundoff ``u = 2**-24`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4),
so they differ by at most ``reordered(n, sum|x_i|) = 2 gamma(n - 1) sum|x_i|``. The bound is linear
in ``sum|x_i|``, so it holds element by element for gradients, whose every element is such a sum
(over micro-batches, ranks and, inside the backward's matmuls, tokens).

An optimizer linear in the gradients passes such a difference on unchanged in size: SGD with
momentum ``b`` moves the params by ``-lr_t m_t``, ``m_t = sum_{s<=t} b**(t-s) g_s``, so gradients that
differ by at most ``d`` at each of ``T`` steps give params that differ by at most
``lr d sum_{t<=T} sum_{s<=t} b**(t-s) <= lr d T / (1 - b)`` (``sgd_atol``), plus, per step, one rounding
of each param to a neighbouring float (``rtol = T eps``, ``eps = 2u``). The gradient of a later step
is taken at params that already differ by that much; its change (the Hessian times that difference,
scaled by ``lr`` again) is second order in ``lr`` and left out. Adam is not linear: its first update
``lr g / (|g| + eps)`` turns the rounding of a gradient that cancels to about ``eps`` into a step of
up to ``lr``; that is why equivalence tests across summation orders use SGD (+ momentum). Where a path
supports only AdamW (compiled, ensemble steps), both runs take one step from the same state and
``adam_step_atol`` bounds that step element by element from the reference's moments, in units of lr.

``sum|x_i|`` is measured, not guessed: ``row_abs_grads`` sums the absolute gradients of each row's
own loss (``|x_i|`` of the terms a step adds up over rows). Inside a row the backward also sums over
positions, and some elements are cancellations inside the backward itself (the attention key bias,
whose true gradient is 0: softmax ignores it); so ``grad_atol`` takes, per tensor, the largest
element's ``sum|x_i|`` and counts every token as a term (``n`` = tokens, not rows). On the tiny
models of the tests the differences observed are below ``10 u sum|x_i|`` (rows), well inside that.
Each ``x_i`` is itself computed: a row's forward and backward are dot products, which a batch of another
shape may run through another matmul kernel, in another order; where rows are few (so the token count
does not already dominate), ``grad_atol(..., inner=)`` adds those products' lengths to the terms (to
first order, a row's gradient is within ``gamma(inner) |x_i|`` of itself computed in another order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.func import grad

U = 2.0**-24  # float32 unit roundoff
EPS = 2 * U  # torch.finfo(torch.float32).eps


def gamma(k: int) -> float:
    """Higham's ``gamma_k = k u / (1 - k u)``: the relative error bound of ``k`` float32 roundings."""
    return k * U / (1 - k * U)


def reordered(n: int, abs_sum: float) -> float:
    """Most by which two float32 sums of the same ``n`` terms (``sum|x_i| = abs_sum``) can differ."""
    return 2 * gamma(max(n - 1, 0)) * abs_sum


def row_abs_grads(loss: Callable[[dict, int], torch.Tensor], params: dict, rows: Iterable[int]) -> dict:
    """``sum_r |grad loss(params, r)|`` element by element: the sizes of what a step's gradient adds up."""
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for r in rows:
        for k, g in grad(loss)({k: v.detach() for k, v in params.items()}, r).items():
            total[k] += g.abs()
    return total


def grad_atol(abs_grads: dict, terms: int, inner: int = 0) -> dict[str, float]:
    """Per tensor, the most two summation orders of its gradient can differ (module docstring); ``inner``: the
    roundings along one row's own forward and backward (its dot products' lengths), which a batch of another
    shape may do in another order (another matmul kernel), so each ``x_i`` itself is within ``gamma(inner)``."""
    return {k: reordered(terms + inner, v.max().item()) for k, v in abs_grads.items()}


def assert_trees_within(a: dict, b: dict, atol: dict[str, float], rtol: float) -> None:
    """``a`` and ``b`` agree tensor by tensor within ``atol[key] + rtol |b|`` (``torch.testing.assert_close``)."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol[k], rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


def sgd_atol(lr: float, steps: int, grad_diff: float, momentum: float = 0.0) -> float:
    """Most by which SGD(+momentum) params can drift apart from gradients ``grad_diff`` apart a step."""
    return lr * grad_diff * steps / (1 - momentum)


def sgd_rtol(steps: int) -> float:
    """Each step rounds each param once: two runs may land a float apart each time (``eps |p|``)."""
    return steps * EPS


def clipped_sgd_atol(
    steps: list[tuple[dict, dict, float, float]], lr: float, momentum: float
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Element-wise bounds on how far two clipped SGD(+momentum) runs' params and momenta drift apart.

    ``steps`` holds, per step, ``(grad_atol, abs_grads, norm, max_norm)``: the per-tensor bound on the
    gradients' difference (``grad_atol``), ``sum|x_i|`` (``row_abs_grads``, which bounds ``|g|``), the
    reference's gradient norm and the clipping threshold. The clip coefficient ``c = min(1, max_norm /
    norm)`` of the two runs differs relatively by ``rho = |dg| / |g| + gamma(N)`` (the gradients'
    difference, and the ``N``-term sum of positive squares taken in another order), so a clipped
    gradient moves by at most ``c (grad_atol + rho sum|x_i|)`` (``rho`` is 0 where ``norm (1 + rho)`` is
    below ``max_norm``: neither run clips); momentum then adds these up with weights
    ``momentum**(t - s)`` and the params by ``lr`` times the momenta (``sgd_atol``, per step).
    """
    moment: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    for atol, abs_grads, norm, max_norm in steps:
        size = sum(v.numel() for v in abs_grads.values())
        diff = sum(atol[k] ** 2 * v.numel() for k, v in abs_grads.items()) ** 0.5
        rho = diff / norm + gamma(size)
        c = min(1.0, max_norm / norm)
        rho = 0.0 if norm * (1 + rho) < max_norm else rho  # neither run clips: c is exactly 1.0 on both
        for k, s in abs_grads.items():
            moment[k] = momentum * moment.get(k, 0.0) + c * (atol[k] + rho * s)
            params[k] = params.get(k, 0.0) + lr * moment[k]
    return params, moment


def assert_within(a: torch.Tensor, b: torch.Tensor, atol: torch.Tensor | float, rtol: float, name: str) -> None:
    """``|a - b| <= atol + rtol |b|`` element by element (``atol`` a tensor of ``b``'s shape, or a float)."""
    excess = (a - b).abs() - (atol + rtol * b.abs())
    assert bool((excess <= 0).all()), f"{name}: off by up to {excess.max().item():.3g} beyond its bound"


def causal_lm_run_bounds(
    model: torch.nn.Module,
    rows: list[dict],
    rows_per_step: int,
    history: list[dict],
    lr: float,
    momentum: float,
    *,
    max_norm: float,
    counts: list[int] | None = None,
    per_token: bool = False,
    label_smoothing: float = 0.0,
) -> tuple[dict[str, torch.Tensor], float, Callable[[float], float]]:
    """Element-wise bounds on two clipped SGD(+momentum) ``train`` runs of a causal LM on ``rows`` that add the
    same token terms in other orders (ranks, accumulation), and their ``rtol`` (``sgd_rtol``).

    ``model`` holds the initial params. Any step's ``sum|x_i|`` is at most the sum over *every* token of
    every row (terms are non-negative, so a step's rows only drop terms), each row's loss divided by the
    smallest count a step of ``rows_per_step`` rows can have (``counts``: each row's fewest counted labels;
    its labels' count when None). Where a collator masks labels at random, ``per_token`` measures each
    token alone, so that any mask only drops terms. It is measured at the initial params, whose
    later change (``lr`` per step) moves it only by a second-order amount. A step sums at most its longest
    rows' tokens. ``history`` is the reference run's log (a ``grad_norm`` per step); ``lr`` bounds the
    schedule. The third value gives how far a logged training loss ``loss`` may be off: its token losses
    (positive) in another order, ``reordered(terms, loss)``, plus its first-order change at params within
    the bound, ``sum sum|x_i| bound`` (the measured sizes bound the loss's gradient too).
    """
    from trainfold.core.forward import make_forward
    from trainfold.core.losses import causal_lm

    forward = make_forward(model, dict(model.named_buffers()))
    counts = counts if counts is not None else [sum(x != -100 for x in r["labels"][1:]) for r in rows]
    fewest = max(sum(sorted(counts)[:rows_per_step]), 1)
    positions = [range(1, len(row["labels"])) if per_token else [None] for row in rows]
    items = [(r, t) for r, row in enumerate(positions) for t in row if t is None or rows[r]["labels"][t] != -100]

    def loss(p: dict, i: int) -> torch.Tensor:
        r, t = items[i]
        labels = torch.tensor([rows[r]["labels"]])
        if t is not None:  # this token alone
            labels = torch.full_like(labels, -100).index_fill_(1, torch.tensor([t]), rows[r]["labels"][t])
        logits = forward(p, {"input_ids": torch.tensor([rows[r]["input_ids"]])})
        return causal_lm(logits, labels, fewest, label_smoothing=label_smoothing)

    abs_grads = row_abs_grads(loss, dict(model.named_parameters()), range(len(items)))
    terms = sum(sorted((len(r["input_ids"]) for r in rows), reverse=True)[:rows_per_step])
    norms = [h["grad_norm"] for h in history if "grad_norm" in h]
    params, _ = clipped_sgd_atol([(grad_atol(abs_grads, terms), abs_grads, n, max_norm) for n in norms], lr, momentum)
    slack = sum((abs_grads[k] * params[k]).sum().item() for k in params)
    return params, sgd_rtol(len(norms)), lambda loss: reordered(terms, loss) + slack


def causal_lm_eval_atol(model: torch.nn.Module, rows: list[dict], bound: dict[str, torch.Tensor], loss: float) -> float:
    """How far two evaluations of the mean causal-LM loss ``loss`` on ``rows`` can be apart, at params within
    ``bound`` of each other: the tokens' losses (all positive) summed in other batches and orders,
    ``reordered(tokens, loss)``, plus the loss's first-order change, ``sum |grad| bound``, with ``|grad|``
    at most ``row_abs_grads`` of the rows (measured at ``model``'s params; the rest is second order)."""
    from trainfold.core.forward import make_forward
    from trainfold.core.losses import causal_lm

    forward = make_forward(model, dict(model.named_buffers()))
    count = sum(len(r["labels"]) - 1 for r in rows)
    ids = [torch.tensor([r["input_ids"]]) for r in rows]
    labels = [torch.tensor([r["labels"]]) for r in rows]
    row = lambda p, r: causal_lm(forward(p, {"input_ids": ids[r]}), labels[r], count)
    abs_grads = row_abs_grads(row, dict(model.named_parameters()), range(len(rows)))
    return reordered(count, loss) + sum((abs_grads[k] * bound[k]).sum().item() for k in abs_grads)


def causal_lm_step_abs_grads(model: torch.nn.Module, micro_batches: list[dict], params: dict) -> tuple[dict, int]:
    """``row_abs_grads`` of one step's causal-LM loss on ``micro_batches`` (each row's loss over the step's
    count) at ``params``, and the number of positions the step sums over (``grad_atol``'s ``terms``)."""
    from trainfold.core.forward import make_forward
    from trainfold.core.losses import causal_lm

    forward = make_forward(model, dict(model.named_buffers()))
    count = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro_batches)
    rows = [{k: v[i : i + 1] for k, v in m.items()} for m in micro_batches for i in range(len(m["labels"]))]

    def loss(p: dict, r: int) -> torch.Tensor:
        inputs = {k: v for k, v in rows[r].items() if k != "labels"}
        return causal_lm(forward(p, inputs), rows[r]["labels"], max(count, 1))

    terms = sum(m["labels"].numel() for m in micro_batches)
    return row_abs_grads(loss, params, range(len(rows))), terms


def adam_first_step_atol(grad: torch.Tensor, grad_diff: float, lr: float, eps: float = 1e-8) -> torch.Tensor:
    """Element-wise, how far Adam's first steps from gradients ``grad_diff`` apart can land (lr units).

    Bias-corrected, the first step is ``lr g / (|g| + eps)``, whose slope ``eps / (|g| + eps)**2`` is at most
    ``eps / (|g| - d + eps)**2`` within ``d`` of the reference gradient ``g``; no step differs by more than
    ``2 lr``. Where ``|g|`` is near the rounding of a cancelled sum, that is the honest bound: a whole step.
    """
    near = (grad.abs() - grad_diff).clamp(min=0)
    return lr * torch.clamp(grad_diff * eps / (near + eps) ** 2, max=2.0)


def adam_step_atol(
    mu_old: torch.Tensor,
    mu: torch.Tensor,
    nu: torch.Tensor,
    grad_diff: float,
    count: int,
    lr: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Element-wise, how far two AdamW steps from the *same* state, on gradients ``grad_diff`` apart, can land.

    ``mu_old`` is the first moment before the step, ``mu`` and ``nu`` the reference's after it, ``count`` the
    step's number (from 1). The reference gradient is ``g = (mu - b1 mu_old) / (1 - b1)``; the other run's
    moments differ by ``dm = (1 - b1) d`` and ``dv <= (1 - b2)(2|g| + d) d``, so after bias correction the
    update ``u = m / (sqrt(v) + eps)`` moves by at most ``(|dm| + |u| sqrt(|dv|)) / (sqrt(max(v - dv, 0)) + eps)``
    (``|sqrt a - sqrt b| <= sqrt|a - b|``), and never by more than twice the largest update: ``|m| / sqrt(v)
    <= sqrt(sum_s w_s**2 / w'_s)`` by Cauchy-Schwarz, ``w_s`` and ``w'_s`` the moments' weights of gradient
    ``s``. The decoupled weight decay is the same op on the same params on both sides.
    """
    c1, c2 = 1 - b1**count, 1 - b2**count
    g = (mu - b1 * mu_old) / (1 - b1)
    dm = (1 - b1) * grad_diff / c1
    dv = (1 - b2) * (2 * g.abs() + grad_diff) * grad_diff / c2
    v_hat = nu / c2
    u = (mu / c1) / (v_hat.sqrt() + eps)
    moved = (dm + u.abs() * dv.sqrt()) / ((v_hat - dv).clamp(min=0).sqrt() + eps)
    largest = sum(((1 - b1) * b1**k / c1) ** 2 / ((1 - b2) * b2**k / c2) for k in range(count)) ** 0.5
    return lr * torch.clamp(moved, max=2 * largest)


def adam_step_bounds(prev, want, sizes: dict, terms: int, max_norm: float = float("inf")) -> dict[str, torch.Tensor]:
    """``adam_step_atol`` per param for a (clipped) AdamW step from state ``prev`` to the reference ``want``,
    on gradients whose terms have the measured ``sizes`` (``row_abs_grads``) and count ``terms``: the gradients
    within ``grad_atol``, the clip coefficient within ``rho = |dg| / |g| + gamma(N)`` relative where a run can
    clip (``clipped_sgd_atol``), so each gradient element within ``grad_atol + rho max sum|x_i|``."""
    atol, norm = grad_atol(sizes, terms), want.metrics["grad_norm"].item()
    rho = sum(atol[k] ** 2 * v.numel() for k, v in sizes.items()) ** 0.5 / norm + gamma(
        sum(v.numel() for v in sizes.values())
    )
    rho = rho if norm * (1 + rho) >= max_norm else 0.0
    adam = lambda state: state[-1] if isinstance(state, tuple) else state
    before, after = adam(prev.opt_state), adam(want.opt_state)
    count, lr = int(after.count), want.metrics["learning_rate"].item()
    return {
        k: adam_step_atol(before.mu[k], after.mu[k], after.nu[k], atol[k] + rho * sizes[k].max().item(), count, lr)
        for k in want.params
    }
