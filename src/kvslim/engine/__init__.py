"""The batch engine: many requests, each in its own bounded, compressed cache, decoded together.

Three roles, kept apart as in vLLM: the :class:`~kvslim.engine.scheduler.Scheduler` decides which requests
run (admission under a memory budget, join and leave between steps, whose prompt gets the next prefill
chunk: the shortest left first, with aging); the :class:`~kvslim.engine.engine.Engine` runs a step (one prefill chunk of a
joining request, then one ragged decode step of every running row) through :mod:`kvslim.generate`, the only
caller of the model, keeping each request's failures to that request; each request's
:class:`~kvslim.SlimCache` owns its memory. :mod:`~kvslim.engine.errors` types the refusals. This package
knows no HTTP and no tokenizer: requests are token ids in, token ids out.
"""

from .engine import Engine
from .errors import (
    BudgetRefusal,
    ContextRefusal,
    InputRefusal,
    QueueFull,
    Refusal,
    RequestLimits,
    SettingsRefusal,
    ShuttingDown,
)
from .request import Event, Request, Result

__all__ = [
    "BudgetRefusal",
    "ContextRefusal",
    "Engine",
    "Event",
    "InputRefusal",
    "QueueFull",
    "Refusal",
    "Request",
    "RequestLimits",
    "Result",
    "SettingsRefusal",
    "ShuttingDown",
]
