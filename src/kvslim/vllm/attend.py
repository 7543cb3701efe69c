"""Attention on kvslim pages over block tables: the C kernel (``csrc/kvslim_paged.c``) and a torch reference.

A step's *rows* (vLLM's requests; kvslim's engine's conversations) are described once per step by
:class:`Rows` and read by every layer: row ``r`` has ``q_len`` queries from ``q_start`` in the packed query
tensor, ``kv_len`` keys (its queries' own tokens are the last ``q_len``), and its own block table (int32 page
ids; key ``j`` is token ``j % T`` of page ``table[j // T]``). That one description covers decode, prefill,
prefill continuing a cached prefix, and mixed batches, in one call.

Given the step's raw K/V (``key``, ``value``: the tokens vLLM hands the layer, packed like the queries), a row's
``q_len`` new keys are read from them, exactly, and only its ``kv_len - q_len`` cached keys from the pages' codes:
a step's tokens attend on each other at full precision and on the history's codes. Attending a prefill on its own
just-quantized codes instead, as a backend that writes before it attends does, compounds the error through the
layers: q4_0's KL divergence through vLLM was 0.119 that way, 0.061 this way (docs/vllm.md). Without them every key
is read from the pages (the step's tokens written first).

With a :class:`Staged` pool, a page that has a staging slot (the partly filled last page of a sequence:
:mod:`.staging`) is read from the slot, at full precision, instead of its codes: kvslim's own cache keeps a partly
filled group of 32 unencoded the same way (q4_0 through vLLM: 0.061 -> 0.0148, docs/vllm.md).

``kvp_attend``'s row records each carry a *pointer* to their block table (vLLM's point into its 2-D table; kvslim's
engine points each row at a list of its own). :func:`attend` calls it, the reference (:data:`KERNEL_ENV`; no C
library), or on CUDA tensors the Triton program (:mod:`.attend_triton`).

This module imports nothing of vLLM.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from dataclasses import dataclass

import torch

from ..cache.hadamard import Hadamard
from ..formats import get_format
from . import attend_triton as triton
from .attend_ref import attend_reference
from .pages import PageLayout, Part, raw_rows, write

#: ``$KVSLIM_VLLM_KERNEL`` for CPU tensors: ``c`` (default: the C kernel when it builds), ``reference``, or ``triton``
#: (the Triton program under its interpreter: for tests). CUDA tensors take Triton where it reads the pages.
KERNEL_ENV = "KVSLIM_VLLM_KERNEL"
#: kvp_attend's ABI and table widths (csrc/kvslim_paged.c: H_FIELDS, R_FIELDS, W_FIELDS), checked when the
#: library loads.
ABI = 6
HEAD_FIELDS = 39
ROW_FIELDS = 5
WRITE_FIELDS = 19
#: Where the argument tables of ``kvp_rotate``, ``kvp_write`` and ``kvp_attend`` (:func:`rotate_args`,
#: :func:`store_args`, :func:`attend_args`) hold what one layer of a step changes from the last, the rest being the
#: step's (:mod:`kvslim.cache.pagecalls` lays them out once a step and sets these): the raw key's and value's
#: addresses; the pages' address; the query's, the output's, the pages' and the staging pool's addresses (and the
#: step's raw K/V, which pagecalls keeps in buffers of its own: a replay of a layer's call sets them).
ROTATE_KEY, ROTATE_VALUE = 0, 1
WRITE_PAGES = 10
HEAD_QUERY, HEAD_OUT, HEAD_PAGES, HEAD_STAGED = 7, 9, 11, 27
HEAD_KNEW, HEAD_VNEW = 24, 25
#: C's row decoders of the cast dtypes.
CAST_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass
class Staged:
    """A layer's staging pool and the engine's page-to-slot map (:mod:`.staging`): pool uint8 (slots, H_kv, T, C)
    in ``layout`` (a cast layout: the model's dtype, K then V); map int32 page id -> slot or -1."""

    pool: torch.Tensor
    layout: PageLayout
    map: torch.Tensor


@dataclass
class Rows:
    """One step's rows. table: int64 (R, 5) = q_start, q_len, kv_len, block table address, its length;
    block_table: int32 (R, max_blocks), kept alive for the addresses; starts / kv_lens: Python lists."""

    table: torch.Tensor
    block_table: torch.Tensor
    starts: list[int]
    kv_lens: list[int]

    @classmethod
    def of(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor) -> Rows:
        """query_start_loc: (R + 1,); seq_lens: (R,) keys per row; block_table: (R', max_blocks), R' >= R."""
        starts = query_start_loc.tolist()
        lens = seq_lens.tolist()
        r = len(lens)
        bt = block_table[:r]
        if bt.dtype != torch.int32 or (bt.shape[1] > 1 and bt.stride(1) != 1):
            bt = bt.to(torch.int32).contiguous()
        table = torch.empty((r, ROW_FIELDS), dtype=torch.int64)
        if r:
            q_start = torch.tensor(starts[:r], dtype=torch.int64)
            table[:, 0] = q_start
            table[:, 1] = torch.tensor(starts[1 : r + 1], dtype=torch.int64) - q_start
            table[:, 2] = torch.tensor(lens, dtype=torch.int64)
            table[:, 3] = bt.data_ptr() + torch.arange(r, dtype=torch.int64) * bt.stride(0) * 4
            table[:, 4] = bt.shape[1]
        return cls(table, bt, starts, lens)


_lock = threading.Lock()
_state: dict = {}


def _part_code(lib, part: Part) -> int:
    """C's format code for ``part``, its block checked against the format registry."""
    name = CAST_NAMES[part.dtype] if part.family == "cast" else "sym8" if part.family == "sym" else part.name
    elements, nbytes = ctypes.c_int32(), ctypes.c_int32()
    code = lib.kvp_format(name.encode(), ctypes.byref(elements), ctypes.byref(nbytes))
    if code < 0:
        raise RuntimeError(f"the paged kernel has no decoder for {name}")
    fmt = get_format(part.name)
    expected = fmt.block if part.family == "ggml" else fmt.pack if part.family == "affine" else None
    if expected is not None and (elements.value, nbytes.value) != tuple(expected):
        raise RuntimeError(
            f"the paged kernel reads {name} in units of {elements.value} elements / {nbytes.value} bytes, "
            f"the format registry says {tuple(expected)}"
        )
    return code


def library():
    """The C library with ``kvp_attend`` declared, or None (the reason in :func:`status`)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["reason"] = None, ""
                try:
                    from ..kernels import clib

                    lib = clib.library()
                    if lib is None:
                        raise RuntimeError(clib.status()[1])
                    lib.kvp_attend.argtypes = [ctypes.c_void_p]
                    lib.kvp_attend.restype = ctypes.c_int
                    lib.kvp_format.argtypes = [
                        ctypes.c_char_p,
                        ctypes.POINTER(ctypes.c_int32),
                        ctypes.POINTER(ctypes.c_int32),
                    ]
                    lib.kvp_format.restype = ctypes.c_int
                    lib.kvp_abi_version.restype = ctypes.c_int
                    lib.kvp_write.argtypes = [ctypes.c_void_p]
                    lib.kvp_write.restype = ctypes.c_int
                    lib.kvp_layout.argtypes = [ctypes.c_void_p]
                    lib.kvp_layout.restype = None
                    lib.kvp_rotate.argtypes = [ctypes.c_void_p]
                    lib.kvp_rotate.restype = ctypes.c_int
                    lib.kvp_set_fast.argtypes = [ctypes.c_int]
                    lib.kvp_set_fast.restype = ctypes.c_int
                    if lib.kvp_abi_version() != ABI:  # before kvp_layout: an older one writes fewer widths
                        raise RuntimeError(f"kvp_attend has ABI {lib.kvp_abi_version()}, expected {ABI}")
                    widths = (ctypes.c_int64 * 3)()
                    lib.kvp_layout(widths)
                    if tuple(widths) != (HEAD_FIELDS, ROW_FIELDS, WRITE_FIELDS):
                        raise RuntimeError(
                            f"kvp_attend's tables have {tuple(widths)} fields, expected "
                            f"{(HEAD_FIELDS, ROW_FIELDS, WRITE_FIELDS)}"
                        )
                    _state["lib"], _state["reason"] = lib, "C kernel"
                except Exception as e:  # any failure: the reference, said once
                    _state["reason"] = f"torch reference ({type(e).__name__}: {e})"
    return _state["lib"]


def rotate_kv(
    key: torch.Tensor, value: torch.Tensor, k_rot: Hadamard | None, v_rot: Hadamard | None
) -> tuple[torch.Tensor, torch.Tensor, float, float] | None:
    """A step's K and V (N, H, D) as rotated pages store them, in one C call (``kvp_rotate``): each times its role's
    Hadamard rotation (None: copied), bit for bit :meth:`Hadamard.apply <kvslim.cache.hadamard.Hadamard.apply>`
    (both are kvslim's linear kernel over rows of the block), as new contiguous float32 tensors, with each one's
    largest ``|value|`` (NaN if any). None where the call cannot take them (no C library or no vectorized linear
    kernel, not float32 CPU tensors whose rows are contiguous, a tensor autograd tracks): the caller rotates in
    torch."""
    got = rotate_args(key, value, k_rot, v_rot)
    if got is None:
        return None
    args, keys, values, amax = got
    table = torch.tensor(args, dtype=torch.int64)
    if library().kvp_rotate(table.data_ptr()):
        return None
    return keys, values, float(amax[0]), float(amax[1])


def rotate_args(
    key: torch.Tensor, value: torch.Tensor, k_rot: Hadamard | None, v_rot: Hadamard | None
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`rotate_kv`'s argument table for ``kvp_rotate`` and the tensors it writes: ``(args, keys, values,
    amax)`` (amax float32 (2,): each role's largest ``|value|``), or None where the call cannot take them."""
    lib = None if _reference_asked() else library()
    if lib is None or key.shape != value.shape or key.dim() != 3 or not key.shape[0]:
        return None
    for x in (key, value):
        if type(x) is not torch.Tensor or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(2) != 1:
            return None
        if x.requires_grad and torch.is_grad_enabled():
            return None
    n, h, d = key.shape
    keys, values = torch.empty(n, h, d, dtype=torch.float32), torch.empty(n, h, d, dtype=torch.float32)
    amax = torch.empty(2, dtype=torch.float32)
    mats = [None if r is None else r.block_matrix() for r in (k_rot, v_rot)]
    # a decode step's few rows on this thread alone (handing them to a second costs more than it saves); a prompt
    # chunk's on torch's threads (the bits are a row's own either way)
    block = max(r.block for r in (k_rot, v_rot) if r is not None) if (k_rot or v_rot) else 0
    threads = 1 if n * h * d * block < 1 << 20 else torch.get_num_threads()
    args = [
        key.data_ptr(), value.data_ptr(), n, h, d,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        keys.data_ptr(), values.data_ptr(),
        0 if mats[0] is None else mats[0].data_ptr(), 0 if k_rot is None else k_rot.block,
        0 if mats[1] is None else mats[1].data_ptr(), 0 if v_rot is None else v_rot.block,
        amax.data_ptr(), threads,
    ]  # fmt: skip
    return args, keys, values, amax


def use_avx512_loops(on: bool) -> bool:
    """Whether the C kernel takes its AVX-512 decode loops (the default where built) or the AVX2 ones (``False``:
    tests and ``scripts/paged_attend_time.py`` run both). Not during a call. Returns whether this build has them."""
    lib = library()
    return bool(lib.kvp_set_fast(int(on))) if lib is not None else False


def _reference_asked() -> bool:
    """Whether ``$KVSLIM_VLLM_KERNEL`` asks for another path than the C kernel (the torch reference, or Triton)."""
    return os.environ.get(KERNEL_ENV, "c") in ("reference", "triton")


def status() -> str:
    """Which path :func:`attend` takes for CPU tensors, and why (CUDA tensors: :mod:`.attend_triton`)."""
    if _reference_asked():
        asked = os.environ[KERNEL_ENV]
        return f"{'Triton under its interpreter' if asked == 'triton' else 'torch reference'} (${KERNEL_ENV}={asked})"
    library()
    return _state["reason"]


def attend(
    layout: PageLayout,
    kv_cache: torch.Tensor,
    query: torch.Tensor,
    out: torch.Tensor,
    rows: Rows,
    scale: float,
    window: int = 0,
    causal: bool = True,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    staged: Staged | None = None,
    sink: int = 0,
    rotate: tuple[int, int] = (0, 0),
) -> None:
    """Attention of every row's queries on its pages, written into ``out``.

    kv_cache: uint8 (num_pages, H_kv, T, row_bytes); query, out: (N, H_q, D) (out in any float dtype);
    window: keys a query sees counting itself (0: all); key, value: (N, H_kv, D), the step's raw K/V packed like
    the queries: each row's new keys are read from them (module docstring); None: every key from the pages;
    staged: pages with a staging slot are read from it instead of their codes (:mod:`.staging`); sink: with a window,
    keys ``0 .. sink - 1`` stay visible to every query (StreamingLLM's sinks); the pages between a row's sink pages
    and its window's first page are never read (a pool may have freed them); rotate: (K's block, V's block) of the
    normalized Sylvester Hadamard rotation the pages are stored in (0: none): each query head is rotated into K's
    basis first and each output head back from V's last, inside the call (:mod:`.basis`)."""
    if (key is None) != (value is None):
        raise ValueError("kvslim paged attention: give both the step's raw key and value, or neither")
    if query.dim() != 3 or query.shape[1] % kv_cache.shape[1]:
        raise ValueError(
            f"kvslim paged attention: queries of shape {tuple(query.shape)}: expected (N, heads, head size) with a "
            f"head count that is a multiple of the pages' {kv_cache.shape[1]} KV heads; it is not a multiple, or "
            f"not 3-D"
        )
    if key is not None:
        want = (kv_cache.shape[1], layout.head_dim)
        for name, x in (("key", key), ("value", value)):
            if x.dim() != 3 or tuple(x.shape[1:]) != want or x.shape[0] < query.shape[0]:
                raise ValueError(
                    f"kvslim paged attention: {name} has shape {tuple(x.shape)}, expected "
                    f"({query.shape[0]}, {want[0]}, {want[1]}) ({want[0]} KV heads): the step's tokens packed like "
                    f"the queries"
                )
    for name, block in zip(("K", "V"), rotate, strict=True):
        if block < 0 or (block and (block & (block - 1) or layout.head_dim % block)):
            raise ValueError(
                f"kvslim paged attention: {name}'s rotation block {block} must be 0 or a power of two dividing the "
                f"head size {layout.head_dim}"
            )
    args = (layout, kv_cache, query, out, rows, scale, window, causal, key, value, staged, sink, rotate)
    cpu = kv_cache.device.type == "cpu"
    if (not cpu or os.environ.get(KERNEL_ENV) == "triton") and triton.take(layout, kv_cache, staged):
        triton.attend_triton(*args)
        return
    lib = None if _reference_asked() or not cpu else library()
    if lib is None:
        attend_reference(*args)
        return
    head, o, keep = attend_args(
        lib, layout, kv_cache, query, out, rows, scale, window, causal, key, value, staged, sink, rotate
    )
    args = torch.tensor(head, dtype=torch.int64)
    check_rc(lib.kvp_attend(args.data_ptr()))
    del keep  # (what the table points at, held until here)
    if o is not out:
        out.copy_(o)


def check_rc(rc: int) -> None:
    """``kvp_attend``'s return code: 0, or RuntimeError."""
    if rc:
        raise RuntimeError(
            f"kvslim paged attention failed (code {rc}: {'out of memory' if rc == 1 else 'bad arguments'})"
        )


def attend_args(
    lib,
    layout: PageLayout,
    kv_cache: torch.Tensor,
    query: torch.Tensor,
    out: torch.Tensor,
    rows: Rows,
    scale: float,
    window: int,
    causal: bool,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    staged: Staged | None,
    sink: int,
    rotate: tuple[int, int],
) -> tuple[list[int], torch.Tensor, tuple]:
    """:func:`attend`'s argument table for ``kvp_attend`` of ``lib`` (its arguments checked by it already), the
    float32 tensor the kernel writes (``out`` itself where it is float32 and contiguous, else a new one to copy
    from), and the tensors the table points at that the caller did not give (copies of the query, key, value or
    map in the layout the kernel reads): hold them until the call returns."""
    kcode, vcode = _part_codes(lib, layout)
    # vLLM's queries are a view of its qkv projection: read in place (a token stride), not copied
    q = raw_rows(query)
    o = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty(q.shape, dtype=torch.float32)
    n_pages, h_kv, t, _ = kv_cache.shape
    b = kv_cache.element_size()
    head = [
        ABI,
        rows.table.shape[0],
        rows.table.data_ptr(),
        q.shape[1],
        h_kv,
        layout.head_dim,
        t,
        q.data_ptr(),
        q.stride(0),
        o.data_ptr(),
        o.stride(0),
        kv_cache.data_ptr(),
        n_pages,
        kv_cache.stride(0) * b,
        kv_cache.stride(1) * b,
        kv_cache.stride(2) * b,
        kcode,
        layout.k.offset,
        vcode,
        layout.v.offset,
        struct.unpack("<q", struct.pack("<d", float(scale)))[0],
        window,
        int(causal),
        torch.get_num_threads(),
    ]
    if key is not None:
        k, v = raw_rows(key), raw_rows(value)
        if k.stride(0) != v.stride(0):  # the kernel takes one token stride for both
            k, v = k.contiguous(), v.contiguous()
        head += [k.data_ptr(), v.data_ptr(), k.stride(0)]
    else:
        k = v = None
        head += [0, 0, 0]
    if staged is not None:
        pool, smap = staged.pool, staged.map
        if pool.dtype != torch.uint8 or pool.dim() != 4 or tuple(pool.shape[1:3]) != (h_kv, t):
            raise ValueError(
                f"kvslim paged attention: the staging pool has shape {tuple(pool.shape)} {pool.dtype}, expected "
                f"uint8 (slots, {h_kv}, {t}, row bytes)"
            )
        smap = (
            smap if smap.dtype == torch.int32 and smap.is_contiguous() else smap.to(torch.int32).contiguous()
        )
        sb = pool.element_size()
        codes = _state["codes"]  # filled by _part_codes above
        scode = codes.get(staged.layout.k)
        if scode is None:
            scode = codes[staged.layout.k] = _part_code(lib, staged.layout.k)
        head += [
            pool.data_ptr(),
            pool.shape[0],
            pool.stride(0) * sb,
            pool.stride(1) * sb,
            pool.stride(2) * sb,
            scode,
            staged.layout.v.offset,
            smap.data_ptr(),
            smap.shape[0],
        ]
    else:
        smap = None
        head += [0] * 9
    head += [sink, rotate[0], rotate[1]]
    return head, o, (q, k, v, smap)


def _c_writes(part: Part) -> bool:
    """Whether ``kvp_write`` encodes ``part`` (the same bytes as :func:`~.pages.encode_part`): fp32, fp16 and bf16
    values, every GGML block (q8_0, q4_0, q4_1, q5_0, q5_1), symmetric int8, affine int4/int3/int2 and fp8 rows."""
    if part.family == "cast":
        return part.dtype in (torch.float32, torch.float16, torch.bfloat16)
    return part.family in ("sym", "affine", "fp8", "ggml")


def _c_can_store(layout: PageLayout, kv_cache: torch.Tensor, key, value, slot_mapping: torch.Tensor) -> bool:
    """Whether ``kvp_write`` takes this write: its formats, and the shapes it trusts (it cannot check a pointer's
    extent; anything else goes to :func:`~.pages.write`, which raises its own errors)."""
    n = slot_mapping.shape[0]
    shape = (kv_cache.shape[1], layout.head_dim) if kv_cache.dim() == 4 else None
    return (
        n > 0
        and slot_mapping.dim() == 1
        and kv_cache.device.type == "cpu"
        and key.device.type == "cpu"
        and kv_cache.dtype == torch.uint8
        and shape is not None
        and kv_cache.shape[3] == layout.row_bytes
        and kv_cache.stride(3) == 1
        and all(x.dim() == 3 and x.shape[0] >= n and tuple(x.shape[1:]) == shape for x in (key, value))
        and _c_writes(layout.k)
        and _c_writes(layout.v)
    )


def _part_codes(lib, layout: PageLayout) -> tuple:
    """The C codes of the layout's K and V parts, worked out once per pair of parts."""
    codes = _state.setdefault("codes", {})
    parts = (layout.k, layout.v)
    if parts not in codes:
        codes[parts] = (_part_code(lib, layout.k), _part_code(lib, layout.v))
    return codes[parts]


def store(
    layout: PageLayout,
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`~.pages.write` (the same arguments, the same bytes), in one C call (``kvp_write``) where the library
    encodes both parts (:func:`_c_writes`), else in torch: a write per layer and step costs
    one call instead of some twenty small torch ops per part."""
    got = store_args(layout, kv_cache, key, value, slot_mapping)
    if got is None:
        write(layout, kv_cache, key, value, slot_mapping)
        return
    args, keep = got
    table = torch.tensor(args, dtype=torch.int64)
    # nothing written: a format or value it leaves to torch, or a bad slot
    if library().kvp_write(table.data_ptr()):
        write(layout, kv_cache, key, value, slot_mapping)
    del keep


def store_args(
    layout: PageLayout,
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[list[int], tuple] | None:
    """:func:`store`'s argument table for ``kvp_write`` and the tensors it points at that the caller did not give
    (hold them until the call returns), or None where the write is torch's (:func:`~.pages.write`)."""
    n = slot_mapping.shape[0]
    if _reference_asked() or not _c_can_store(layout, kv_cache, key, value, slot_mapping):
        return None
    lib = library()
    if lib is None:
        return None
    kcode, vcode = _part_codes(lib, layout)
    k, v = raw_rows(key[:n]), raw_rows(value[:n])
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    slots = slots.contiguous()
    args = [
        ABI, n, k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), slots.data_ptr(),
        kv_cache.shape[1], layout.head_dim, kv_cache.shape[2],
        kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kcode, layout.k.offset, vcode, layout.v.offset,
    ]  # fmt: skip
    return args, (k, v, slots)

