"""The hook tier: ``loop.run(step, state, data, hooks=, stop=, output_dir=, resume=)``, a composed training run.

Between the bare fold (``fit``) and the HF-compatible run (``train``): your ``step`` (``make_step``'s, or your
own), your data, and hooks as values: ``every(n, fn)``, ``log``, ``evaluate``, ``save``, ``early_stop``. The
order in which they fire after a step is one table, ``EVENTS``. With ``output_dir`` the run owns the directory
(lock, identity, atomic verified checkpoints, log history, a checkpoint on SIGTERM) and ``resume=True``
continues bitwise from the newest intact checkpoint. No ``TrainingArguments`` anywhere.

>>> import torch
>>> from trainfold import loop
>>> from trainfold.core.state import init_state
>>> from trainfold.core.losses import cross_entropy
>>> from trainfold.optim import sgd
>>> from trainfold.step import make_step
>>> model = torch.nn.Linear(3, 2)
>>> batch = [{"input": torch.ones(4, 3), "labels": torch.tensor([0, 1, 1, 0])}]
>>> state, log = loop.run(make_step(model, cross_entropy, sgd(0.1)), init_state(model, sgd(0.1)), [batch] * 6,
...                       hooks=[loop.log(every=3), loop.evaluate(batch, every=3, model=model, loss=cross_entropy)])
>>> [sorted(e) for e in log.history][:2]
[['epoch', 'grad_norm', 'learning_rate', 'loss', 'step'], ['epoch', 'eval_loss', 'eval_token_loss', 'step']]
"""

from trainfold.loop.builtins import BEST, early_stop, evaluate, log, save
from trainfold.loop.hooks import EVENTS, Every, Hook, every
from trainfold.loop.record import STATUSES, RunLog
from trainfold.loop.run import run

__all__ = [
    "run",
    "RunLog",
    "Hook",
    "Every",
    "every",
    "log",
    "evaluate",
    "save",
    "early_stop",
    "EVENTS",
    "STATUSES",
    "BEST",
]
