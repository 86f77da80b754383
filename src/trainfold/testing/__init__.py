"""Tools for testing code built on trainfold: Hypothesis strategies, and ranks simulated by threads.

Needs ``hypothesis`` (the ``test`` extra). Each strategy is a function returning a
``SearchStrategy``; use them with ``@given``::

    from hypothesis import given
    from trainfold.testing import label_tensors, sampler_configs

    @given(label_tensors())
    def test_my_loss_ignores_padding(labels):
        ...

    @given(sampler_configs(strategies=["batch_rebalance"]))
    def test_every_sample_once(sampler):
        ...

``on_simulated_ranks(world_size, fn)`` runs ``fn(collective)`` on threads that stand for ranks, so
a distributed path (``make_step(collective=...)``, ``evaluate_batches``) is tested in one process;
``saved_for_backward(fn)`` measures the activations autograd keeps while ``fn`` runs.
``check_resume("my_run.py:run", stop_at=k)`` checks that your own run, stopped by SIGTERM at step
``k`` and resumed in a fresh process, ends bitwise equal to the same run never stopped.

The examples are random, so the docstrings show deterministic facts about them: the minimal
example ``hypothesis.find`` shrinks to, or a property checked by a small ``@given`` test:

>>> from hypothesis import Phase, find, given, settings
>>> quick = settings(max_examples=5, database=None, deadline=None, phases=[Phase.generate, Phase.shrink])
>>> find(uniform_lengths(min_size=2), lambda xs: True, settings=quick)
[1, 1]
"""

from trainfold.testing.memory import saved_for_backward
from trainfold.testing.ranks import SimulatedRank, on_simulated_ranks
from trainfold.testing.resume import ResumeCheck, check_resume, compare_results, dump_result
from trainfold.testing.strategies import (
    label_tensors,
    lengths,
    sampler_configs,
    skewed_lengths,
    tensor_dicts,
    token_items,
    uniform_lengths,
)

__all__ = [
    "ResumeCheck",
    "SimulatedRank",
    "check_resume",
    "compare_results",
    "dump_result",
    "label_tensors",
    "lengths",
    "on_simulated_ranks",
    "sampler_configs",
    "saved_for_backward",
    "skewed_lengths",
    "tensor_dicts",
    "token_items",
    "uniform_lengths",
]
