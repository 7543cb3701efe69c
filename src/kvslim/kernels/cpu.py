"""The C kernels (``csrc/*.c``): built on first use with the system C compiler, loaded with ctypes.

Build: ``$CC`` (or the first of cc, gcc, clang on PATH) compiles the sources with
``-O3 -march=native -fopenmp -shared -fPIC -std=c11 -ffp-contract=fast`` (falling back to fewer flags
when one is refused) into ``<cache>/kernels/<hash>.so``, where ``<cache>`` is
:func:`kvslim.paths.cache_dir` and the hash covers the sources, the flags, the
compiler's version and the machine (``-march=native`` code is only reused on the CPU it was built for).
The file is written under a temporary name and renamed into place, so processes building at the same
time never load a half-written library; a lock on the directory (``flock``) makes concurrent first
uses compile once, the others waiting and then loading that build. A build takes a second or two.
Temporaries left by killed builds (older than an hour) are removed.

The directory is trusted only if this user owns it and no one else can write to it (a library
loaded from a directory others can write to runs their code); a directory we own but others can
write to is tightened (``chmod go-w``). A directory that is read-only, owned by someone else or
cannot be created: the kernels are built in a private temporary directory instead, removed once
loaded, with a one-line warning -- a compile on every run rather than the slow PyTorch reference.
A cached library that is not a regular file owned by us, writable only by us, is rebuilt.

Loading checks the library against the format registry: it asks the C side, by format name, for
its row-format code and the block layout its decoder reads (``kv_row_format``), and refuses a
library whose GGML block (elements, bytes) differs from the registered format's ``block``. The
format codes are never written down on this side.

Any failure to build or load warns once and leaves :func:`status` False: the dispatcher in
:mod:`kvslim.kernels` then uses the PyTorch reference. Nothing here raises at import.

The wrappers below validate every shape against the codec before handing raw pointers to C (a wrong
shape there would read out of bounds, not raise). Tensors are passed as (pointer, element strides of
dims 0..2); a last dim that is not contiguous is copied first.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from .. import paths
from ..checks import check_int
from ..formats import FORMATS, Codec, Encoded
from .layout import expect, rows_contiguous

ABI_VERSION = 3
SOURCES = Path(__file__).parent / "csrc"
BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c11", "-ffp-contract=fast"]
#: Tried in order; the first set the compiler accepts is used.
FLAG_VARIANTS = [
    ["-march=native", "-fopenmp"],
    ["-fopenmp"],
    ["-march=native", "-fopenmp-simd"],
    ["-fopenmp-simd"],
    [],
]
#: Longest query axis (GQA group x new tokens) the C kernels take. They redo the dot products per
#: query, where decode + GEMM amortizes the decode: measured (1 thread, T=4096, 3 KV heads, D=64) the
#: C kernels take 0.2-0.3x the reference's time at M=32..48 and draw level around M=96.
MAX_M = 64

_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.uint8: 4}
#: Row decoders for the tokens of a ``cast`` body, by its tensor's dtype: C's names for them.
_CAST_ROWS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
#: Codec families whose bodies the row kernels decode by the format's own name (see row_codes).
_NAMED_ROWS = ("ggml", "fp8")


_I = ctypes.c_int
#: kv_run's operations and its argument layout (see the end of csrc/kvslim_kernels.c)
_OP_K_ROWS, _OP_V_ROWS, _OP_K_AFFINE, _OP_V_AFFINE, _OP_K_ROWS_T, _OP_K_AFFINE_T = range(6)
_NPARAM = 8


# --------------------------------------------------------------------------- build and load


def find_compiler() -> list[str] | None:
    """The C compiler command: $CC (may carry flags) or the first of cc, gcc, clang on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _machine_id() -> str:
    """The CPU the -march=native code is for: architecture + /proc/cpuinfo's model and flags (Linux)."""
    ident = [platform.machine(), platform.system()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    ident.append(line.strip())
                if line.strip() == "":  # first processor only
                    break
    except OSError:
        ident.append(platform.processor())
    return "\n".join(ident)


def _sources() -> list[Path]:
    return sorted(SOURCES.glob("*.c"))


def _build_key(compiler: list[str], version: str) -> str:
    h = hashlib.sha256()
    for src in _sources():
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    h.update(repr((compiler, version, BASE_FLAGS, FLAG_VARIANTS, ABI_VERSION, _machine_id())).encode())
    return h.hexdigest()[:24]


def _compiler_version(compiler: list[str]) -> str:
    out = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or out.stderr.strip()


#: Prefix of the private build directories used when the cache directory cannot be trusted.
PRIVATE_PREFIX = "kvslim-kernels-"
#: Temporaries (killed builds, private directories) older than this are removed.
STALE_S = 3600.0


def build(force: bool = False) -> tuple[Path, str]:
    """Compile the kernels unless an up-to-date build is cached. Returns (path, flags used).

    The cache is ``<cache>/kernels`` when :func:`build_dir` trusts it, else a private temporary
    directory (a warning says so; the caller removes it after loading, see :func:`library`).
    Raises RuntimeError with the compiler's message when no flag set compiles.
    """
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set $CC, or install cc/gcc/clang)")
    key = _build_key(compiler, _compiler_version(compiler))
    out_dir = build_dir()
    target = out_dir / f"{key}.so"
    flags_file = out_dir / f"{key}.flags"
    with _dir_lock(out_dir):  # concurrent first uses: one compiles, the others wait and reuse it
        _remove_stale(out_dir)
        if not force and _trusted_file(target):
            flags = flags_file.read_text() if flags_file.is_file() else "?"
            return target, flags
        errors = []
        for variant in FLAG_VARIANTS:
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".so", dir=out_dir)
            os.close(fd)
            cmd = [*compiler, *BASE_FLAGS, *variant, "-o", tmp, *map(str, _sources())]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if res.returncode == 0:
                    flags = " ".join(BASE_FLAGS + variant)
                    from ..atomic import write_text

                    write_text(flags_file, flags, what="kernel flags")
                    os.chmod(tmp, 0o755)  # mkstemp's 0o600 + exec; never group/other-writable
                    os.replace(tmp, target)  # atomic: a concurrent build replaces an identical file
                    return target, flags
                errors.append(f"{' '.join(variant) or '(no extra flags)'}: {res.stderr.strip()[-400:]}")
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    raise RuntimeError(f"{compiler[0]} failed to build the kvslim kernels:\n" + "\n".join(errors))


def build_dir() -> Path:
    """Where the kernels are built and cached: ``<cache>/kernels`` if it can be created and trusted
    (:func:`untrusted_dir`), else a fresh private temporary directory, with a one-line warning."""
    shared = paths.cache_dir() / "kernels"
    try:
        shared.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = untrusted_dir(shared)
    except OSError as e:
        problem = f"cannot be created ({e.strerror or e})"
    if problem is None:
        return shared
    _remove_stale_private()
    private = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX))
    warnings.warn(
        f"kvslim: the kernel cache {shared} {problem}; building the C kernels in a private temporary "
        f"directory instead, on every run (a compile of a second or two each; set KVSLIM_CACHE_DIR to a "
        f"directory you own to keep the build)",
        RuntimeWarning,
        stacklevel=3,
    )
    return private


def untrusted_dir(path: Path) -> str | None:
    """Why a library must not be built into or loaded from ``path`` (None: it can be): owned by
    another user, writable by others (tightened with ``chmod go-w`` when we own it), or not
    writable by us (a read-only file system)."""
    st = path.stat()
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"is owned by another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        try:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
        except OSError:
            return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is not writable (a read-only file system or directory)"
    return None


def _trusted_file(path: Path) -> bool:
    """A cached library that may be loaded: a regular file (not a link), ours, writable only by us."""
    try:
        st = path.lstat()
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return False
    return not hasattr(os, "geteuid") or st.st_uid == os.geteuid()


@contextlib.contextmanager
def _dir_lock(directory: Path):
    """An exclusive ``flock`` on the directory itself (no lock file is left behind); a no-op where
    flock is unavailable."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover (Windows)
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_stale(directory: Path) -> None:
    """Remove temporaries (``.<key>.*``) of builds killed more than an hour ago."""
    now = time.time()
    for entry in directory.glob(".*"):
        with contextlib.suppress(OSError):
            if entry.is_file() and now - entry.stat().st_mtime > STALE_S:
                entry.unlink()


def _remove_stale_private() -> None:
    """Remove private build directories of this user left by killed processes."""
    now = time.time()
    for entry in Path(tempfile.gettempdir()).glob(PRIVATE_PREFIX + "*"):
        with contextlib.suppress(OSError):
            st = entry.lstat()
            mine = not hasattr(os, "geteuid") or st.st_uid == os.geteuid()
            if mine and stat.S_ISDIR(st.st_mode) and now - st.st_mtime > STALE_S:
                shutil.rmtree(entry, ignore_errors=True)


def _declare(lib: ctypes.CDLL) -> None:
    lib.kv_abi_version.restype = _I
    lib.kv_has_openmp.restype = _I
    lib.kv_test_half_to_float.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, _I]
    lib.kv_test_half_to_float.restype = None
    lib.kv_run.argtypes = [_I, ctypes.c_void_p]
    lib.kv_run.restype = _I
    lib.kv_row_format.argtypes = [
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_int32),
        ctypes.POINTER(ctypes.c_int32),
    ]
    lib.kv_row_format.restype = _I


def _row_format(lib: ctypes.CDLL, name: str) -> tuple[int, tuple[int, int]]:
    """C's row-format code for ``name`` (-1: no decoder) and the (elements, bytes) of its block."""
    elements, nbytes = ctypes.c_int32(), ctypes.c_int32()
    code = lib.kv_row_format(name.encode(), ctypes.byref(elements), ctypes.byref(nbytes))
    return code, (elements.value, nbytes.value)


def row_codes(lib: ctypes.CDLL) -> dict:
    """The row decoders ``lib`` has for the registered formats: format name (families ggml, fp8) or
    cast dtype -> C's code. A format C does not decode is left out (its calls go to the reference);
    a GGML format whose block layout in C differs from the registry's raises RuntimeError."""
    codes: dict = {}
    for fmt in FORMATS.values():
        if not any(f in _NAMED_ROWS for f in fmt.family.values()):
            continue
        code, layout = _row_format(lib, fmt.name)
        if code < 0:
            continue
        if fmt.block is not None and layout != tuple(fmt.block):
            raise RuntimeError(
                f"the C kernels decode {fmt.name} as blocks of {layout[0]} elements in {layout[1]} bytes, "
                f"the format registry says {fmt.block.elements} elements in {fmt.block.nbytes} bytes"
            )
        codes[fmt.name] = code
    for dtype, name in _CAST_ROWS.items():
        code, _ = _row_format(lib, name)
        if code >= 0:
            codes[dtype] = code
    return codes


_lock = threading.Lock()
_state: dict = {}  # "lib", "ok", "reason", "path", "flags", "rows" once tried


def _load() -> None:
    if sys.byteorder != "little":
        raise RuntimeError(
            "the C kernels read GGML's little-endian fp16 fields and need a little-endian host"
        )
    path, flags = build()
    try:
        lib = ctypes.CDLL(str(path))
    finally:
        if path.parent.name.startswith(PRIVATE_PREFIX):  # loaded (mapped): the file is not needed
            shutil.rmtree(path.parent, ignore_errors=True)
    _declare(lib)
    if lib.kv_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {lib.kv_abi_version()}, expected {ABI_VERSION}")
    rows = row_codes(lib)
    openmp = bool(lib.kv_has_openmp())
    _state.update(
        lib=lib,
        rows=rows,
        ok=True,
        path=str(path),
        flags=flags,
        openmp=openmp,
        reason=f"built with {flags} ({'OpenMP' if openmp else 'single-threaded: no OpenMP'})",
    )


def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them on first use; None (after one warning) if that failed."""
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                try:
                    _load()
                except Exception as e:  # any failure: warn once, fall back to the reference
                    _state.update(lib=None, ok=False, reason=f"{type(e).__name__}: {e}")
                    warnings.warn(
                        f"kvslim: C kernels unavailable, using the PyTorch reference ({_state['reason']})",
                        RuntimeWarning,
                        stacklevel=3,
                    )
    return _state["lib"]


def status() -> tuple[bool, str]:
    """(usable, why): builds/loads on first call."""
    library()
    return _state["ok"], _state["reason"]


def _reset_for_tests() -> None:
    with _lock:
        _state.clear()


# --------------------------------------------------------------------------- argument marshalling


def _run(op: int, what: str, dims: tuple, params: tuple, parts: tuple) -> None:
    """Call kv_run: dims (B, H, M, T, D), up to 8 int params, tensors (B, H, N, ...) whose dims after 2
    are contiguous, passed as (pointer, element strides of dims 0..2, dtype code)."""
    vals = [*dims, torch.get_num_threads(), *params, *(0,) * (_NPARAM - len(params))]
    for t in parts:
        s = t.stride()
        vals += (t.data_ptr(), s[0], s[1], s[2], _DT[t.dtype])
    args = array.array("q", vals)  # one int64 array: far cheaper to marshal than ctypes structs
    rc = _state["lib"].kv_run(op, args.buffer_info()[0])
    if rc == 1:
        raise MemoryError(f"kvslim C kernel {what}: out of memory for its scratch buffers")
    if rc:
        raise ValueError(f"kvslim C kernel {what} rejected its arguments (code {rc})")


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------- KIVI per-channel K


def _affine_k_parts(codec: Codec, enc: Encoded, b: int, h: int, t: int, d: int, offset: int):
    per = 8 // codec.bits
    g = codec.token_group
    check_int("offset", offset, minimum=0, below=g)
    codes = rows_contiguous(enc.token["codes"])
    expect(codes, (b, h, t, d // per), (torch.uint8,), f"{codec.name} K codes")
    n = -(-(offset + t) // g)
    scale, zero = (rows_contiguous(enc.group[k]) for k in ("scale", "zero"))
    for name, s in (("scale", scale), ("zero", zero)):
        expect(s, (b, h, n, d), _FLOATS, f"{codec.name} K {name}")
    return codes, scale, zero


def k_affine(q: torch.Tensor, codec: Codec, enc: Encoded, offset: int) -> torch.Tensor:
    """Per-channel affine K scores: q (B, H, M, D) fp32 -> (B, H, M, T)."""
    b, h, m, d = q.shape
    t = enc.token["codes"].shape[2]
    codes, scale, zero = _affine_k_parts(codec, enc, b, h, t, d, offset)
    out = torch.empty((b, h, m, t), dtype=torch.float32)
    _run(
        _OP_K_AFFINE,
        "k_affine",
        (b, h, m, t, d),
        (codec.bits, codec.token_group, offset),
        (q, codes, scale, zero, out),
    )
    return out


def _transform_parts(q: torch.Tensor, tr, t: int) -> tuple[tuple, tuple]:
    """The C side's (hblock, rhalf, roff, has_bias, has_flags) and (bias, cos, sin, flags) parts of a
    KeyTransform.

    bias: (1, H, 1, D) fp32; cos/sin: (B, 1, T, R/2) fp32, batch stride 0 when shared by every row;
    flags: the ``centered`` part (B, H, T, 1) uint8. Absent parts repeat q (never read)."""
    b, h, _, d = q.shape
    bias = q
    if tr.bias is not None:
        bias = tr.bias.to(dtype=torch.float32, device=q.device).contiguous()
        expect(bias, (h, d), (torch.float32,), "transform bias")
        bias = bias[None, :, None, :]
    hblock = 0 if tr.hadamard is None else int(tr.hadamard.block)
    if hblock and (hblock & (hblock - 1) or d % hblock):
        raise ValueError(f"a Hadamard block of {hblock} does not tile head_dim {d}")
    cos = sin = q
    rhalf = roff = 0
    if tr.cos is not None:
        rhalf, roff = int(tr.cos.shape[-1]), int(tr.rope_offset)
        if roff < 0 or roff + 2 * rhalf > d:
            raise ValueError(f"rotary channels {roff}..{roff + 2 * rhalf} exceed head_dim {d}")
        parts = []
        for name, a in (("cos", tr.cos), ("sin", tr.sin)):
            a = a.to(dtype=torch.float32, device=q.device).contiguous()
            if a.dim() != 3 or a.shape[0] not in (1, b) or tuple(a.shape[1:]) != (t, rhalf):
                raise ValueError(
                    f"transform {name} has shape {tuple(a.shape)}, expected ({b} or 1, {t}, {rhalf})"
                )
            parts.append(a[:, None].expand(b, 1, t, rhalf))  # stride 0 over a shared batch
        cos, sin = parts
    flags = q
    if tr.centered is not None:
        flags = rows_contiguous(tr.centered)
        expect(flags, (b, h, t, 1), (torch.uint8,), "transform centered flags")
    has = (int(tr.bias is not None), int(tr.centered is not None))
    return (hblock, rhalf, roff, *has), (bias, cos, sin, flags)


def k_affine_transformed(q: torch.Tensor, codec: Codec, enc: Encoded, offset: int, tr) -> torch.Tensor:
    """Per-channel affine K scores against transformed keys (kvslim.kernels.KeyTransform): (B, H, M, T)."""
    b, h, m, d = q.shape
    t = enc.token["codes"].shape[2]
    codes, scale, zero = _affine_k_parts(codec, enc, b, h, t, d, offset)
    params, extra = _transform_parts(q, tr, t)
    out = torch.empty((b, h, m, t), dtype=torch.float32)
    _run(
        _OP_K_AFFINE_T,
        "k_affine_transformed",
        (b, h, m, t, d),
        (codec.bits, codec.token_group, offset, *params),
        (q, codes, scale, zero, out, *extra),
    )
    return out


# --------------------------------------------------------------------------- KIVI per-token V


def _v_group(codec: Codec, d: int) -> int:
    return d if codec.group_size is None else codec.group_size


def affine_v_supported(codec: Codec, enc: Encoded) -> bool:
    """The C kernel needs each channel group to be whole bytes of codes (g a multiple of 8 // bits)."""
    d = enc.token["codes"].shape[-1] * (8 // codec.bits)
    g = _v_group(codec, d)
    return d % g == 0 and g % (8 // codec.bits) == 0


def v_affine(p: torch.Tensor, codec: Codec, enc: Encoded, offset: int) -> torch.Tensor:
    """Per-token affine V weighted sum: p (B, H, M, T) fp32 -> (B, H, M, D)."""
    b, h, m, t = p.shape
    per = 8 // codec.bits
    codes = rows_contiguous(enc.token["codes"])
    d = codes.shape[-1] * per
    g = _v_group(codec, d)
    expect(codes, (b, h, t, d // per), (torch.uint8,), f"{codec.name} V codes")
    scale, zero = (rows_contiguous(enc.token[k]) for k in ("scale", "zero"))
    for name, s in (("scale", scale), ("zero", zero)):
        expect(s, (b, h, t, d // g), _FLOATS, f"{codec.name} V {name}")
    out = torch.empty((b, h, m, d), dtype=torch.float32)
    _run(_OP_V_AFFINE, "v_affine", (b, h, m, t, d), (codec.bits, g), (p, codes, scale, zero, out))
    return out


# --------------------------------------------------------------------------- per-token rows


def _row_code(key) -> int | None:
    """C's row-format code for a format name or cast dtype (loading the library); None if it has none."""
    library()
    return _state.get("rows", {}).get(key)


def _row_parts(codec: Codec, enc: Encoded, b: int, h: int, t: int, d: int | None):
    """(format code, row tensor, fp8 scale or a dummy, D) of a GGML / fp8 / cast body."""
    family = codec.family
    if family == "ggml":
        size, nb = codec.format.block
        blocks = rows_contiguous(enc.token["blocks"])
        if d is None:
            d = blocks.shape[-1] // nb * size
        expect(blocks, (b, h, t, d // size * nb), (torch.uint8,), f"{codec.name} blocks")
        if d % size:
            raise ValueError(f"{codec.name} needs a head dim that is a multiple of {size}, got {d}")
        return _row_code(codec.name), blocks, blocks, d
    if family == "fp8":
        codes = rows_contiguous(enc.token["codes"])
        d = codes.shape[-1] if d is None else d
        expect(codes, (b, h, t, d), (torch.float8_e4m3fn,), "fp8 codes")
        scale = enc.token["scale"]
        expect(scale, (b, h, t, 1), (torch.float32,), "fp8 scale")
        return _row_code(codec.name), codes, scale, d
    if family != "cast":
        raise ValueError(f"the row kernels do not decode codec {codec.name!r} (family {family})")
    x = rows_contiguous(enc.token["x"])
    d = x.shape[-1] if d is None else d
    expect(x, (b, h, t, d), tuple(_CAST_ROWS), f"{codec.name} tokens")
    return _row_code(x.dtype), x, x, d


def rows_supported(codec: Codec, enc: Encoded) -> bool:
    """Whether the C library has a row decoder for this body (by format name, or the cast's dtype)."""
    if codec.family in _NAMED_ROWS:
        return _row_code(codec.name) is not None
    x = enc.token.get("x")
    return codec.family == "cast" and x is not None and _row_code(x.dtype) is not None


def k_rows(q: torch.Tensor, codec: Codec, enc: Encoded, offset: int) -> torch.Tensor:
    """Per-token formats (GGML, fp8, fp16/bf16/fp32): q (B, H, M, D) fp32 -> (B, H, M, T)."""
    b, h, m, d = q.shape
    t = next(iter(enc.token.values())).shape[2]
    fmt, x, xs, d = _row_parts(codec, enc, b, h, t, d)
    out = torch.empty((b, h, m, t), dtype=torch.float32)
    _run(_OP_K_ROWS, "k_rows", (b, h, m, t, d), (fmt,), (q, x, xs, out))
    return out


def k_rows_transformed(q: torch.Tensor, codec: Codec, enc: Encoded, offset: int, tr) -> torch.Tensor:
    """Per-token formats against transformed keys (kvslim.kernels.KeyTransform): (B, H, M, T)."""
    b, h, m, d = q.shape
    t = next(iter(enc.token.values())).shape[2]
    fmt, x, xs, d = _row_parts(codec, enc, b, h, t, d)
    params, extra = _transform_parts(q, tr, t)
    out = torch.empty((b, h, m, t), dtype=torch.float32)
    _run(_OP_K_ROWS_T, "k_rows_transformed", (b, h, m, t, d), (fmt, 0, 0, *params), (q, x, xs, out, *extra))
    return out


def v_rows(p: torch.Tensor, codec: Codec, enc: Encoded, offset: int) -> torch.Tensor:
    """Per-token formats: p (B, H, M, T) fp32 -> (B, H, M, D)."""
    b, h, m, t = p.shape
    fmt, x, xs, d = _row_parts(codec, enc, b, h, t, None)
    out = torch.empty((b, h, m, d), dtype=torch.float32)
    _run(_OP_V_ROWS, "v_rows", (b, h, m, t, d), (fmt,), (p, x, xs, out))
    return out


def half_to_float(bits: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """The C side's fp16 -> fp32 conversion (F16C when built for it, else bit arithmetic; ``portable``
    forces the latter) of uint16/int16 bit patterns, for the tests."""
    src = bits.to(torch.int16).contiguous()
    dst = torch.empty(src.shape, dtype=torch.float32)
    library().kv_test_half_to_float(src.data_ptr(), dst.data_ptr(), src.numel(), int(portable))
    return dst
