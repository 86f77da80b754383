"""``trainfold.preempt``: :mod:`trainfold.core.preempt` under its top-level name.

Preemption: the SIGTERM/SIGINT guard a run trains under, the stop flag, and
``ignore_signals_until_exit`` for a job script whose run is over.
"""

from trainfold.core.preempt import *  # noqa: F403
from trainfold.core.preempt import __all__  # noqa: F401
