"""``from_torch``: a torch.optim optimizer as a transform, trained through the step and resumed from a checkpoint."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainfold import init_state, make_step
from trainfold.ckpt import load, save
from trainfold.core.losses import cross_entropy
from trainfold.core.state import lend
from trainfold.optim import chain, clip_by_global_norm, from_torch


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))


def batches(n: int) -> list[list[dict]]:
    g = torch.Generator().manual_seed(1)
    return [
        [{"input": torch.randn(5, 4, generator=g), "labels": torch.randint(0, 3, (5,), generator=g)} for _ in range(2)]
        for _ in range(n)
    ]


def torch_loop(net: nn.Module, opt: torch.optim.Optimizer, steps: list[list[dict]]) -> None:
    """torch's own loop: the same summed loss over the step's items, backward per micro-batch, one step."""
    for micro in steps:
        n = sum(int((mb["labels"] != -100).sum()) for mb in micro)
        for mb in micro:
            out = net(mb["input"])
            (torch.nn.functional.cross_entropy(out, mb["labels"], reduction="sum") / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_from_torch_adagrad_equals_torchs_loop_with_a_save_and_load_in_the_middle(tmp_path):
    data = batches(6)
    ref = model()
    torch_loop(ref, torch.optim.Adagrad(ref.parameters(), lr=0.05, lr_decay=0.01), data)

    opt = from_torch(torch.optim.Adagrad, lr=0.05, lr_decay=0.01)
    first = model()
    step = make_step(first, cross_entropy, opt)
    state = init_state(first, opt, copy=False)
    for b in data[:3]:
        state = step(state, b, donate=True)  # lent: torch's Adagrad steps the module's Parameters
    path = save(state, tmp_path / "checkpoint-3", model=first)

    second = model(seed=7)  # another start: everything comes from the checkpoint
    step = make_step(second, cross_entropy, opt)
    state = lend(second, load(path, like=init_state(second, opt)))  # into the module's own Parameters
    assert int(state.opt_state.count) == 3 and bool(state.opt_state.started)
    for b in data[3:]:
        state = step(state, b, donate=True)
    for name, p in ref.named_parameters():
        assert torch.equal(state.params[name], p.detach()), name
        assert torch.equal(dict(second.named_parameters())[name], p.detach()), name


def test_the_pure_and_lent_paths_agree_bitwise_with_from_torch():
    data = batches(3)
    opt = chain(clip_by_global_norm(0.5), from_torch(torch.optim.NAdam, lr=0.01, weight_decay=0.1))
    pure_net, lent_net = model(), model()
    pure_step, lent_step = make_step(pure_net, cross_entropy, opt), make_step(lent_net, cross_entropy, opt)
    pure, lent = init_state(pure_net, opt), init_state(lent_net, opt, copy=False)
    for b in data:
        pure, lent = pure_step(pure, b), lent_step(lent, b, donate=True)
    assert all(torch.equal(pure.params[k], lent.params[k]) for k in pure.params)
    assert all(
        torch.equal(pure.opt_state[1].slots[k][s], lent.opt_state[1].slots[k][s])
        for k in pure.params
        for s in pure.opt_state[1].slots[k]
    )


def test_from_torch_reports_the_learning_rate_it_used():
    opt = from_torch(torch.optim.RMSprop, lr=lambda step: 0.1 / (step + 1))
    net = model()
    state = make_step(net, cross_entropy, opt)(init_state(net, opt), batches(1)[0])
    assert state.metrics["learning_rate"].item() == pytest.approx(0.1)
    assert opt.learning_rate(state.opt_state) == pytest.approx(0.05)


def test_from_torch_refuses_what_is_not_a_torch_optimizer():
    with pytest.raises(TypeError, match="torch.optim.Optimizer class"):
        from_torch(torch.optim.lr_scheduler.StepLR, lr=0.1)


class _CountingSGD(torch.optim.SGD):
    """SGD that keeps a Python int in its state, as LBFGS keeps ``n_iter``: the step scales by it."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["calls"] = state.get("calls", 0) + 1
                if not isinstance(state["calls"], int):
                    raise TypeError(f"calls came back as {type(state['calls']).__name__}, torch keeps an int")
                p.add_(p.grad, alpha=-group["lr"] * state["calls"])


def test_a_fresh_from_torch_continues_a_started_state_with_torchs_python_numbers():
    p = {"w": torch.tensor([1.0, 2.0])}
    g = {"w": torch.tensor([1.0, -1.0])}
    opt = from_torch(_CountingSGD, lr=0.1)
    state = opt.init(p)
    one, state = opt.apply(g, state, p)
    again = from_torch(_CountingSGD, lr=0.1)  # another process: nothing learnt, no init called
    two, state2 = again.apply(g, state, one)
    ref, _ = opt.apply(g, state, one)
    assert torch.equal(two["w"], ref["w"]) and int(state2.slots["w"]["calls"].item()) == 2


def test_the_torch_engine_is_a_declared_holder_not_a_hidden_cache():
    import attrs

    from trainfold.optim.torch_optim import TorchEngine, TorchOptimizer

    opt = from_torch(torch.optim.SGD, lr=0.1)
    assert attrs.fields_dict(TorchOptimizer)["engine"].type in ("TorchEngine", TorchEngine)
    assert not any(f.name.startswith("_") for f in attrs.fields(TorchOptimizer))
    net = model()
    state = init_state(net, opt, copy=False)
    state = make_step(net, cross_entropy, opt)(state, batches(1)[0], donate=True)
    assert isinstance(opt.engine.optimizer, torch.optim.SGD)  # the live optimizer, where the record says it is
