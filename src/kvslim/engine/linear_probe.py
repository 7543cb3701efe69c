"""Whether a route of :mod:`kvslim.engine.linears` keeps a row's bits at every step size, and how fast its pass
over a model's products is: the measurements ``auto`` chooses a route from, made once per process on the model's own
weights (in their dtype: float32, or bfloat16 for kvslim's route), and remembered.

This module knows nothing about caches, rows' requests or the routes' installation.
"""

from __future__ import annotations

import time

import torch

#: The step sizes :func:`rows_invariant` compares rows at, beside every multiple of 4 up to the step's rows (up to
#: 64, then the step's rows themselves): a mixed step carries a prompt chunk's tokens too (a row each; 256 by
#: default beside 16 decode rows), sampled here.
PROBE_ROWS = (36, 64, 132, 272, 516)
#: the multiples of 4 compared one by one up to here; past it, the step's rows and PROBE_ROWS
DENSE_ROWS = 64


def step_rows(rows: int) -> int:
    """The rows of an engine step that carries ``rows`` one-token rows: padded to a multiple of 4, at least 4
    (:mod:`kvslim.cache.ragged`, "Filler rows"); the ``batch_hint`` that makes the ``mkl`` route serve that step.
    Where the step is not padded (:meth:`Linears.row_multiple` 1, kvslim's route) ``auto`` still times the routes at
    these rows: a step of 1-3 rows then runs fewer than it timed."""
    return max(4, -(-int(rows) // 4) * 4)


def rows_invariant(modules, route: str, rows: int) -> bool:
    """Whether ``route``'s product (``torch``, ``onednn`` or ``kvslim``, as :class:`Linears` runs it) gives the rows of every
    distinct weight shape of ``modules`` (routable ``nn.Linear``) the same bits in a step of the sizes the engine
    makes as in a step of 4 rows, at the current thread count: at every multiple of 4 up to :func:`step_rows` of
    ``rows`` (at most :data:`DENSE_ROWS`), at the step's rows and at :data:`PROBE_ROWS` (a sample: a mixed step's
    sizes between them, and past 516 rows, are not checked), the first, a middle and the last 4 rows of each size.
    Measured on each shape's (and dtype's) first module's own weight with seeded inputs of its dtype; remembered per
    process (shapes, dtypes, sizes, threads and route)."""
    top = step_rows(rows)
    sizes = sorted({*range(4, min(top, DENSE_ROWS) + 1, 4), top, *PROBE_ROWS})
    first: dict = {}
    for m in modules:
        first.setdefault((tuple(m.weight.shape), str(m.weight.dtype)), m)
    key = (route, tuple(sorted(first)), tuple(sizes), torch.get_num_threads())
    if key not in _PROBED:
        _PROBED[key] = _probe(first.values(), route, sizes)
    return _PROBED[key]


_PROBED: dict = {}

#: timed passes over the model's products per route (interleaved; the fastest counts), fewer where a pass is long
PASSES = 3


def products_ms(modules, rows: int, routes=("torch", "onednn"), *, exact: bool = False) -> dict[str, float]:
    """Milliseconds of one pass over ``modules``' products (every routable ``nn.Linear``, in order, each weight
    streamed from memory as in a step) at :func:`step_rows` of ``rows`` rows (``exact``: ``rows`` itself, a single
    stream's step) through each of ``routes`` (``torch``, ``onednn``, ``kvslim``): ``{route: ms}``, the fastest of
    :data:`PASSES` passes each, the routes interleaved (their order rotating) so that a busy stretch of the machine
    slows all alike, after one untimed product through each, on inputs of each weight's dtype. Remembered per process
    (shapes, dtypes, rows, threads)."""
    n = int(rows) if exact else step_rows(rows)
    routes = tuple(routes)
    key = (
        "speed",
        tuple((tuple(m.weight.shape), m.weight.dtype) for m in modules),
        n,
        routes,
        torch.get_num_threads(),
    )
    if key not in _PROBED:
        g = torch.Generator().manual_seed(0)
        xs = {
            (w, d): torch.randn(n, w, generator=g).to(d)
            for w, d in {(m.weight.shape[1], m.weight.dtype) for m in modules}
        }
        calls = [
            (
                xs[m.weight.shape[1], m.weight.dtype],
                m.weight.detach(),
                None if m.bias is None else m.bias.detach().contiguous(),
            )
            for m in modules
        ]
        best = dict.fromkeys(routes, float("inf"))
        with torch.no_grad():
            for route in routes:  # untimed: each library's first call (its kernels, first touches)
                _product(route, *calls[0])
            for i in range(PASSES):
                for route in routes[i % len(routes) :] + routes[: i % len(routes)]:
                    t = time.perf_counter()
                    for args in calls:
                        _product(route, *args)
                    best[route] = min(best[route], (time.perf_counter() - t) * 1e3)
                if max(best.values()) > 1000:  # a large model: one pass each is measurement enough
                    break
        _PROBED[key] = best
    return dict(_PROBED[key])


def _product(route: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if route == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    if route == "kvslim":
        return _kvslim_linear().linear(x, w, bias)
    return torch.nn.functional.linear(x, w, bias)


def _kvslim_linear():
    """:mod:`kvslim.kernels.linear`, imported on first use (the kernels' package is not imported with this module)
    and kept: a step calls it ~211 times."""
    mod = _LINEAR.get("mod")
    if mod is None:
        from ..kernels import linear as mod

        _LINEAR["mod"] = mod
    return mod


_LINEAR: dict = {}


def _probe(modules, route: str, sizes) -> bool:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in modules:
            w, bias = m.weight.detach(), None if m.bias is None else m.bias.detach().contiguous()
            x = torch.randn(max(sizes), w.shape[1], generator=g).to(w.dtype)
            alone: dict = {}  # block start -> its 4 rows out of a step of 4 (the engine's smallest)
            for n in sizes:
                if n <= 4:
                    continue
                out = _product(route, x[:n], w, bias)
                for i in (
                    0,
                    n // 8 * 4,
                    n - 4,
                ):  # the first, a middle and the last 4 rows: a row's place counts too
                    if i not in alone:
                        alone[i] = _product(route, x[i : i + 4], w, bias)
                    if not torch.equal(out[i : i + 4], alone[i]):
                        return False
    return True
