"""Which library runs a model's linear layers inside an engine step (and a single stream's, ``kvslim sample``):
torch's default (MKL on this CPU), oneDNN with the weights as they are or reordered ("packed") for it, MKL's packed
sgemm, or kvslim's own kernel.

Why. The engine's many-row step multiplies every row's hidden state by every weight matrix, ~211 products a
step for the embedded model, with 4 to a few hundred rows each. For that shape, torch's ``linear`` (MKL's
sgemm on a float32 CPU model) runs far below the machine's rates: at 16 rows the embedded model's
lm_head takes ~25 ms through MKL and ~14 ms through oneDNN on the same weights, and the step's products
~110 ms in all (docs/performance.md, "The weights' products"). oneDNN is inside every torch CPU wheel
(``torch.ops.mkldnn._linear_pointwise``, what torch.compile's CPU freezing path calls); kvslim routes a
step's fp32 CPU ``nn.Linear`` layers through it:

- ``onednn``: the weights as they are. No memory is added.
- ``packed``: each weight reordered once into oneDNN's blocked layout (``_reorder_linear_weight``), a second
  copy of every routed weight held beside the model's (:attr:`Linears.nbytes`). Faster again, at the cost of
  the weights' bytes once more: opt-in. A weight changed in place or replaced after packing is packed again
  before the next step (its version counter and address are checked), never used stale.
- ``mkl``: each weight packed once by MKL (``cblas_sgemm_pack``, through
  ``torch.ops.mkl._mkl_reorder_linear_weight``, what torch.compile's CPU freezing path uses for float32) for the
  engine's full step (``batch_hint``: :func:`step_rows` of its batch); a product of exactly that many rows runs
  MKL's packed sgemm (``torch.ops.mkl._mkl_linear``), any other row count torch's own ``linear`` on the model's
  weight. MKL's packed product rounds as its unpacked one (the same kernels, tested bit
  for bit on the model's shapes, tests/test_linears.py), so this route's bits are torch's route's: only the speed
  and the memory change. A second copy of the routed weights (the process grows by about their bytes: +514 MiB for
  the embedded model's 540 MiB; MKL reserves more address space than it touches, :attr:`Linears.nbytes` counts the
  weights' bytes). Opt-in, as ``packed``; a weight changed after packing is packed again, as there.
- ``kvslim``: kvslim's own linear (:mod:`kvslim.kernels.linear`, ``csrc/kvslim_linear.c``): each weight row dotted
  with the step's rows in registers, every output one dot product in one fixed order, so a row's bits are its own
  whatever rows share the product (by construction, at any row count, 1-3 included), the weights read by the
  kernel's own workers (a bounded spin, not an OpenMP region that ``OMP_WAIT_POLICY=PASSIVE`` puts to sleep between
  calls). Needs the C kernels built with AVX2 and FMA (or AVX-512); no memory added. The one route for a bfloat16
  model's layers too, where the CPU has AVX512-BF16 (``VDPBF16PS``, float32 sums rounded once to bfloat16:
  docs/performance.md, "kvslim's linear in bfloat16"). On an AMD EPYC (Zen 4) its pass
  over the embedded model's products is 2.1x torch's at one row, 1.8x at 16, 0.89x at 1,024 rows (oneDNN's: 1.2x,
  1.5x, 1.15x; docs/performance.md, "kvslim's linear layers").
- ``torch``: torch's own ``linear``, untouched.
- ``auto`` (the default of the engine, ``kvslim serve``, ``kvslim bench --concurrency`` and ``kvslim sample``): of
  the routes whose product rounds a row the same whatever the step's row count (checked once, on the model's own
  weights, :func:`rows_invariant`; kvslim's too, though it holds by construction), the fastest: ``torch`` unless
  another route's pass over the model's products at the step's rows is :data:`FASTER` times quicker (timed once,
  :func:`products_ms`, every candidate interleaved); ``torch`` where none keeps a row's bits (said in
  :attr:`Linears.reason`). A single stream (``single=True``: ``kvslim sample``) has no other rows to keep alike, so
  there it is speed alone, timed at the stream's one row. On an AVX-512-FP16 Xeon (Sapphire Rapids), where MKL rounds rows of 8, 12,
  16... differently from 4, it is oneDNN (0.98x of torch's step there, docs/performance.md, "The default route:
  rows bit for bit"); on an AMD EPYC (Zen 4), where MKL's sgemm runs far below oneDNN's and both keep a row's
  bits, oneDNN by speed ("The default route on an AMD CPU"); the AVX2 machines of earlier stops took torch before
  the speed rule and were not measured with it; on the AMD EPYC with kvslim's route beside them, kvslim's (its pass
  1.8x torch's at 16 rows, 1.2x oneDNN's). The routes round differently, so where the choice is made by timing, a
  request's exact bits follow the machine (and, near the margin, could follow its load at start-up): name a route
  to pin them.

Measured: docs/performance.md, "The weights' products" (torch, ``onednn``, ``packed``: the products 84-130 ms a
16-row step, a whole step within 0-11% of each other), "The default route on an AMD CPU" (MKL's products 1.4-1.8x
slower than oneDNN's at 4-64 rows) and "MKL's packed weights" (``mkl``: a whole step 0.97-1.03x torch's route).
``kvslim`` checks a weight once (:class:`kvslim.kernels.linear.Prepared`) and an input at every call.

Bit-identity. The engine's rows are bit for bit what they are in a step of their own because the library
rounds a row of a product the same whatever the row count, for multiples of 4 (:mod:`kvslim.cache.ragged`,
"Filler rows"). oneDNN's products keep that property on this machine (every multiple of 4 from 4 to 4,400
rows, 1 and 2 threads, the embedded model's shapes: ``python scripts/blas_row_invariance.py``), and the
engine's tests check the rows' logits across steps with the route on. A route's bits differ from torch's by
rounding (~1e-6 a product), so a request's greedy tokens match kvslim's single-stream loop (torch's route)
as closely as before, not by construction.

Scope. A route holds only inside :meth:`Linears.routed` (a context manager), and only for the thread (the
context) that entered it: the routed modules get a dispatching ``forward`` while some block is open (reference
counted, removed when the last one closes), which runs the route of the block open in the calling context and
torch's own forward everywhere else. So the model outside the engine's steps, and on any other thread (a
baseline measured in the same process, a user's own calls, a second engine with another route), runs as it
would without kvslim. Routed: plain ``nn.Linear`` modules (not a subclass with its own forward, not
parametrized) whose weight is a plain float32 CPU tensor (not a tensor subclass such as a DTensor); on kvslim's
route, bfloat16 too where the CPU has AVX512-BF16 (an input of another dtype than the weight's takes torch's
forward). A call takes
torch's own forward where its input is not a float32 CPU tensor, its bias is not contiguous, or autograd is
recording (oneDNN's op has no backward). A module with an instance ``forward`` of somebody else's is left
alone. The module knows nothing about caches or rows.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..generate import ROW_MULTIPLE
from .linear_probe import (
    DENSE_ROWS,
    PASSES,
    PROBE_ROWS,
    _kvslim_linear,
    products_ms,
    rows_invariant,
    step_rows,
)

__all__ = [
    "DENSE_ROWS", "PASSES", "PROBE_ROWS", "ROUTES", "Linears", "kvslim_ready", "mkl_ready", "onednn_ready",
    "products_ms", "rows_invariant", "step_rows",
]  # fmt: skip

#: the routes a user may ask for (module docstring)
ROUTES = ("auto", "torch", "onednn", "packed", "mkl", "kvslim")

#: how much faster oneDNN's products must be for ``auto`` to leave torch's route where both keep a row's bits: wide,
#: because the products alone overstate a whole step's gain (an AVX2 machine measured 1.14-1.46x on the products and
#: 0.95-1.04x on the step, docs/performance.md "The weights' products"; an AMD EPYC 1.43-1.47x and 1.07-1.19x), and
#: because the route decides a request's bits: a choice near the margin could flip between runs
FASTER = 1.25
#: the Linears whose block is open in this context (None: torch's own forward)
_ACTIVE: ContextVar = ContextVar("kvslim_linears", default=None)
#: id(module) -> [module, open blocks routing it]: the dispatching forwards installed
_INSTALLED: dict[int, list] = {}
_LOCK = threading.Lock()


def onednn_ready() -> bool:
    """Whether this torch can run a linear layer through oneDNN (``torch.ops.mkldnn._linear_pointwise``)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def mkl_ready() -> bool:
    """Whether this torch can pack a weight for MKL's sgemm and run it (``torch.ops.mkl._mkl_linear``)."""
    try:
        return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


def kvslim_ready(dtype: torch.dtype = torch.float32) -> bool:
    """Whether kvslim's own linear (:mod:`kvslim.kernels.linear`: the C kernels, built with AVX2 and FMA; in
    bfloat16, with AVX512-BF16) runs here for ``dtype``."""
    from ..kernels import linear

    try:
        return linear.ready(dtype)
    except Exception:  # noqa: BLE001 - no kernels (no compiler): not ready, never an error here
        return False


_BF16_READY = kvslim_ready  # (its own name: a test that stubs kvslim_ready() for float32 leaves bfloat16 be)
#: the dtypes a route takes: float32; kvslim's, bfloat16 too where the CPU has AVX512-BF16 (:func:`_dtypes`)
FP32 = (torch.float32,)


def _dtypes(route: str) -> tuple:
    return (torch.float32, torch.bfloat16) if route == "kvslim" and _BF16_READY(torch.bfloat16) else FP32


def _plain_cpu(t, dtypes=FP32) -> bool:
    """A plain (not a subclass such as a DTensor) strided CPU tensor or Parameter of one of ``dtypes``."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.dtype in dtypes
        and t.device.type == "cpu"
        and t.layout == torch.strided
    )


def _routable(module: torch.nn.Module, dtypes=FP32) -> bool:
    """A plain ``nn.Linear`` (a subclass with its own forward, such as an adapter layer, keeps it; so does a
    parametrized one) with a plain CPU weight of one of ``dtypes`` (float32; kvslim's route: bfloat16 too)."""
    return (
        isinstance(module, torch.nn.Linear)
        and type(module).forward is torch.nn.Linear.forward
        and not _parametrized(module)
        and _plain_cpu(module._parameters.get("weight"), dtypes)
    )


def _parametrized(module: torch.nn.Module) -> bool:
    """``torch.nn.utils.parametrize.is_parametrized(module)``, read from the module's registered children: that
    function's ``getattr`` misses through ``nn.Module.__getattr__`` on a plain module (an exception, ~3 us; 211 a
    step in :meth:`Linears.row_multiple`)."""
    if "parametrizations" in module.__dict__:
        return torch.nn.utils.parametrize.is_parametrized(module)
    found = module.__dict__.get("_modules", {}).get("parametrizations")
    return isinstance(found, torch.nn.ModuleDict) and len(found) > 0


def _products_covered(model, ids: set) -> bool:
    """Whether every weight product of ``model`` is one of the modules ``ids``: parameters of 2+ dims belong to them
    or to an embedding (not an expert's 3-D weights, a convolution, a custom linear), and no 2+-dim float weights, or
    integer ones named as weights, kept as buffers (a quantized linear's). Not seen: a product from another module's
    weight (a head tied by ``F.linear(h, embed.weight)``) or between activations."""
    for m in model.modules():
        if id(m) in ids:
            continue
        if not isinstance(m, torch.nn.Embedding) and any(p is not None and p.dim() >= 2 for p in m._parameters.values()):
            return False
        for name, b in m._buffers.items():
            if b is not None and b.dim() >= 2 and (b.is_floating_point() or "weight" in name or "scale" in name):
                return False
    return True


def _dispatcher(module: torch.nn.Linear):
    """The ``forward`` installed on a routed module: the route of the block open in the calling context, else
    the module's own forward."""
    stock = type(module).forward.__get__(module)
    key, params = id(module), module._parameters  # (the weight and bias without nn.Module.__getattr__: ~1 us each)

    def forward(x: torch.Tensor) -> torch.Tensor:
        route = _ACTIVE.get()
        if route is None:
            return stock(x)
        p = route._prepared.get(key)  # kvslim's route: the weight checked once (kernels.linear.Prepared)
        if p is not None and p.fits(params["weight"], params["bias"]) and (y := p(x)) is not None:
            return y
        return route._forward(module, x, stock)

    return forward


def _install(modules) -> list:
    """Give each module the dispatching forward (or count one more block on it); returns those handled."""
    done = []
    with _LOCK:
        for m in modules:
            mine = _INSTALLED.get(id(m))
            if mine is not None and mine[0] is m:
                mine[1] += 1
            elif "forward" in m.__dict__:  # somebody else's instance forward (a hook library): leave it be
                continue
            else:
                # (straight into the instance dict: nn.Module.__setattr__'s checks for parameters, buffers and
                # submodules cost ~4 us a module, 211 a step, and a function is none of them)
                m.__dict__["forward"] = _dispatcher(m)
                _INSTALLED[id(m)] = [m, 1]
            done.append(m)
    return done


def _uninstall(modules) -> None:
    with _LOCK:
        for m in modules:
            mine = _INSTALLED[id(m)]
            mine[1] -= 1
            if mine[1] == 0:
                del _INSTALLED[id(m)]
                m.__dict__.pop("forward", None)


def _version(w: torch.Tensor):
    try:
        return w._version
    except RuntimeError:  # an inference tensor keeps no version counter: identity and address only
        return None


class Linears:
    """How ``model``'s linear layers run inside :meth:`routed` (module docstring). route: one of
    :data:`ROUTES`; ``batch_hint``: the row count the packed weights are chosen for (``packed``: every row count is
    computed, this one fastest; ``mkl``: the only row count its packed weights serve, the others take torch's
    ``linear``). Raises ValueError for an unknown route, for ``onednn``/``packed`` where torch has no oneDNN, for
    ``mkl`` where it has no MKL, and where the model has no layer the route can take (a bfloat16 or GPU model:
    nothing would change). Reads the model; changes nothing until :meth:`routed`."""

    def __init__(self, model, route: str = "auto", *, batch_hint: int = 16, single: bool = False):
        if route not in ROUTES:
            raise ValueError(f"linears must be one of {', '.join(ROUTES)}, got {route!r}")
        #: what was asked (``auto`` or a route) and, for ``auto``, why it chose what it did
        self.asked, self.reason = route, ""
        if route == "auto":
            route, self.reason = _choose(model, int(batch_hint), single)
        if route in ("onednn", "packed") and not onednn_ready():
            raise ValueError(
                f"linears={route!r} needs torch's oneDNN (torch.backends.mkldnn), which this torch does not have; "
                "use 'torch'"
            )
        if route == "kvslim" and not kvslim_ready():
            raise ValueError(
                "linears='kvslim' needs kvslim's C kernels built with AVX2 and FMA (or AVX-512), which this machine "
                "or build does not have; use 'torch'"
            )
        if route == "mkl" and not mkl_ready():
            raise ValueError("linears='mkl' needs torch built with MKL (torch.backends.mkl), which this torch is not; use 'torch'")
        self.route = route
        self.batch_hint = int(batch_hint)
        self.dtypes = _dtypes(route)
        self.modules = [] if route == "torch" else [m for m in model.modules() if _routable(m, self.dtypes)]
        if route != "torch" and not self.modules:
            p = next(iter(model.parameters()), None)
            kinds = "float32 or bfloat16" if len(self.dtypes) > 1 else "float32"
            raise ValueError(
                f"linears={route!r} routes {kinds} CPU nn.Linear layers, and this model has none "
                f"({'no parameters' if p is None else f'{p.dtype} on {p.device}'}); use 'torch'"
            )
        self._ids = {id(m) for m in self.modules}
        self._every = route == "kvslim" and _products_covered(model, self._ids)
        self._packed: dict[int, tuple[torch.Tensor, tuple, int]] = {}  # id(module) -> (packed, key, bytes)
        self._prepared: dict = {}  # id(module) -> kernels.linear.Prepared (or None): kvslim's route
        self._multiple: int | None = None  # row_multiple's answer in the open block (routed)
        if route in ("packed", "mkl"):
            with torch.no_grad():
                for m in self.modules:
                    self._pack(m)

    def __repr__(self) -> str:
        return f"Linears(route={self.route!r}, asked={self.asked!r}, modules={len(self.modules)}, nbytes={self.nbytes})"

    def __str__(self) -> str:
        extra = f", {self.nbytes / 2**20:.0f} MiB packed beside the model" if self.route in ("packed", "mkl") else ""
        why = f"; auto: {self.reason}" if self.asked == "auto" else ""
        return f"linear layers: {self.route} ({len(self.modules)} routed{extra}{why})"

    @staticmethod
    def _key(module) -> tuple:
        w = module.weight
        return (id(w), w.data_ptr(), _version(w), tuple(w.shape))

    def _pack(self, module) -> torch.Tensor:
        w = module.weight.detach()
        if self.route == "mkl":  # MKL reserves more than it fills: the weight's bytes are what the process grows by
            p, nbytes = torch.ops.mkl._mkl_reorder_linear_weight(w, self.batch_hint), w.numel() * w.element_size()
        else:
            p = torch.ops.mkldnn._reorder_linear_weight(w, self.batch_hint)
            nbytes = int(torch.ops.mkldnn._nbytes(p))
        self._packed[id(module)] = (p, self._key(module), nbytes)
        return p

    def _weight(self, module) -> torch.Tensor:
        """The weight oneDNN gets: the module's own, or its packed copy (packed again if the weight changed in
        place or was replaced since it was packed)."""
        if self.route not in ("packed", "mkl"):
            return module.weight
        p, key, _ = self._packed[id(module)]
        if key != self._key(module):
            with torch.no_grad():
                p = self._pack(module)
        return p

    def _forward(self, module, x: torch.Tensor, stock) -> torch.Tensor:
        w, bias = module.weight, module.bias  # (the dispatcher tried this module's Prepared first)
        usable = (
            id(module) in self._ids
            and x.dtype == w.dtype
            and _plain_cpu(x, self.dtypes)
            and _plain_cpu(w, self.dtypes)
            and (bias is None or (bias.dtype == w.dtype and _plain_cpu(bias, self.dtypes) and bias.is_contiguous()))
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        )
        if not usable:
            return stock(x)
        if self.route == "mkl":  # MKL's packed sgemm at batch_hint rows (x flattened to rows), torch's linear else
            if x.dim() == 0 or x.shape[-1] != w.shape[1] or x.numel() // max(1, x.shape[-1]) != self.batch_hint:
                return stock(x)  # (a width that does not fit: torch's own error, never a read past x)
            return torch.ops.mkl._mkl_linear(x, self._weight(module), w, bias, self.batch_hint)
        if self.route == "kvslim":
            if x.dim() == 0 or x.shape[-1] != w.shape[1]:
                return stock(x)  # torch's own error
            self._prepared[id(module)] = _kvslim_linear().Prepared.of(w, bias)
            return _kvslim_linear().linear(x, w, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._weight(module), bias, "none", [], "")

    def row_multiple(self) -> int:
        """What a step's tokens are padded to with filler rows (:mod:`kvslim.cache.ragged`, "Filler rows"), called
        inside :meth:`routed`: 1 where every weight product of the model runs kvslim's kernel now (a row's bits its
        own at any row count: a step of 1-3 rows needs no filler), else 4 (:data:`kvslim.generate.ROW_MULTIPLE`).
        Looked at once a block (:meth:`routed`): every module checked costs ~0.7 ms, a step's share at one row."""
        if not (self._every and _ACTIVE.get() is self):
            return ROW_MULTIPLE
        if self._multiple is None:
            self._multiple = 1 if all(self._runs(m) for m in self.modules) else ROW_MULTIPLE
        return self._multiple

    def _runs(self, module) -> bool:
        """Whether ``module``'s products run this (kvslim's) route now: its dispatching forward installed, and its
        weight and bias still what :meth:`_forward` takes (not replaced by another dtype or device since)."""
        bias = module._parameters.get("bias")  # (not module.bias: nn.Module.__getattr__'s slow path, 211 a step)
        return (
            _INSTALLED.get(id(module), (None,))[0] is module
            and _routable(module, self.dtypes)
            and (bias is None or (bias.dtype == module.weight.dtype and _plain_cpu(bias, self.dtypes) and bias.is_contiguous()))
        )

    @property
    def nbytes(self) -> int:
        """Bytes this object holds beside the model: the packed weights (0 for the other routes)."""
        return sum(b for _, _, b in self._packed.values())

    @contextmanager
    def routed(self):
        """Within the block, and in the calling thread (context) only, the routed modules run this route
        (``torch``: their own forward, whatever an outer block routes)."""
        token = _ACTIVE.set(self)
        handled = _install(self.modules)
        self._multiple = None  # row_multiple's answer, looked at again in this block
        try:
            yield self
        finally:
            _uninstall(handled)
            _ACTIVE.reset(token)


#: what the route is called in ``auto``'s reasons
_NAMES = {"torch": "torch", "onednn": "oneDNN", "kvslim": "kvslim"}


def _choose(model, rows: int, single: bool = False) -> tuple[str, str]:
    """``auto``'s route for ``model`` at steps of up to ``rows`` rows (``single``: one stream's steps of ``rows``
    rows, whose bits never meet another row's: speed alone), and why (module docstring)."""
    modules = [m for m in model.modules() if _routable(m, _dtypes("kvslim"))]
    if not modules:
        return "torch", "no float32 CPU linear layer to route (nor a bfloat16 one on a CPU with AVX512-BF16)"
    ready = [r for r, ok in (("onednn", onednn_ready), ("kvslim", kvslim_ready)) if ok()]
    if any(m.weight.dtype != torch.float32 for m in modules):  # bfloat16: kvslim's route alone takes it
        ready = [r for r in ready if r == "kvslim"]
    if single:
        torch_ok, candidates, alike = True, ready, "one stream"
    else:
        torch_ok = rows_invariant(modules, "torch", rows)
        candidates = [r for r in ready if rows_invariant(modules, r, rows)]
        alike = "torch's linear rounds a row alike at every step size here"
    if not candidates:
        if torch_ok:
            return "torch", f"{alike}, and no other route {'runs' if single or not ready else 'does'} here"
        if not ready:
            return "torch", "torch's linear rounds a row differently by the step's size here, and no other route runs here"
        return "torch", "no route rounds a row alike at every step size here"
    timed = products_ms(modules, rows, ("torch", *candidates) if torch_ok else tuple(candidates), exact=single)
    n = rows if single else step_rows(rows)
    speeds = f"a step's products at {n} row{'s' * (n != 1)}: " + ", ".join(
        f"{_NAMES[r]} {t:.1f} ms" for r, t in sorted(timed.items(), key=lambda kv: kv[1])
    )
    fastest = min(candidates, key=timed.get)
    if not torch_ok:
        return fastest, f"torch's linear (MKL) rounds a row differently by the step's size here; {_NAMES[fastest]} does not ({speeds})"
    if timed[fastest] * FASTER <= timed["torch"]:
        why = "one stream" if single else f"{_NAMES[fastest]} and torch both round a row alike at every step size here"
        return fastest, f"{why}, and {_NAMES[fastest]} is faster ({speeds})"
    return "torch", f"{alike}, and no other route is {FASTER:.2f}x faster ({speeds})"
