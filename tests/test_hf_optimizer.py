"""optim= in TrainingArguments: every HF OptimizerNames value either builds torch's (or transformers') optimizer
or is refused by name with the fix."""

from __future__ import annotations

import pytest
import torch

from trainfold.optim import AdamState, SgdState, TorchOptState
from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.optimizer import OPTIMIZERS, REFUSED, default_optimizer

OptimizerNames = pytest.importorskip("transformers.training_args").OptimizerNames
HF_NAMES = sorted(o.value for o in OptimizerNames)

# what each supported name must run: the state record our optimizer keeps, and torch's class where from_torch runs it
EXPECTED = {
    "adamw_torch": (AdamState, None),
    "adamw_torch_fused": (AdamState, None),
    "sgd": (SgdState, None),
    "adagrad": (TorchOptState, "Adagrad"),
    "rmsprop": (TorchOptState, "RMSprop"),
    "adafactor": (TorchOptState, "Adafactor"),
}


def test_every_hf_name_is_supported_or_refused_and_nothing_else():
    assert sorted(OPTIMIZERS) == sorted(EXPECTED)
    assert sorted([*OPTIMIZERS, *REFUSED]) == HF_NAMES  # complete, and no name on both lists


@pytest.mark.parametrize("name", HF_NAMES)
def test_each_hf_optim_name_builds_its_optimizer_or_is_refused_with_the_fix(name):
    if name in REFUSED:
        with pytest.raises(ValueError, match=rf"optim={name!r} is not supported: .*from_torch\(TheOptimizerClass"):
            TrainingArguments(optim=name)
        return
    model = torch.nn.Linear(3, 2)
    args = TrainingArguments(optim=name, learning_rate=0.1, max_grad_norm=0)
    opt = default_optimizer(model, args.optimizer_settings(), total_steps=10)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = opt.init(params)
    record, cls = EXPECTED[name]
    assert isinstance(state, record)
    if cls is not None:
        assert opt.cls.__name__ == cls
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    new, _ = opt.apply(grads, state, params)
    assert all(not torch.equal(new[k], params[k]) for k in params)  # it learns from a gradient
    assert opt.learning_rate(state) == pytest.approx(0.1)


def test_adamw_torch_fused_runs_torchs_fused_kernel_and_adamw_torch_its_default():
    model = torch.nn.Linear(3, 2)
    names = ("adamw_torch_fused", "adamw_torch")
    fused, default = (
        default_optimizer(model, TrainingArguments(optim=o, max_grad_norm=0).optimizer_settings(), 10) for o in names
    )
    assert (fused.kernel.fused, default.kernel.fused, default.kernel.foreach) == (True, None, None)
