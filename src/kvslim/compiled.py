"""A compiled decode step: the model's forward for one new token per row, through ``torch.compile``.

:func:`compile_decode` marks a model: from then on every one-token forward :func:`kvslim.generate.forward`
makes through a *compileable* cache (a :class:`~kvslim.StaticSlimCache`, or transformers' ``StaticCache``)
runs a compiled graph instead of the eager forward — gpt-fast's recipe (a static cache, one compiled
``decode_one_token``) behind kvslim's one decode loop. Prefill stays eager (its cost is the matmuls, and its
shape changes with every prompt).

The graph is traced with ``fullgraph=True`` and ``dynamic=False``: a graph break is an error, never a silent
fallback to eager, and each new shape (batch, cache configuration) compiles once. kvslim's kernels enter
the graph as custom ops (:mod:`kvslim.kernels.ops`). :class:`CompiledDecode` counts the compilations and
the seconds they took (the first call of each shape), so a caller can report them.

What it does not compile: a cache that is not compileable (a :class:`~kvslim.SlimCache` grows and re-slices
its buffers; DynamicCache grows) — :func:`check_compileable` says why in one line — and forwards of more
than one token per row or with an attention mask (padding).
"""

from __future__ import annotations

import time
import types
import warnings
import weakref
from dataclasses import dataclass, field

import torch

_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SERIAL = [0]
#: Graphs one compiled model may hold (one per shape: batch, cache options); torch's default is 8. Past it a
#: step is an error (fullgraph), never a silent fallback to eager.
RECOMPILE_LIMIT = 64
#: Inductor options of the compiled step. ``emulate_precision_casts``: a cast to float16 inside a fused kernel
#: rounds as the eager cast does (by default Inductor may keep the wider value), so the scales and zeros the
#: encoders round to float16 -- and so the codes -- are the eager ones.
OPTIONS = {"emulate_precision_casts": True}

_INDUCTOR_MM = _INDUCTOR_ADDMM = None  # Inductor's own decompositions of mm/addmm, set by _decompositions()


def _gemv_mm(mat1: torch.Tensor, mat2: torch.Tensor, out_dtype=None):
    """``aten.mm`` of one row on the CPU as a fused multiply-and-sum (gpt-fast's matrix-vector form).

    A decode step's matmuls are matrix-vector products (one token per row), bound by reading the weights. At
    two threads MKL's ``sgemv`` reads them at ~10 GB/s; the reduction Inductor generates for
    ``(x.T * W.T).sum(0)`` reads at ~23 GB/s, the machine's streaming rate. Inductor does this rewrite on
    GPUs (``coordinate_descent_tuning``), not on the CPU. The sum accumulates in float32, as the
    matmul does; only the order of the additions differs. Anything else (more rows, mixed dtypes, an
    ``out_dtype``, another device) keeps Inductor's own lowering."""
    if (
        out_dtype is None
        and mat1.device.type == "cpu"
        and mat1.dtype == mat2.dtype
        and mat1.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and mat1.shape[0] == 1
    ):
        return (mat1.permute(1, 0).float() * mat2.float()).sum(0, keepdim=True).to(mat1.dtype)
    return _INDUCTOR_MM(mat1, mat2) if out_dtype is None else _INDUCTOR_MM(mat1, mat2, out_dtype=out_dtype)


def _gemv_addmm(bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta=1, alpha=1):
    """``aten.addmm`` of one row (a linear layer with a bias) as :func:`_gemv_mm` plus the bias."""
    out = _gemv_mm(mat1, mat2)
    if out is NotImplemented:
        return _INDUCTOR_ADDMM(bias, mat1, mat2, beta=beta, alpha=alpha)
    return (out * alpha if alpha != 1 else out) + (bias * beta if beta != 1 else bias)


def _decompositions() -> dict:
    """Inductor's decompositions with the one-row matmuls as fused reductions (:func:`_gemv_mm`)."""
    from torch._inductor.decomposition import select_decomp_table

    global _INDUCTOR_MM, _INDUCTOR_ADDMM
    table = dict(select_decomp_table())
    aten = torch.ops.aten
    _INDUCTOR_MM = table.get(aten.mm.default, lambda *a, **k: NotImplemented)
    _INDUCTOR_ADDMM = table.get(aten.addmm.default, lambda *a, **k: NotImplemented)
    table[aten.mm.default] = _gemv_mm
    table[aten.addmm.default] = _gemv_addmm
    return table


def _backend(gm, example_inputs):
    """Inductor with :data:`OPTIONS` and the one-row matmuls fused (:func:`_decompositions`)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=dict(OPTIONS), decompositions=_decompositions())


@dataclass
class CompiledDecode:
    """The compiled decode step of one model, and what compiling it cost."""

    fn: object
    compiles: int = 0  # graphs compiled so far (one per shape)
    compile_s: float = 0.0  # wall seconds of the calls that compiled (tracing + code generation + the step)
    steps: int = 0  # compiled steps run
    shapes: list = field(default_factory=list)
    warned: set = field(default_factory=set)  # cache classes already warned about (serves)

    def serves(self, cache) -> bool:
        """Whether ``cache`` can run this compiled step (a fixed shape); a cache that cannot is warned about
        once per cache class, so an eager step never passes for a compiled one unnoticed."""
        why = _not_compileable(cache)
        if why is None:
            return True
        name = type(cache).__name__
        if name not in self.warned:
            self.warned.add(name)
            warnings.warn(f"kvslim.compile_decode: {why[0]}, so its decode steps run eagerly ({why[1]})", stacklevel=3)
        return False

    def __call__(self, **kwargs) -> torch.Tensor:
        from torch._dynamo.utils import counters

        cache = next(iter(kwargs["cache_kwargs"].values()))
        full = getattr(cache, "max_cache_len", None)
        if isinstance(full, int) and int(cache.get_seq_length()) >= full:  # a graph cannot refuse: checked here
            raise ValueError(
                f"this static cache holds at most max_cache_len={full} tokens and is full (build it with a "
                f"larger max_cache_len, or a window)"
            )

        for name in ("input_ids", "position_ids"):  # standard strides: a (1, 1) slice of a prompt would recompile
            kwargs[name] = kwargs[name].new_empty(kwargs[name].shape).copy_(kwargs[name])
        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        with warnings.catch_warnings(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            # torch's own tracing machinery warns; not the user's concern
            warnings.filterwarnings("ignore", message=".*torch.jit.script_method.*", category=DeprecationWarning)
            out = self.fn(**kwargs)
        if counters["stats"]["unique_graphs"] != before:
            self.compiles += 1
            self.compile_s += time.perf_counter() - t0
            self.shapes.append(tuple(kwargs["input_ids"].shape))
        self.steps += 1
        return out


def compile_decode(model, *, mode: str | None = None) -> CompiledDecode:
    """Compile ``model``'s one-token forward for kvslim's decode loop (idempotent: the model's existing
    :class:`CompiledDecode` is returned). ``mode``: ``torch.compile``'s (None: the default; on CUDA
    ``"reduce-overhead"`` adds CUDA graphs). The compilation itself happens at the first step of each shape."""
    if model in _COMPILED:
        return _COMPILED[model]

    def step(input_ids, position_ids, cache_kwargs):
        out = model(
            input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=1, **cache_kwargs
        )
        return out.logits

    # A code object of its own: torch.compile keeps its graphs (and its limit of recompiles) per code object,
    # so each compiled model starts afresh and uncompile() drops its graphs with it.
    _SERIAL[0] += 1
    code = step.__code__.replace(co_name=f"kvslim_decode_step_{_SERIAL[0]}")
    step = types.FunctionType(code, step.__globals__, code.co_name, step.__defaults__, step.__closure__)

    if mode is None:  # kvslim's backend: Inductor, the one-row matmuls as fused reductions
        fn = torch.compile(step, fullgraph=True, dynamic=False, backend=_backend)
    else:  # a torch.compile mode (CUDA graphs): Inductor's own decompositions
        fn = torch.compile(step, fullgraph=True, dynamic=False, mode=mode, options=OPTIONS)
    compiled = CompiledDecode(fn)
    _COMPILED[model] = compiled
    return compiled


def compiled_decode(model) -> CompiledDecode | None:
    """The model's :class:`CompiledDecode`, or None when :func:`compile_decode` was not called on it."""
    return _COMPILED.get(model)


def uncompile(model) -> None:
    """Back to the eager forward for ``model`` (the compiled graphs are dropped)."""
    _COMPILED.pop(model, None)


def check_compileable(cache) -> None:
    """ValueError in one line when ``cache`` cannot serve a compiled decode step, naming what can."""
    why = _not_compileable(cache)
    if why is not None:
        raise ValueError(f"a compiled decode step needs a cache of fixed shape; {why[0]}: {why[1]}")


def _not_compileable(cache) -> tuple[str, str] | None:
    """(why ``cache`` cannot run a compiled step, what can), or None when it can."""
    if getattr(cache, "is_compileable", False):
        return None
    return (
        f"{type(cache).__name__} grows or re-slices its storage",
        "use kvslim.StaticSlimCache (a window, or max_cache_len) or transformers' StaticCache",
    )
