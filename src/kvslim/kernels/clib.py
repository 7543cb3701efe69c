"""The C kernels' library (``csrc/*.c``): built on first use with the system C compiler, loaded with ctypes.

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

This module builds, trusts, locks and loads the library; the ctypes wrappers that call it are
:mod:`kvslim.kernels.cpu`.
"""

from __future__ import annotations

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
import warnings
from pathlib import Path

import torch

from .. import paths
from ..atomic import remove_stale
from ..formats import FORMATS
from ..poolspin import check_spin, spin_from_env

ABI_VERSION = 9
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
#: Row decoders for the tokens of a ``cast`` body, by its tensor's dtype: C's names for them.
CAST_ROWS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
#: Codec families whose bodies the row kernels decode by the format's own name (see row_codes).
NAMED_ROWS = ("ggml", "fp8")

_I = ctypes.c_int


# --------------------------------------------------------------------------- build and load


def find_compiler(env: str = "CC", names: tuple[str, ...] = ("cc", "gcc", "clang")) -> list[str] | None:
    """The C compiler command: $CC (may carry flags) or the first of cc, gcc, clang on PATH (another ``env`` and
    ``names``: the C++ one, :mod:`.cppops`)."""
    cc = os.environ.get(env)
    if cc:
        return shlex.split(cc)
    for name in names:
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


def bf16_instructions() -> list[str]:
    """The bfloat16 instructions this CPU announces (/proc/cpuinfo flags ``avx512_bf16``, ``amx_bf16``; Linux;
    empty elsewhere or without them): where they are missing, torch emulates bfloat16 matmuls in float32, so a
    ``--dtype bfloat16`` model saves memory but not time (docs/performance.md, "bfloat16")."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [x for x in ("avx512_bf16", "amx_bf16") if x in flags]


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
        remove_stale(out_dir, ".*", STALE_S)  # temporaries (``.<key>.*``) of killed builds
        if not force and _trusted_file(target):
            flags = flags_file.read_text() if flags_file.is_file() else "?"
            return target, flags
        errors, first_error = [], ""
        for variant in FLAG_VARIANTS:
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".so", dir=out_dir)
            os.close(fd)
            cmd = [*compiler, *BASE_FLAGS, *variant, "-o", tmp, *map(str, _sources())]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if res.returncode == 0:
                    flags = " ".join(BASE_FLAGS + variant)
                    if errors:  # a preferred flag set failed: say so once, at the build (a slower build, or a bug)
                        warnings.warn(
                            f"kvslim: the C kernels were built with {' '.join(variant) or 'no extra flags'} because "
                            f"{' '.join(FLAG_VARIANTS[0])} failed: {first_error}",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                    from ..atomic import write_text

                    write_text(flags_file, flags, what="kernel flags")
                    os.chmod(tmp, 0o755)  # mkstemp's 0o600 + exec; never group/other-writable
                    os.replace(tmp, target)  # atomic: a concurrent build replaces an identical file
                    return target, flags
                if not errors:
                    first_error = _first_error(res.stderr)
                errors.append(f"{' '.join(variant) or '(no extra flags)'}: {res.stderr.strip()[-400:]}")
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    raise RuntimeError(f"{compiler[0]} failed to build the kvslim kernels:\n" + "\n".join(errors))


def _first_error(message: str) -> str:
    """The first line of a compiler's output that names an error (else its first line), for a one-line warning."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "error" in line:
            return line
    return lines[0] if lines else "(no message)"


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
    remove_stale(tempfile.gettempdir(), PRIVATE_PREFIX + "*", STALE_S)  # killed processes' private builds
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


def _declare(lib: ctypes.CDLL) -> None:
    lib.kv_abi_version.restype = _I
    lib.kv_has_openmp.restype = _I
    lib.kv_test_half_to_float.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, _I]
    lib.kv_test_half_to_float.restype = None
    lib.kv_run.argtypes = [_I, ctypes.c_void_p]
    lib.kv_run.restype = _I
    lib.kv_attend.argtypes = [ctypes.c_void_p]
    lib.kv_attend.restype = _I
    lib.kv_attend_rows.argtypes = [ctypes.c_void_p]
    lib.kv_attend_rows.restype = _I
    lib.kv_rows_layout.argtypes = [ctypes.c_void_p]
    lib.kv_rows_layout.restype = None
    lib.kv_to_half_finite.argtypes = [ctypes.c_void_p]
    lib.kv_to_half_finite.restype = _I
    if hasattr(lib, "kv_encode_affine"):  # csrc/kvslim_encode.c (absent from a baseline build of older sources)
        lib.kv_encode_affine.argtypes = [ctypes.c_void_p]
        lib.kv_encode_affine.restype = _I
    for name, args, res in (  # csrc/kvslim_linear.c's workers (likewise)
        ("kv_pool_spin", [ctypes.c_int64], ctypes.c_int64), ("kv_pool_preempted", [], ctypes.c_int64),
        ("kv_pool_sleeps", [], ctypes.c_int64), ("kv_pool_renew", [], None), ("kv_pool_balance", [ctypes.c_int], _I),
        ("kv_pool_joins", [], ctypes.c_int64),
    ):  # fmt: skip
        if hasattr(lib, name):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, res
    for name in ("kv_linear", "kv_linear_bf16"):  # csrc/kvslim_linear.c (likewise)
        if hasattr(lib, name):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = _I
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
        if not any(f in NAMED_ROWS for f in fmt.family.values()):
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
    for dtype, name in CAST_ROWS.items():
        code, _ = _row_format(lib, name)
        if code >= 0:
            codes[dtype] = code
    return codes


#: kv_attend_rows' row table (csrc/kvslim_kernels.c): int64 fields of the header, of a row record and of a
#: piece record, and the row record's status field; the loader refuses a library that says otherwise.
ROWS_LAYOUT = {"head": 18, "row": 47, "piece": 61, "status": 45}


def rows_layout(lib: ctypes.CDLL) -> dict:
    """kv_attend_rows' table widths as the library has them (see :data:`ROWS_LAYOUT`)."""
    out = (ctypes.c_int64 * 4)()
    lib.kv_rows_layout(out)
    return dict(zip(ROWS_LAYOUT, out, strict=True))


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
    if rows_layout(lib) != ROWS_LAYOUT:
        raise RuntimeError(
            f"{path} lays out kv_attend_rows' table as {rows_layout(lib)}, expected {ROWS_LAYOUT}"
        )
    openmp = bool(lib.kv_has_openmp())
    _spin_from_env(lib)
    _state.update(
        lib=lib,
        rows=rows,
        ok=True,
        path=str(path),
        flags=flags,
        openmp=openmp,
        reason=f"built with {flags} ({'OpenMP' if openmp else 'single-threaded: no OpenMP'})",
    )


def _spin_from_env(lib: ctypes.CDLL) -> None:
    """$KVSLIM_POOL_SPIN_US (:data:`kvslim.poolspin.ENV_SPIN`) into the workers' spin; a bad value warns once and
    leaves the library's default (``kvslim bench`` and ``serve`` refuse it at start, :func:`kvslim.threads.prepare`)."""
    try:
        us = spin_from_env(os.environ)
    except ValueError as e:
        warnings.warn(f"kvslim: {e}; the workers spin {lib.kv_pool_spin(-1) // 1000} us", RuntimeWarning, stacklevel=4)
        return
    if us is not None:
        lib.kv_pool_spin(us * 1000)


def pool_spin_us(us: int | None = None) -> int | None:
    """How long the C kernels' workers spin for the next call before they sleep, in microseconds (loading the
    library): set to ``us`` where given (0: sleep at once). None where the kernels are unavailable. A process-wide
    setting, read by each worker when it starts to wait; no result depends on it."""
    lib = library()
    if lib is None or not hasattr(lib, "kv_pool_spin"):
        return None
    if us is not None:
        lib.kv_pool_spin(check_spin(us) * 1000)
    return lib.kv_pool_spin(-1) // 1000


def pool_balance(on: bool | None = None) -> bool | None:
    """Whether a call's work goes to whichever of the C kernels' threads are running (True, the default: a worker that
    has not joined a call by the time the caller took its last chunk is not waited for) or in fixed shares to every
    thread, each waited for (False: the rule before, to measure the two in one process). Set where ``on`` is given;
    None where the kernels are unavailable. No result depends on it."""
    lib = library()
    if lib is None or not hasattr(lib, "kv_pool_balance"):
        return None
    return bool(lib.kv_pool_balance(-1 if on is None else int(bool(on))))


def _pool_count(name: str) -> int | None:
    lib = library()
    return getattr(lib, name)() if lib is not None and hasattr(lib, name) else None


def pool_joins() -> int | None:
    """How many times one of the workers joined a call since the process started (None where the kernels are
    unavailable): with :func:`pool_balance` on, a call its caller finished alone is not joined."""
    return _pool_count("kv_pool_joins")


def pool_preempted() -> int | None:
    """How many times one of the workers found itself descheduled in its spin since the process started: each time
    the workers spin only 50 us for the next second (csrc/kvslim_linear.c, LIN_SPIN_SHARED_NS). None where the
    kernels are unavailable."""
    return _pool_count("kv_pool_preempted")


def pool_sleeps() -> int | None:
    """How many times one of the workers went to sleep after its spin since the process started (None where the
    kernels are unavailable): each is a call that will wait for a wake-up."""
    return _pool_count("kv_pool_sleeps")


def no_renew() -> None:
    """:func:`pool_renewer`'s function where there is nothing to renew."""
    return None


def pool_renewer():
    """A function of no arguments that restarts the spinning workers' spin (``kv_pool_renew``, one relaxed atomic add):
    for a caller about to run more Python than the spin before its next call. A no-op where the kernels are
    unavailable. No result depends on it."""
    lib = library()
    return lib.kv_pool_renew if lib is not None and hasattr(lib, "kv_pool_renew") else no_renew


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


_ON_RESET: list = []  # what callers resolved against the library (kernels.linear's probe): forgotten with it


def on_reset(forget) -> None:
    """Call ``forget()`` whenever :func:`_reset_for_tests` drops the library (a module's own memo of it)."""
    _ON_RESET.append(forget)


def _reset_for_tests() -> None:
    with _lock:
        _state.clear()
    for forget in _ON_RESET:
        forget()


def row_code(key) -> int | None:
    """C's row-format code for a format name or cast dtype (loading the library); None if it has none."""
    library()
    return _state.get("rows", {}).get(key)
