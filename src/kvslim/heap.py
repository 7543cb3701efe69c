"""Python's garbage collector in a long-running kvslim process (``kvslim serve``, ``kvslim bench --concurrency``):
the startup heap frozen out of its passes, and its pauses recorded.

Why. CPython's cyclic collector runs a pass over a generation when enough container objects were allocated
since the last one. A decode step allocates thousands (views, tuples, the rows' records): one or two youngest-
generation passes a step of the embedded model at 16 rows. Every ~40-150 steps the collector also runs a full
pass over the oldest generation, which holds everything the process built at startup: the model's modules and
parameters, transformers' and torch's Python objects, ~424,000 tracked objects in a 16-stream engine. That pass
took ~190-230 ms on this machine, as long as a step: that step took twice as long, a stream's worst inter-token
latency (docs/performance.md, "Garbage collection pauses"). None of those startup objects is garbage; the pass
finds nothing to free among them.

:func:`freeze_startup_heap` collects once and then moves every tracked object into the permanent generation
(``gc.freeze()``), which the collector's passes skip; objects made later (caches, requests, sessions) are
collected as before. vLLM does the same after its start-up (``vllm.utils.gc_utils.freeze_gc_heap``). The cost:
an object frozen here that later becomes part of unreachable cycles is never freed by the collector (reference
counting still frees what holds no cycle). Call it once, after the model is loaded and the engine built, before
traffic: the CLI does (``--gc-freeze on``, the default; ``off`` leaves the collector as Python sets it).

:class:`GcPauses` records the collector's passes (``gc.callbacks``): how many per generation and how long they
took, for a bench's report.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import time

#: --gc-freeze choices
FREEZE_CHOICES = ("on", "off")


def freeze_startup_heap() -> int:
    """Collect every generation, then freeze what is left (``gc.freeze()``): those objects are skipped by the
    collector's passes from now on. Returns how many objects are frozen in all (``gc.get_freeze_count()``).

    At exit they are unfrozen again (``atexit``), so that the interpreter's last collection reaches them as it
    would have (an extension that counts its objects at shutdown, such as Triton's nanobind bindings, would
    otherwise report every frozen one as leaked)."""
    gc.collect()
    gc.freeze()
    if not _AT_EXIT:
        atexit.register(gc.unfreeze)
        _AT_EXIT.append(True)
    return gc.get_freeze_count()


_AT_EXIT: list = []  # whether the unfreeze at exit is registered (once a process)


def add_gc_flag(parser: argparse.ArgumentParser) -> None:
    """``--gc-freeze {on,off}`` for ``kvslim serve`` and ``kvslim bench``."""
    parser.add_argument(
        "--gc-freeze",
        default="on",
        choices=FREEZE_CHOICES,
        help="freeze the startup heap (the model, the libraries) out of Python's garbage collector passes once the "
        "engine is built (on, the default: a full pass over it took ~190-230 ms every ~40-150 16-row steps) or "
        "leave the collector as Python sets it (off); docs/performance.md, 'Garbage collection pauses'",
    )


def apply_gc_flag(choice: str) -> str:
    """Carry out ``--gc-freeze``; returns a banner phrase saying what was done."""
    if choice == "off":
        return "gc: the collector as Python sets it (--gc-freeze off)"
    return f"gc: {freeze_startup_heap():,} startup objects frozen out of the collector's passes"


class GcPauses:
    """The collector's passes while recording: ``counts[g]`` passes over generation ``g`` and ``seconds[g]`` their
    time, and ``longest`` (seconds). Records between :meth:`start` and :meth:`stop` (also a context manager)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = 0.0
        self._began: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is None:  # recording started inside a pass
            return
        took = time.perf_counter() - self._began
        self._began = None
        g = min(max(int(info.get("generation", 2)), 0), 2)
        self.counts[g] += 1
        self.seconds[g] += took
        self.longest = max(self.longest, took)

    def start(self) -> GcPauses:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        self._began = None

    def __enter__(self) -> GcPauses:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def to_dict(self) -> dict:
        return {
            "passes": list(self.counts),
            "ms": [round(s * 1e3, 3) for s in self.seconds],
            "longest_ms": round(self.longest * 1e3, 3),
            "frozen_objects": gc.get_freeze_count(),  # now: what the passes skipped (this process's)
        }
