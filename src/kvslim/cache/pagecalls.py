"""A paged step's pool calls with their argument tables laid out once a step, not once a layer.

:meth:`PagePool.attend <kvslim.cache.pagepool.PagePool.attend>` makes four C calls a layer: the step's K/V rotated
into the pages' basis (``kvp_rotate``), written to their pages and to their staging slots (``kvp_write`` twice), and
the attention over every row's pages (``kvp_attend``). Each goes through the vLLM plugin's function for it
(:mod:`kvslim.vllm.attend`), which checks its arguments and builds its table anew: some 0.1 ms of Python a layer, a
few milliseconds of a 30-layer step whose attention takes ~25 ms (docs/performance.md, "The pool's calls laid out
once a step").

Within one step every layer's calls read the same rows, formats, shapes and thread count; what changes from one
layer to the next is the layer's pages, its staging pool, and the step's query, key and value. :class:`StepCalls`
builds the four tables at the step's first layer, through the same builders (:func:`~kvslim.vllm.attend.rotate_args`,
:func:`~kvslim.vllm.attend.store_args`, :func:`~kvslim.vllm.attend.attend_args`: the same checks, the same values),
and each layer sets only those addresses (``ROTATE_KEY`` .. ``HEAD_STAGED`` there) in int64 arrays before calling.
The rotated K/V go to two buffers of the step's, written and read within one layer's calls and never handed out.

It applies where the pages are rotated by ``kvp_rotate`` (a Hadamard basis, no K bias: the default of every lossy
format) and the C kernel runs, to a float32 model's tensors and to a bfloat16 or float16 model's widened to
float32; a layer whose query, key or value does not have the first layer's dtype, shape and strides, or whose
rotation the C call declines, gets ``None`` from :func:`attend` and takes the general path. The results are the
general path's bit for bit (tests/test_pagecalls.py).

This module knows nothing about transformers, scheduling or page formats (the builders do).
"""

from __future__ import annotations

import array
import ctypes
import struct

import torch

from ..vllm import attend as paged
from .pagespec import HALF_LIMIT, check_staged

#: a plan's ``calls`` where its step has none (checked once, at its first layer)
NONE = False
#: the model dtypes whose step tensors are widened to float32 for the tables (the C calls read float32)
HALVES = (torch.bfloat16, torch.float16)


def _table(values: list[int]) -> tuple[array.array, int]:
    """An int64 array of ``values`` and its address (the array is never resized: the address stays)."""
    a = array.array("q", values)
    return a, a.buffer_info()[0]


def _form(x: torch.Tensor) -> tuple:
    """What a layer's step tensor must keep for the step's tables to read it: type, dtype, shape, strides."""
    return type(x), x.dtype, x.device.type, tuple(x.shape), x.stride()


class StepCalls:
    """One step's four argument tables (module docstring), built by :meth:`of`."""

    __slots__ = (
        "pool", "plan", "lib", "forms", "scale", "rotate", "amax", "keys", "values", "write", "stage",
        "head", "keep", "native_fields",
    )  # fmt: skip

    @classmethod
    def of(cls, pool, plan, layer: int, query, key, value, scale: float) -> StepCalls | None:
        """The step's tables from its first layer's tensors, or None where this path does not apply."""
        basis = pool.basis
        if paged._reference_asked() or basis.k_bias is not None or (basis.k is None and basis.v is None):
            return None
        lib = paged.library()
        if lib is None or any(
            type(x) is not torch.Tensor or x.dtype != torch.float32 for x in (query, key, value)
        ):
            return None
        h, d = query.shape[1:] if query.dim() == 3 else (0, 0)
        if not (
            query.dim() == 3 and query.stride(2) == 1 and query.stride(1) == d and query.stride(0) >= h * d
        ):
            return None  # (the kernel would read a copy: not worth laying out)
        rot = paged.rotate_args(key, value, basis.k, basis.v)
        if rot is None:
            return None
        self = cls()
        self.pool, self.plan, self.lib, self.scale = pool, plan, lib, scale
        self.forms = (_form(query), _form(key), _form(value))
        args, self.keys, self.values, self.amax = rot
        self.rotate = _table(args)
        keep = [self.keys, self.values, self.amax]
        got = paged.store_args(pool.layout, pool.pages[layer], self.keys, self.values, plan.slots)
        if got is None:
            return None
        self.write = _table(got[0])
        keep.append(got[1])
        self.stage = None
        staged = None
        if pool.stager is not None:
            got = paged.store_args(
                pool.stage_layout, pool.staged[layer], self.keys, self.values, plan.stage_dest
            )
            if got is None:
                return None
            self.stage = _table(got[0])
            keep.append(got[1])
            staged = paged.Staged(pool.staged[layer], pool.stage_layout, plan.stage_map)
        out = torch.empty(query.shape, dtype=torch.float32)
        rotate = (basis.k.block if basis.k is not None else 0, basis.v.block if basis.v is not None else 0)
        head, o, held = paged.attend_args(
            lib, pool.layout, pool.pages[layer], query, out, plan.table, scale, pool.window or 0, True,
            self.keys, self.values, staged, pool.sink, rotate,
        )  # fmt: skip
        if o is not out or held[0] is not query or held[1] is not self.keys or held[2] is not self.values:
            return None  # the kernel would read copies of the step's tensors: this path keeps none
        self.head = _table(head)
        keep.append(held)
        self.keep = keep
        self.native_fields = None
        return self

    def native(self) -> array.array | None:
        """The step's fields for ``kvslim_cpp::page_attend`` (``csrc/kvslim_ops.cpp``, its ``Field`` order: the
        tables' addresses, the staging check, every layer's pages, the first layer's forms, where each layer's
        addresses go and the C functions), laid out once a step; None where a layer's forms are not float32 CPU
        tensors of three dimensions. Where the step stages in float16 for a model of another dtype, C++ passes a
        layer whose largest ``|value|`` is under float16's limit (every staged value fits: what :func:`check_staged`
        finds then) and gives any other to :meth:`run`, which checks the staged tokens themselves."""
        if self.native_fields is not None:
            return self.native_fields
        pool, plan = self.pool, self.plan
        check = pool.stage_dtype == torch.float16 and pool.dtype != torch.float16 and plan.staged_any
        forms = []
        for _, dtype, device, shape, stride in self.forms:
            if dtype != torch.float32 or device != "cpu" or len(shape) != 3:
                return None
            forms += [*shape, *stride]
        pages = array.array("q", [p.data_ptr() for p in pool.pages])
        staged = array.array("q", [p.data_ptr() for p in pool.staged]) if self.stage is not None else None
        bits = lambda x: struct.unpack("<q", struct.pack("<d", x))[0]  # noqa: E731
        fn = lambda name: ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value  # noqa: E731
        fields = array.array(
            "q",
            [
                self.rotate[1], self.write[1], self.stage[1] if self.stage is not None else 0, self.head[1],
                self.amax.data_ptr(), int(check), bits(HALF_LIMIT), bits(self.scale),
                len(pool.pages), pages.buffer_info()[0], staged.buffer_info()[0] if staged is not None else 0,
                *forms,
                paged.ROTATE_KEY, paged.ROTATE_VALUE, paged.WRITE_PAGES,
                paged.HEAD_QUERY, paged.HEAD_OUT, paged.HEAD_PAGES, paged.HEAD_STAGED,
                fn("kvp_rotate"), fn("kvp_write"), fn("kvp_attend"),
            ],
        )  # fmt: skip
        self.keep += [pages, staged]
        self.native_fields = fields
        return fields

    def run(self, layer: int, query, key, value, scale: float) -> torch.Tensor | None:
        """Layer ``layer``'s four calls: (N, H_q, D) float32, or None (nothing written) where the layer's tensors
        do not fit the step's tables or the rotation's C call declines them: the caller takes the general path."""
        if scale != self.scale or (_form(query), _form(key), _form(value)) != self.forms:
            return None
        pool, plan, lib = self.pool, self.plan, self.lib
        rot, rot_at = self.rotate
        rot[paged.ROTATE_KEY], rot[paged.ROTATE_VALUE] = key.data_ptr(), value.data_ptr()
        if lib.kvp_rotate(rot_at):
            return None
        km, vm = self.amax.tolist()
        check_staged(
            pool.stage_dtype, pool.dtype, plan, self.keys, self.values, km if km != km or km > vm else vm
        )
        pages = pool.pages[layer]
        table, at = self.write
        table[paged.WRITE_PAGES] = pages.data_ptr()
        if lib.kvp_write(at):  # a value it leaves to torch: the general path's own fallback
            paged.write(pool.layout, pages, self.keys, self.values, plan.slots)
        head, head_at = self.head
        if self.stage is not None:
            staged = pool.staged[layer]
            table, at = self.stage
            table[paged.WRITE_PAGES] = staged.data_ptr()
            if lib.kvp_write(at):
                paged.write(pool.stage_layout, staged, self.keys, self.values, plan.stage_dest)
            head[paged.HEAD_STAGED] = staged.data_ptr()
        out = torch.empty(query.shape, dtype=torch.float32)
        head[paged.HEAD_QUERY], head[paged.HEAD_OUT], head[paged.HEAD_PAGES] = (
            query.data_ptr(), out.data_ptr(), pages.data_ptr(),
        )  # fmt: skip
        paged.check_rc(lib.kvp_attend(head_at))
        return out


def attend(pool, plan, layer: int, query, key, value, scale: float) -> torch.Tensor | None:
    """Layer ``layer`` of ``plan`` through its step's tables (built at the step's first layer), or None: the caller
    takes :meth:`PagePool.attend <kvslim.cache.pagepool.PagePool.attend>`'s general path. A bfloat16 or float16
    layer's tensors are widened to float32 first (exactly), as the general path widens them."""
    if query.dtype in HALVES and key.dtype == value.dtype == query.dtype:
        query, key, value = query.float(), key.float(), value.float()
    calls = plan.calls
    if calls is None:
        calls = plan.calls = StepCalls.of(pool, plan, layer, query, key, value, scale) or NONE
    return calls.run(layer, query, key, value, scale) if calls is not NONE else None
