"""kvslim's own linear layer for a decode step's few rows (``csrc/kvslim_linear.c``), called through ctypes.

:func:`linear` is ``torch.nn.functional.linear`` for float32 CPU tensors, and for bfloat16 ones where the CPU has
AVX512-BF16, computed so that each output row's bits depend on its own input row alone, whatever other rows share
the call (the C file says how), and streaming the weights faster than the CPU BLAS does at the few rows of a decode
step on the machines measured (docs/performance.md, "kvslim's linear layers", "kvslim's linear in bfloat16").
:func:`ready` says whether this build has it for a dtype (float32: AVX2 and FMA, or AVX-512; bfloat16: AVX512-BF16
and AVX512-BW). The engine reaches it as the ``kvslim`` route of :mod:`kvslim.engine.linears`.

This module knows nothing about models or routes.
"""

from __future__ import annotations

import array
import math

import torch

from .clib import library, on_reset, status

#: the dtypes the kernel has an entry for, and that entry's name in the C library
ENTRIES = {torch.float32: "kv_linear", torch.bfloat16: "kv_linear_bf16"}


def ready(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the C library is built and has a vectorized product for ``dtype`` (float32: AVX2 and FMA, or
    AVX-512; bfloat16: AVX512-BF16 and AVX512-BW); False for any other dtype."""
    name = ENTRIES.get(dtype)
    if name is None or not status()[0]:
        return False
    lib = library()
    if not hasattr(lib, name):
        return False
    if dtype not in _READY:
        x = torch.ones(1, 1, dtype=dtype)
        y = torch.empty(1, 1, dtype=dtype)
        args = array.array("q", [x.data_ptr(), 1, 1, 1, x.data_ptr(), 1, 1, 0, y.data_ptr(), 1, 1])
        _READY[dtype] = getattr(lib, name)(args.buffer_info()[0]) == 0 and float(y) == 1.0
    return _READY[dtype]


_READY: dict = {}
on_reset(_READY.clear)  # a library built again is probed again


def _plain(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """A plain (no subclass: a FakeTensor or DTensor has no memory to hand to C) strided CPU tensor of ``dtype``."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.dtype == dtype
        and t.device.type == "cpu"
        and t.layout == torch.strided
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for float32 or bfloat16 CPU tensors (all three of one dtype): x (..., I), weight
    (O, I), bias (O,) or None; returns (..., O), a new tensor of that dtype. Inference only: raises ValueError for a
    tensor that autograd would track (there is no backward), for other dtypes, mixed dtypes, devices or shapes, and
    RuntimeError where :func:`ready` is False for the dtype (the caller decides what runs instead)."""
    dtype = weight.dtype
    if dtype not in ENTRIES or not (_plain(x, dtype) and _plain(weight, dtype) and (bias is None or _plain(bias, dtype))):
        raise ValueError("kvslim's linear takes float32 or bfloat16 CPU tensors, all of one dtype")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        raise ValueError("kvslim's linear has no backward: call it under torch.no_grad() or inference_mode()")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"kvslim's linear: x {tuple(x.shape)} does not fit a weight {tuple(weight.shape)} (x's last dim must be "
            "the weight's second)"
        )
    o, i = weight.shape
    if bias is not None and tuple(bias.shape) != (o,):
        raise ValueError(f"kvslim's linear: bias {tuple(bias.shape)} for a weight {tuple(weight.shape)}")
    if not ready(dtype):
        raise RuntimeError(
            "kvslim's linear needs the C kernels built with AVX2 and FMA (or AVX-512)"
            if dtype == torch.float32
            else "kvslim's linear in bfloat16 needs the C kernels built for a CPU with AVX512-BF16 and AVX512-BW"
        )
    rows = x.reshape(math.prod(x.shape[:-1]), i)  # (not -1: a width of 0 cannot be inferred)
    if i and rows.stride(1) != 1:
        rows = rows.contiguous()
    w = weight if weight.stride(1) == 1 or i <= 1 else weight.contiguous()
    b = None if bias is None else bias.contiguous()
    if i == 0:
        r = rows.shape[0]
        y = b.expand(r, o).clone() if b is not None else torch.zeros(r, o, dtype=dtype)
        return y.reshape(*x.shape[:-1], o)
    y = _product(rows, w.data_ptr(), o, w.stride(0), 0 if b is None else b.data_ptr())
    return y.reshape(*x.shape[:-1], o)


def _product(rows: torch.Tensor, wp: int, o: int, ws: int, bp: int) -> torch.Tensor:
    """``kv_linear`` (``kv_linear_bf16``) on ``rows`` (R, I) float32 (bfloat16) with unit column stride, I > 0, and
    the weight (O, I) of the same dtype at address ``wp`` (row stride ``ws``), the bias at ``bp`` (0: none): a new
    (R, O) tensor of that dtype."""
    r, i = rows.shape
    dtype = rows.dtype
    y = torch.empty(r, o, dtype=dtype)
    if r and o:
        entry = _ENTRY.get(dtype)
        if entry is None:  # (the library's function looked up once per dtype, again after a rebuild)
            entry = _ENTRY[dtype] = getattr(library(), ENTRIES[dtype])
        args = array.array(
            "q",
            [
                rows.data_ptr(), r, i, rows.stride(0) if r > 1 else i,
                wp, o, ws if o > 1 else i, bp,
                y.data_ptr(), o, torch.get_num_threads(),
            ],
        )  # fmt: skip
        rc = entry(args.buffer_info()[0])
        if rc != 0:
            raise RuntimeError(f"kvslim's linear kernel refused the call (status {rc}): a build without its instructions?")
    return y


_ENTRY: dict = {}  # dtype -> the C function (a ctypes attribute lookup costs ~1 us a call, ~211 calls a step)
on_reset(_ENTRY.clear)


class Prepared:
    """One float32 or bfloat16 weight (and bias) checked once for :func:`linear`, for a caller that multiplies by it again and
    again (an engine step's ~211 products): calling it checks only the input, then runs the same C call on the same
    arguments as :func:`linear` (the same bits), in about a third of :func:`linear`'s Python. Made by :meth:`of`."""

    __slots__ = ("weight", "bias", "wp", "bp", "o", "i", "ws", "dtype")

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Prepared | None:
        """For a plain float32 or bfloat16 CPU weight (O, I) with contiguous rows, I > 0, and a contiguous (O,) bias
        of its dtype or None, where the kernel runs for that dtype (:func:`ready`); else None (:func:`linear` decides
        what that input gets)."""
        dtype = weight.dtype
        if not (_plain(weight, dtype) and (bias is None or _plain(bias, dtype)) and ready(dtype)) or weight.dim() != 2:
            return None
        o, i = weight.shape
        if not i or (i > 1 and weight.stride(1) != 1):
            return None
        if bias is not None and (tuple(bias.shape) != (o,) or not bias.is_contiguous()):
            return None
        self = cls()
        self.weight, self.bias, self.o, self.i, self.dtype = weight, bias, o, i, dtype
        self.wp, self.bp, self.ws = weight.data_ptr(), 0 if bias is None else bias.data_ptr(), weight.stride(0)
        return self

    def fits(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether ``weight`` and ``bias`` are still what this was made of: the same tensors at the same addresses
        in the same dtype (``module.to(...)`` or a ``.data`` replaced changes the address or the dtype)."""
        return (
            weight is self.weight
            and bias is self.bias
            and weight.data_ptr() == self.wp
            and weight.dtype == self.dtype
            and (bias is None or (bias.data_ptr() == self.bp and bias.dtype == self.dtype))
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ weight.T + bias`` as :func:`linear` computes it, or None where ``x`` is not a CPU tensor of the
        weight's dtype and width I, or autograd is recording (the caller decides what either gets)."""
        if type(x) is not torch.Tensor or x.dtype != self.dtype or not x.is_cpu or x.layout != torch.strided:
            return None
        shape = x.shape
        if not shape or shape[-1] != self.i or torch.is_grad_enabled():
            return None
        # (the checks and reshapes in as few torch calls as they take: at one row, ~211 products a step, each
        # microsecond here is ~0.2 ms of a ~30 ms step)
        rows = x if len(shape) == 2 else x.reshape(-1, self.i)  # (R, I); I > 0, so -1 is R even at R = 0
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        y = _product(rows, self.wp, self.o, self.ws, self.bp)  # (R, O)
        return y if len(shape) == 2 else y.reshape(*shape[:-1], self.o)
