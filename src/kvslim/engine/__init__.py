"""The batch engine: many requests, each in its own bounded, compressed cache, decoded together.

Three roles, kept apart as in vLLM: the :class:`~kvslim.engine.scheduler.Scheduler` decides which requests
run (admission under a memory budget, join and leave between steps, whose prompt is prefilled next); the
:class:`~kvslim.engine.engine.Engine` runs a step (one prefill chunk of a joining request, then one ragged
decode step of every running row) through :mod:`kvslim.generate`, the only caller of the model; each
request's :class:`~kvslim.SlimCache` owns its memory. This package knows no HTTP and no tokenizer: requests
are token ids in, token ids out.
"""

from .engine import Engine
from .request import Event, Request, Result

__all__ = ["Engine", "Event", "Request", "Result"]
