"""The compiled paged step: a decode step of the direct paged forward (:mod:`.paged_direct`) as one ``torch.compile``
graph per row count (issue 30 item 3).

:func:`~kvslim.cache.paged_adapter.forward_pages` takes it when handed a :class:`CompiledStep` and every row of the
step feeds one token (a decode step; a prompt chunk steps eagerly, through the direct step). The rows are padded with
filler rows up to a *bucket* (the next power of two, at least the step's row multiple), so a step of 1, 2, 4, 8, 16,
... rows is one compiled graph, compiled once per bucket (tens of seconds for the embedded model on 2 threads, a few
for a tiny one; :attr:`CompiledStep.compile_s`), never again in steady state.

What is compiled: the direct step's calls, traced (the embedding, the rotary embedding, each layer's norms, the
model's own ``apply_rotary_pos_emb``, the activation, the residual sums, the final norm and the head), with two
opaque custom ops in the graph:

- ``torch.ops.kvslim.page_attend(q, k, v, handle, layer, scale)``: :meth:`PagePool.attend
  <kvslim.cache.pagepool.PagePool.attend>` of the step's pool and plan (set by :meth:`CompiledStep.run` under
  ``handle`` for the call; the graph never holds a pool), the step's K/V written to their pages, the C kernel's
  attention on the codes;
- ``torch.ops.kvslim.prepared_linear(x, weight, bias)``: kvslim's linear kernel (:class:`kvslim.kernels.linear.Prepared`,
  a row's bits its own at any row count), or torch's ``linear`` where that kernel does not take the weight.

Where kvslim's C++ ops build (:mod:`kvslim.kernels.cppops`; ``cpp_ops``), the graph holds their twins instead,
``kvslim_cpp::linear`` and ``kvslim_cpp::page_attend``: the same C calls on the same arguments, the same bits, with no
Python between torch's dispatcher and the C kernels (the attention's Python runs at a step's first layer only, where
it lays out the step's tables).

Inductor fuses the rest (a norm, RoPE, SiLU times the up product, the residual sums) into a few C++ loops a layer,
single-threaded (``cpp.threads`` 1: at a decode step's few rows a parallel region costs more than it saves, and the
kernels' workers own the cores). What that removes is the eager step's ~5,000 Python calls and ~600 small torch ops.

The wrapper: the code Inductor generates to call those loops and the ops, each step. ``wrapper="python"`` (the
default) is Python: ~6 ms of a one-row step on the embedded model went to it, torch's dispatch and the step's own
Python with the kernels' calls made no-ops. ``wrapper="cpp"`` is Inductor's ``cpp_wrapper``: the same graph called
from C++ (the two custom ops still reach their Python through torch's dispatcher), the same bits, a one-row step
4-6% faster on the embedded model, and each bucket's first compile ~2x as long (80-105 s against 30-55 s cold;
Inductor's on-disk cache makes a later process' compile of the same graph a few seconds either way; docs/compile.md).

Not bit for bit the eager step: Inductor's fused norms and RoPE round in their own order (the logits within ~1e-5 of
the eager step's on the embedded model; tests/test_paged_compiled.py checks a tiny model's greedy tokens and
logits against the eager step's, and a row's logits the same bits in a bucket of 1 and of 4). It serves the models
:func:`~kvslim.cache.paged_direct.why_not` serves, float32 or bfloat16, on CPU; :func:`why_not` says why not
otherwise, and :func:`~kvslim.cache.paged_adapter.forward_pages` then steps eagerly.

The engine (``Engine(pages=..., compile=True)``, ``kvslim serve --pages ... --compile``) steps its decode rows through it
and a prompt's chunks eagerly, in a forward of their own (:mod:`kvslim.engine.step`), so a row's tokens never depend
on what joined its step. This module knows nothing about page formats,
slots or rows (the pool's :meth:`~kvslim.cache.pagepool.PagePool.attend` does), nor about scheduling or sampling.
"""

from __future__ import annotations

import itertools
import threading
import time

import torch

from ..kernels import cppops
from ..kernels import linear as _kernel_linear
from ..kernels import ops as _kernel_ops  # noqa: F401  (defines the kvslim namespace)
from . import paged_direct

_LIB = torch.library.Library("kvslim", "FRAGMENT")
_LIB.define("page_attend(Tensor q, Tensor k, Tensor v, int handle, int layer, float scale) -> Tensor")
_LIB.define("prepared_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")

#: handle -> (pool, plan, the workers' spin renewer) of the step running under it
_steps: dict[int, tuple] = {}
#: what calls a graph's kernels and ops each step (:class:`CompiledStep`'s ``wrapper``): Inductor's generated Python,
#: or its generated C++ (Inductor's ``cpp_wrapper``)
WRAPPERS = ("python", "cpp")


def wrapper_of(compile: bool | str) -> str:
    """The wrapper a ``compile`` setting names: True (a compiled step, the default wrapper) is ``"python"``; a
    wrapper's name is itself."""
    return "python" if compile is True else compile


#: (weight address, dtype, shape, bias address) -> its Prepared, or False where kvslim's kernel does not take it
_prepared: dict[tuple, object] = {}
_handles = itertools.count(1)
_lock = threading.Lock()


def _page_attend(q, k, v, handle, layer, scale):
    pool, plan, renew, native = _steps[handle]
    renew()  # the pool's Python before its kernel call can outlast the workers' spin (paged_direct.RENEW)
    out = pool.attend(plan, layer, q, k, v, scale)
    calls = plan.calls
    if native and calls and calls.native_fields is None:  # the step's tables, laid out by this layer: the later
        fields = calls.native()  # layers' calls in C++ (handed over once a step)
        if fields is not None:
            cppops.step(handle, fields)
    return out


def _prepared_linear(x, weight, bias):
    key = (weight.data_ptr(), weight.dtype, tuple(weight.shape), 0 if bias is None else bias.data_ptr())
    p = _prepared.get(key)
    if p is None:
        p = _prepared[key] = _kernel_linear.Prepared.of(weight, bias) or False
    y = p(x) if p else None
    return torch.nn.functional.linear(x, weight, bias) if y is None else y


_LIB.impl("page_attend", _page_attend, "CPU")
_LIB.impl("prepared_linear", _prepared_linear, "CPU")


@torch.library.register_fake("kvslim::page_attend", lib=_LIB)
def _(q, k, v, handle, layer, scale):
    return q.new_empty(q.shape, dtype=torch.float32)


@torch.library.register_fake("kvslim::prepared_linear", lib=_LIB)
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _python_linear(module, x):
    return torch.ops.kvslim.prepared_linear(x, module.weight, module.bias)


def _cpp_linear(module, x):
    return torch.ops.kvslim_cpp.linear(x, module.weight, module.bias)


def _python_attend(*args):
    return torch.ops.kvslim.page_attend(*args)


def _cpp_attend(*args):
    return torch.ops.kvslim_cpp.page_attend(*args)


def _forward(
    model, modeling, handle: int, input_ids: torch.Tensor, positions: torch.Tensor, cpp: bool = False
) -> torch.Tensor:
    """:func:`paged_direct.step <kvslim.cache.paged_direct.step>`'s calls, every row kept, on the ops above (the C++
    ones where ``cpp``): (N, V)."""
    product, attend = (_cpp_linear, _cpp_attend) if cpp else (_python_linear, _python_attend)
    decoder = model.model
    hidden = decoder.embed_tokens(input_ids[None])  # (1, N, hidden)
    cos, sin = decoder.rotary_emb(hidden, position_ids=positions)
    cos, sin = cos[0], sin[0]
    h = hidden[0]
    n = h.shape[0]
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        x = layer.input_layernorm(h)
        d = attn.head_dim
        q = product(attn.q_proj, x).view(n, -1, d)
        k = product(attn.k_proj, x).view(n, -1, d)
        v = product(attn.v_proj, x).view(n, -1, d)
        q, k = modeling.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        out = attend(q, k, v, handle, attn.layer_idx, attn.scaling).to(q.dtype)
        h = h + product(attn.o_proj, out.reshape(n, -1))
        x = layer.post_attention_layernorm(h)
        h = h + product(mlp.down_proj, mlp.act_fn(product(mlp.gate_proj, x)) * product(mlp.up_proj, x))
    return product(model.lm_head, decoder.norm(h))


def why_not(model) -> str | None:
    """Why :class:`CompiledStep` does not serve ``model`` now, or None where it does."""
    reason = paged_direct.why_not(model)
    if reason is not None:
        return f"the direct paged step does not serve it: {reason}"
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.bfloat16):
        return f"its weights are {p.dtype} on {p.device.type}: the compiled paged step runs float32 or bfloat16 on CPU"
    return None


def bucket(rows: int, multiple: int = 1) -> int:
    """The compiled row count a step of ``rows`` decode rows is padded to: the next power of two, at least
    ``multiple`` (a power of two: the route's row multiple, 1 or 4)."""
    return max(1 << max(0, rows - 1).bit_length(), multiple)


class CompiledStep:
    """One model's compiled decode step, a graph per bucket of rows (module docstring). One step at a time: engines
    that share it on several threads take turns (a lock)."""

    #: compiled shapes a CompiledStep may hold (dynamo's recompile limit for its graphs)
    MAX_BUCKETS = 16

    def __init__(self, model, *, loop_threads: int = 1, wrapper: str = "python", cpp_ops: bool | None = None):
        if wrapper not in WRAPPERS:
            raise ValueError(f"kvslim: the compiled step's wrapper is one of {', '.join(WRAPPERS)}, got {wrapper!r}")
        if cpp_ops not in (None, True, False):
            raise ValueError(f"kvslim: cpp_ops is None (where they build), True or False, got {cpp_ops!r}")
        with torch.no_grad():  # (autograd's state is a step's, checked at each step)
            reason = why_not(model)
        if reason is not None:
            raise ValueError(f"kvslim: cannot compile the paged step: {reason}")
        family = paged_direct._family(model)
        with _lock:
            self.handle = next(_handles)
        self.model = model
        #: the code that calls the graph's kernels: Inductor's Python wrapper, or its C++ one (module docstring)
        self.wrapper = wrapper
        #: whether kvslim's linear kernel runs the products (a row's bits its own at any row count)
        self.own_products = _kernel_linear.ready(next(model.parameters()).dtype)
        #: whether the graph's products are the C++ op (``kvslim_cpp::linear``), else the Python one: the same C
        #: kernel, the same bits; the C++ op spares each call a trip into Python (:mod:`kvslim.kernels.cppops`)
        self.cpp_ops = bool(cpp_ops is not False and self.own_products and cppops.ready())
        if cpp_ops and not self.cpp_ops:
            why = cppops.status()[1] if not cppops.ready() else "kvslim's linear kernel does not run here"
            raise ValueError(f"kvslim: the compiled step's C++ ops are unavailable: {why}")
        if self.cpp_ops:
            cppops.bind()
        self.buckets: set[int] = set()
        self.compile_s = 0.0
        self._lock = threading.Lock()  # one step at a time: the handle's entry in _steps is one step's
        cpp = self.cpp_ops
        fn = lambda ids, pos: _forward(model, family[0], self.handle, ids, pos, cpp)  # noqa: E731
        # a code object of its own: dynamo keeps its graphs, guards and recompile limit per code object, so each
        # CompiledStep has its own (another model's step never evicts or counts against this one's)
        fn.__code__ = fn.__code__.replace()
        # loop_threads: Inductor's own loops' threads (1; -1: its OpenMP default; scripts/paged_compiled_ab.py).
        # size_asserts off: Inductor's wrapper otherwise checks the shape and strides of ~500 tensors a step in
        # Python (the custom ops' outputs among them: their fake and real shapes are one expression), ~0.7 ms a step
        # by cProfile's count; measured 0.4-0.8 ms, within this host's noise (docs/performance.md, "The compiled
        # step's fixed costs"). cpp_wrapper: the wrapper generated as C++ (module docstring)
        self._fn = torch.compile(
            fn, fullgraph=True, dynamic=False,
            options={"cpp.threads": loop_threads, "size_asserts": False, "cpp_wrapper": wrapper == "cpp"},
        )

    def rows_for(self, rows: int, multiple: int) -> int:
        """The bucket a step of ``rows`` decode rows runs at: the route's row ``multiple`` (filler rows for a product
        that rounds a row by the row count) applies only where torch's linear runs the products here."""
        return bucket(rows, 1 if self.own_products else multiple)

    def row_invariant(self) -> str | None:
        """Why a row's logits could depend on how many rows share its step here, or None where they cannot: every
        product of the graph runs kvslim's linear kernel (a row's bits its own at any row count). Where torch's
        ``linear`` runs one (the kernel not built, or a weight it does not take), its rounding may change with the
        bucket, and an engine refuses ``compile``."""
        if not self.own_products:
            return "kvslim's linear kernel does not run here (it needs AVX2 and FMA, and AVX512-BF16 for bfloat16)"
        linears = []
        for i, layer in enumerate(self.model.model.layers):
            for part, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
                linears += [(f"layer {i}'s {name}", getattr(part, name)) for name in names]
        linears.append(("the head's", self.model.lm_head))
        for what, module in linears:
            if not _kernel_linear.Prepared.of(module.weight, module.bias):
                return f"kvslim's linear kernel does not take {what} weight"
        return None

    @property
    def compiles(self) -> int:
        """Graphs compiled so far (one per bucket)."""
        return len(self.buckets)

    def warm(self, pool, rows: int, multiple: int = 1, progress=None) -> list[int]:
        """Compile now every bucket a decode step of 1 to ``rows`` rows runs at (a server's start-up: no request then
        waits for a compile), each on a step of one new row's first token and filler rows, abandoned: the row (and
        the page it took) goes back, nothing else in ``pool`` changes. Run it in the context the steps run in (grad
        mode, the linear route): dynamo's guards compare it. Returns the buckets compiled by this call, smallest
        first. progress: called ``(bucket, i, count)`` before each compile."""
        todo = sorted({self.rows_for(r, multiple) for r in range(1, rows + 1)} - self.buckets)
        done: list[int] = []
        if not todo:
            return done
        if len(self.buckets) + len(todo) > self.MAX_BUCKETS:
            raise ValueError(
                f"kvslim: the compiled paged step holds {self.MAX_BUCKETS} row counts; steps of up to {rows} rows "
                f"need {len(self.buckets) + len(todo)}"
            )
        row = pool.new_row()
        try:
            for n in todo:
                if progress is not None:
                    progress(n, len(done), len(todo))
                plan = pool.plan([row] + [None] * (n - 1), [1] * n)
                try:
                    self.run(pool, plan, torch.zeros(n, dtype=torch.long, device=plan.positions.device))
                finally:
                    pool.abandon(plan)
                done.append(n)
        finally:
            pool.free(row)
        return done

    def run(self, pool, plan, input_ids: torch.Tensor) -> torch.Tensor:
        """(N, V) logits of every token of the step (``input_ids`` (N,), N a bucket; one token a row) laid out by
        ``plan`` in ``pool``; the first call at a bucket compiles it."""
        n = int(input_ids.shape[0])
        with self._lock:
            new = n not in self.buckets
            if new and len(self.buckets) >= self.MAX_BUCKETS:
                raise RuntimeError(f"kvslim: the compiled paged step holds {self.MAX_BUCKETS} row counts already")
            _steps[self.handle] = (pool, plan, paged_direct.renewer(), self.cpp_ops)
            t0 = time.perf_counter()
            try:
                with torch._dynamo.config.patch(
                    recompile_limit=self.MAX_BUCKETS, fail_on_recompile_limit_hit=True
                ):
                    out = self._fn(input_ids, plan.positions)
            finally:
                if self.cpp_ops:  # (first: the C++ op must never read a step whose tables are gone)
                    cppops.end(self.handle)
                del _steps[self.handle]
            if new:
                self.buckets.add(n)
                self.compile_s += time.perf_counter() - t0
        return out
