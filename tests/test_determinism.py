"""The kernel warm-up: what it runs, that it changes nothing a run reads, and that train calls it first."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import trainfold
from trainfold.core.determinism import DEFAULT_OPS, WARM_OPS, warm_up_kernels

# The reproduction: a fresh process's first tanh over 78 x 128 elements (split over the
# threads) against a later one, after the warm-up train runs.
FIRST_CALL = textwrap.dedent(
    """
    import torch
    from trainfold.core.determinism import warm_up_kernels
    torch.set_num_threads(2)
    warm_up_kernels()
    x = torch.randn(78, 128, generator=torch.Generator().manual_seed(0)) * 2
    y = torch.randn(78, 128, generator=torch.Generator().manual_seed(1))
    for op in (torch.tanh, torch.exp, torch.erf, torch.sin, torch.nn.functional.gelu, torch.nn.functional.silu):
        print(torch.equal(op(x), op(x)) and torch.equal(op(y), op(y)))
    """
)


def test_every_default_op_agrees_with_itself_on_the_threads_after_the_warm_up():
    report = warm_up_kernels(dtypes=(torch.float32, torch.bfloat16))
    assert report.ops == DEFAULT_OPS and report.dtypes == ("float32", "bfloat16")
    assert report.threads == torch.get_num_threads() and report.inconsistent == ()


def test_every_known_op_runs_forward_and_backward_in_every_float_dtype():
    report = warm_up_kernels(list(WARM_OPS), dtypes=(torch.float32, torch.bfloat16, torch.float64))
    assert set(report.ops) == set(WARM_OPS) and report.inconsistent == ()


def test_the_warm_up_leaves_the_global_rng_and_grad_mode_alone():
    rng = torch.random.get_rng_state()
    with torch.no_grad():
        warm_up_kernels(["tanh", "gelu"], dtypes=(torch.float64,))
        assert not torch.is_grad_enabled()
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_train_warms_up_before_its_first_step(tmp_path, monkeypatch):
    from resume_runs import run

    from trainfold.trainer import planning  # train sets the process's settings (process_settings): the warm-up

    order: list[str] = []
    monkeypatch.setattr(planning, "warm_up_kernels", lambda **kw: order.append(f"warm {kw}"))
    run(
        "tinylm",
        str(tmp_path),
        None,
        [lambda state, logs: order.append(f"step {int(state.step)}")],
        save_strategy="no",
        max_steps=2,
    )
    assert order[0] == "warm {'dtypes': (torch.float32,)}" and order[1:] == ["step 1", "step 2"]


def test_a_fresh_process_computes_its_first_calls_like_its_later_ones(full_slow):
    runs = 20 if full_slow else 2
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["True"] * 6


def test_it_is_exported_and_refuses_unknown_names():
    assert trainfold.warm_up_kernels is warm_up_kernels
    with pytest.raises(ValueError, match=r"unknown kernel names \['tanhh'\]; choose among WARM_OPS: \['acos'"):
        warm_up_kernels(["tanhh"])
