"""The Triton backend: K scores and V weighted sums for CUDA tensors, read from the packed codes.

Every codec family a kernel can read directly is covered -- per-channel affine K and per-token
affine V at 8/4/3/2 bits (any scale dtype, any V channel group; variance-normalized or not), the GGML blocks q8_0, q4_0, q4_1,
q5_0 and q5_1, fp8 with its per-token scale, and plain fp16/bf16/fp32 (``cast``) -- in both roles.
The programs (:mod:`.triton_kernels`) decode a tile of tokens in registers and multiply it with
every query row of its KV head at once, so one decode step reads each stored byte once: no fp32
copy of the history, GQA without repeating K or V. K scores need no reduction over tokens and are
gridded over token tiles; the V sum is split over the tokens (flash-decoding: Dao et al., 2023,
"Flash-Decoding for long-context inference") so that one query still fills the GPU at long context,
and the per-split partial sums are added by a second pass (``torch.sum``; the probabilities arrive
normalized, so no rescaling is needed).

A decode step's whole attention for many rows (sinks, bodies as lists of pieces, residual, softmax, value sums)
in one launch: :mod:`.gpu_rows` (programs in :mod:`.triton_rows`), which reuses these programs' tile decoder.

Triton is an optional extra (``pip install kvslim[gpu]``): this module imports it only on first use,
and :func:`status` reports it missing without raising.

CPU tensors run through Triton's interpreter, for tests and debugging only, when both
``$TRITON_INTERPRET=1`` and ``set_backend("triton")`` ask for it (see :func:`cpu_opt_in`); ``auto``
never sends CPU tensors here, where the C kernels are the fast path.

Not measured: no GPU was available when this was written. Tile sizes, the split count and
:data:`MAX_M` are reasoned defaults, not tuned; the interpreter tests (tests/test_triton.py) check
the results against the torch reference, not the speed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from types import ModuleType

import torch

from ..formats import Codec, Encoded
from ..formats.layout import FAMILIES as LAYOUT_FAMILIES
from ..formats.layout import body_layout
from ..formats.varnorm import factor_part

#: Longest query axis (GQA group x new tokens) taken; longer (prefill) goes to the reference, whose
#: decode + cuBLAS matmul runs on tensor cores where these fp32 ``tl.dot`` tiles do not. Unmeasured:
#: mirrors the C kernels' limit.
MAX_M = 64
#: Programs the V sum aims for per streaming multiprocessor (the split over tokens grows until the
#: grid reaches this many times the SM count); in the interpreter, a fixed total.
PROGRAMS_PER_SM = 4
INTERPRETER_PROGRAMS = 8

#: Triton compile options of every launch: FMA contraction (the decode's ``code * scale + zero`` in
#: one rounding; within the tests' bound, and Triton 3.9 warns when it is left to its default).
COMPILE_OPTIONS = {"enable_fp_fusion": True}

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
#: Block bytes of each GGML kind as the programs read it (fp16 d [, fp16 m] [, qh[4]], qs[16] or q[32]).
GGML_LAYOUT = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}


# --------------------------------------------------------------------------- availability


@functools.cache
def installed() -> bool:
    """Whether Triton can be imported (looked up once: the dispatcher asks on every call)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether ``$TRITON_INTERPRET`` asks for Triton's interpreter (Triton's own reading of it:
    ``triton.knobs`` from 3.4 on, "1" only before)."""
    if not installed() or "TRITON_INTERPRET" not in os.environ:
        return False  # without importing Triton
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return bool(knobs.runtime.interpret)


def status() -> tuple[bool, str]:
    """(usable, why): Triton installed and a CUDA device present, or the interpreter requested."""
    if not installed():
        return False, "Triton is not installed (pip install 'kvslim[gpu]')"
    if torch.cuda.is_available():
        return True, "Triton kernels for CUDA tensors"
    if interpreting():
        return True, "Triton's interpreter (TRITON_INTERPRET=1): CPU tensors with set_backend('triton')"
    return False, "no CUDA device (TRITON_INTERPRET=1 with set_backend('triton') runs the interpreter)"


def cpu_opt_in(requested: str) -> bool:
    """CPU tensors are taken only when the triton backend was requested by name and the interpreter
    is on: a CPU user never reaches the (slow) interpreter by accident."""
    return requested == "triton" and interpreting()


# --------------------------------------------------------------------------- the programs

_lock = threading.RLock()  # re-entered: the rows programs' module asks for the base programs while it loads
_programs: dict[tuple[str, bool], ModuleType] = {}


def programs(module: str = "triton_kernels") -> ModuleType:
    """The :mod:`.triton_kernels` programs (or ``module``'s: :mod:`.triton_rows`) for the current mode: compiled
    for the GPU, or interpreted under ``$TRITON_INTERPRET``. Triton fixes a ``@triton.jit`` function's mode when
    it is decorated, so each mode executes its own copy of the module, registered as
    ``kvslim.kernels._triton_compiled`` or ``kvslim.kernels._triton_interpreted`` (``_triton_rows_compiled`` ...
    for the rows programs; Triton reads program sources through inspect)."""
    mode = interpreting()
    key = (module, mode)
    if key not in _programs:
        with _lock:
            if key not in _programs:
                spec = importlib.util.find_spec(f"{__package__}.{module}")
                stem = "triton" if module == "triton_kernels" else module
                name = f"{__package__}._{stem}_{'interpreted' if mode else 'compiled'}"
                spec = importlib.util.spec_from_file_location(name, spec.origin)
                loaded = importlib.util.module_from_spec(spec)
                sys.modules[name] = loaded
                try:
                    spec.loader.exec_module(loaded)
                except BaseException:
                    del sys.modules[name]
                    raise
                _programs[key] = loaded
    return _programs[key]


# --------------------------------------------------------------------------- layouts


def _ggml_ok(codec: Codec) -> bool:
    block = getattr(codec.format, "block", None)
    return block is not None and tuple(block) == (32, GGML_LAYOUT.get(codec.name, -1))


def supported(codec: Codec, enc: Encoded) -> bool:
    """Whether the programs read this body's layout (device and query axis are checked by the caller)."""
    family = codec.family
    if family in ("affine_k", "affine_v"):  # uniform codes only: a Lloyd-Max table goes to the torch reference
        return codec.format.pack is not None and codec.bits in (8, 4, 3, 2) and not getattr(codec, "levels", None)
    if family == "ggml":
        return _ggml_ok(codec)
    if family == "fp8":
        return True
    if family == "cast":
        x = enc.token.get("x")
        return x is not None and x.dtype in _FLOATS
    return False


@dataclass(frozen=True)
class _Layout:
    """The launch arguments of one body: the layout code (FMT), bits of an affine code, bytes of a
    GGML block, the three tensors (codes, blocks or values; scale; zero -- unused ones repeat
    another) and the scale group (tokens per K scale row, channels per V scale); ``n``: a
    variance-normalized affine body's factor bytes (:mod:`kvslim.formats.varnorm`; else the codes, unread),
    ``ngroup`` tokens per V factor row."""

    fmt: int
    bits: int
    nb: int
    x: torch.Tensor
    s: torch.Tensor
    z: torch.Tensor
    group: int
    n: torch.Tensor | None = None
    ngroup: int = 1

    @property
    def vn(self) -> bool:
        return self.n is not None

    @property
    def factors(self) -> torch.Tensor:
        return self.x if self.n is None else self.n

    def strides(self) -> list[int]:
        f = self.factors
        return [*self.x.stride()[:3], *self.s.stride()[:3], *self.z.stride()[:3], *f.stride()[:3]]


def _layout(codec: Codec, enc: Encoded, b: int, h: int, t: int, d: int | None, offset: int) -> tuple:
    """(_Layout, D) of a body of ``t`` tokens, every shape checked against the codec by the encoded-layout
    contract (:func:`kvslim.formats.layout.body_layout`: the programs read raw pointers, a wrong shape would
    read out of bounds, not raise). ``d`` None: from the body."""
    prog = programs()
    family = codec.family
    if family not in LAYOUT_FAMILIES:
        raise ValueError(f"the Triton kernels do not read codec {codec.name!r} (family {family})")
    if family == "ggml" and not _ggml_ok(codec):
        raise ValueError(f"the Triton kernels do not read {codec.name} blocks of {codec.format.block}")
    lay = body_layout(codec, enc, b, h, t, d, offset)
    if family in ("affine_k", "affine_v"):
        fmt = (prog.AFFINE_K if family == "affine_k" else prog.AFFINE_V).value
        n = factor_part(codec, enc, b, h, t, lay.d, offset)  # None for a plain body
        return _Layout(fmt, codec.bits, 0, lay.x, lay.scale, lay.zero, lay.group, n, codec.token_group), lay.d
    if family == "ggml":
        x = lay.x
        return _Layout(prog.GGML[codec.name].value, 8, codec.format.block.nbytes, x, x, x, 1), lay.d
    if family == "fp8":
        codes = lay.x.view(torch.uint8)  # decoded from its bits: no fp8 support needed on the GPU
        return _Layout(prog.FP8.value, 8, 0, codes, lay.scale, codes, 1), lay.d
    return _Layout(prog.CAST.value, 8, 0, lay.x, lay.x, lay.x, 1), lay.d


# --------------------------------------------------------------------------- launches


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def _blocks(m: int, d: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_D): tl.dot needs every tile dim >= 16 and a power of two; padded rows and
    channels are masked."""
    return min(MAX_M, _pow2(m, 16)), _pow2(d, 16)


def _device(x: torch.Tensor):
    """Launch on the tensors' GPU (Triton launches on the current device)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def k_scores(q: torch.Tensor, codec: Codec, enc: Encoded, offset: int) -> torch.Tensor:
    """q (B, H, M, D) fp32 -> scores (B, H, M, T) fp32 against the T encoded keys."""
    b, h, m, d = q.shape
    t = next(iter(enc.token.values())).shape[2]
    lay, d = _layout(codec, enc, b, h, t, d, offset)
    out = torch.empty((b, h, m, t), dtype=torch.float32, device=q.device)
    block_m, block_d = _blocks(m, d)
    block_t = 64 if block_d <= 64 else 32  # the decoded tile: BLOCK_T x BLOCK_D fp32 in registers
    grid = (b * h, _cdiv(t, block_t), _cdiv(m, block_m))
    with _device(q):
        programs().k_scores_kernel[grid](
            q, lay.x, lay.s, lay.z, lay.factors, out,
            h, m, t, d, offset, lay.group, lay.ngroup,
            *q.stride()[:3], *lay.strides(),
            FMT=lay.fmt, BITS=lay.bits, NB=lay.nb, VN=lay.vn,
            BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_D=block_d, **COMPILE_OPTIONS,
        )  # fmt: skip
    return out


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def splits(tiles: int, programs_per_split: int, device: torch.device) -> tuple[int, int]:
    """(splits, token tiles per split) of the V sum: enough programs to fill the device, each split
    at least one tile."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = PROGRAMS_PER_SM * _sm_count(index)
    else:
        target = INTERPRETER_PROGRAMS
    n = max(1, min(tiles, _cdiv(target, max(1, programs_per_split))))
    per = _cdiv(tiles, n)
    return _cdiv(tiles, per), per


def v_weighted(p: torch.Tensor, codec: Codec, enc: Encoded, offset: int) -> torch.Tensor:
    """p (B, H, M, T) fp32 -> p @ V (B, H, M, D) fp32 over the T encoded values."""
    b, h, m, t = p.shape
    lay, d = _layout(codec, enc, b, h, t, None, offset)
    block_m, block_d = _blocks(m, d)
    block_t = 32
    m_tiles = _cdiv(m, block_m)
    n_split, per = splits(_cdiv(t, block_t), b * h * m_tiles, p.device)
    partial = torch.empty((b * h, n_split, m, d), dtype=torch.float32, device=p.device)
    with _device(p):
        programs().v_partial_kernel[(b * h, n_split, m_tiles)](
            p, lay.x, lay.s, lay.z, lay.factors, partial,
            h, m, t, d, offset, lay.group, lay.ngroup, per,
            *p.stride()[:3], *lay.strides(),
            FMT=lay.fmt, BITS=lay.bits, NB=lay.nb, VN=lay.vn,
            BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_D=block_d, **COMPILE_OPTIONS,
        )  # fmt: skip
    out = partial[:, 0] if n_split == 1 else partial.sum(1)  # (B * H, M, D): the second pass
    return out.reshape(b, h, m, d)
