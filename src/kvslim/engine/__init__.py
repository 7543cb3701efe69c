"""The batch engine: many requests, each in its own bounded, compressed cache, decoded together.

Three roles, kept apart as in vLLM: the :class:`~kvslim.engine.scheduler.Scheduler` decides which requests
run (admission under a memory budget, join and leave between steps, whose prompt gets the next prefill
chunk: the shortest left first, with aging); the :class:`~kvslim.engine.engine.Engine` runs a step — ONE forward
carrying every running row's token and the prompt chunks of joining requests (:mod:`~kvslim.engine.step`) —
through :mod:`kvslim.generate`, the only caller of the model, keeping each request's failures to that request;
:mod:`~kvslim.engine.gate` checks a model and each request before they are taken; each request's
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
