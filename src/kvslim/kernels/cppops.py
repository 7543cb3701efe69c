"""kvslim's torch custom ops in C++ (``csrc/kvslim_ops.cpp``): built on first use against the installed torch, loaded
with ``torch.ops.load_library``.

Two ops, for the compiled paged step (:mod:`kvslim.cache.paged_compiled`), which puts them in its graph where
:func:`ready` is True; Inductor's generated code then reaches the C kernels through torch's dispatcher alone, where
the Python ops cost each of a step's ~241 calls a trip into the interpreter:

- ``torch.ops.kvslim_cpp.linear(x, weight, bias)``: :class:`kvslim.kernels.linear.Prepared`'s call made in C++, the
  same checks and the same arguments to the same C function (so the same bits), torch's ``linear`` where that
  function does not take the call;
- ``torch.ops.kvslim_cpp.page_attend(q, k, v, handle, layer, scale)``: ``kvslim::page_attend``, whose Python lays out
  a step's argument tables at its first layer (:class:`kvslim.cache.pagecalls.StepCalls`) and hands them here
  (:func:`step`); each later layer makes the same C calls on them in C++ (the same bits), and any layer those tables
  do not serve goes to the Python op whole.

Build: ``$CXX`` (or the first of c++, g++, clang++ on PATH) compiles the file with torch's headers and links it
against torch's ``c10`` and ``torch_cpu`` (``-O2 -shared -fPIC``, ``-std=c++20`` else ``-std=c++17``, torch's
``_GLIBCXX_USE_CXX11_ABI``) into ``<cache>/kernels/ops-<hash>.so``, the hash covering the source, the flags, the
compiler's version and torch's version and location. The directory, its trust rules, the lock, the temporary file
renamed into place and the private fallback directory are the C library's (:mod:`.clib`). A build takes 10-20 s,
once per torch and compiler.

Any failure (no C++ compiler, torch without its headers, a compile error, ``$KVSLIM_CPP_OPS=0``) warns once
(except the last) and leaves :func:`ready` False: the Python op runs instead, with the same bits. A process loads the
library once (torch registers its ops for the life of the process).

The C functions' addresses come from the C library loaded by :mod:`.clib` (:func:`bind`): this library links against
torch only.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from ..atomic import remove_stale
from . import clib

SOURCE = clib.SOURCES / "kvslim_ops.cpp"
#: what kvslim_ops_abi() returns in a build this module can bind
ABI = 2
BASE_FLAGS = ["-O2", "-shared", "-fPIC"]
#: tried in order; the first the compiler accepts is used
STD_VARIANTS = [["-std=c++20"], ["-std=c++17"]]
#: ``$KVSLIM_CPP_OPS``: ``0`` (or ``off``, ``no``, ``false``) keeps the ops in Python
ENV = "KVSLIM_CPP_OPS"

_lock = threading.Lock()
_state: dict = {}  # "ok", "reason", "lib" (ctypes) once tried


def find_compiler() -> list[str] | None:
    """The C++ compiler command: $CXX (may carry flags) or the first of c++, g++, clang++ on PATH."""
    return clib.find_compiler("CXX", ("c++", "g++", "clang++"))


def _torch_dirs() -> tuple[Path, Path]:
    """torch's header and library directories (the installed wheel's)."""
    root = Path(torch.__file__).parent
    include, lib = root / "include", root / "lib"
    if not (include / "torch" / "library.h").is_file():
        raise RuntimeError(
            f"torch's C++ headers are not installed ({include / 'torch' / 'library.h'} is missing)"
        )
    return include, lib


def _flags(include: Path, lib: Path) -> tuple[list[str], list[str]]:
    """(compile flags, link flags: after the source)."""
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return (
        [*BASE_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}"],
        [f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"],
    )


def build() -> Path:
    """Compile the ops unless an up-to-date build is cached; returns its path. Raises RuntimeError with the
    compiler's first error line where no variant compiles."""
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install c++/g++/clang++)")
    include, lib = _torch_dirs()
    cflags, ldflags = _flags(include, lib)
    version = clib._compiler_version(compiler)
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(repr((compiler, version, cflags, ldflags, STD_VARIANTS, ABI, torch.__version__)).encode())
    key = "ops-" + h.hexdigest()[:24]
    out_dir = clib.build_dir()
    target = out_dir / f"{key}.so"
    with clib._dir_lock(out_dir):
        remove_stale(out_dir, ".ops-*", clib.STALE_S)  # temporaries of killed builds
        if clib._trusted_file(target):
            return target
        first = ""
        for std in STD_VARIANTS:
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".so", dir=out_dir)
            os.close(fd)
            try:
                res = subprocess.run(
                    [*compiler, *std, *cflags, "-o", tmp, str(SOURCE), *ldflags],
                    capture_output=True, text=True, timeout=600,
                )  # fmt: skip
                if res.returncode == 0:
                    os.chmod(tmp, 0o755)
                    os.replace(tmp, target)
                    return target
                first = first or clib._first_error(res.stderr)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    raise RuntimeError(f"{compiler[0]} failed to build kvslim's C++ ops: {first}")


def _asked_off() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("0", "off", "no", "false")


def _load() -> None:
    path = build()
    try:
        lib = ctypes.CDLL(str(path))
        if lib.kvslim_ops_abi() != ABI:
            raise RuntimeError(f"{path} has ABI {lib.kvslim_ops_abi()}, expected {ABI}")
        torch.ops.load_library(str(path))
    finally:
        if path.parent.name.startswith(clib.PRIVATE_PREFIX):  # loaded (mapped): the file is not needed
            shutil.rmtree(path.parent, ignore_errors=True)
    lib.kvslim_ops_bind.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.kvslim_ops_bind.restype = None
    lib.kvslim_ops_step.argtypes = [ctypes.c_int64, ctypes.c_void_p]
    lib.kvslim_ops_end.argtypes = [ctypes.c_int64]
    lib.kvslim_ops_end.restype = None
    torch.library.register_fake("kvslim_cpp::linear")(_linear_fake)
    torch.library.register_fake("kvslim_cpp::page_attend")(_attend_fake)
    _state["fields"] = lib.kvslim_ops_step_fields()
    _state.update(ok=True, lib=lib, reason=f"built at {path}")


def _linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _attend_fake(q, k, v, handle, layer, scale):
    return q.new_empty(q.shape, dtype=torch.float32)


def status() -> tuple[bool, str]:
    """(usable, why), building and loading the library on the first call; a failure warns once (not where
    ``$KVSLIM_CPP_OPS`` turned the ops off) and stays for the process."""
    if _asked_off():
        return False, f"${ENV} is {os.environ[ENV]!r}"
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                try:
                    _load()
                except Exception as e:  # any failure: warn once, the Python ops run
                    _state.update(ok=False, lib=None, reason=f"{type(e).__name__}: {e}")
                    warnings.warn(
                        f"kvslim: the C++ ops are unavailable, the compiled step calls its kernels through Python "
                        f"({_state['reason']})",
                        RuntimeWarning,
                        stacklevel=3,
                    )
    return _state["ok"], _state["reason"]


def ready() -> bool:
    """Whether ``torch.ops.kvslim_cpp`` is loaded here (building it on the first call)."""
    return status()[0]


def bind() -> None:
    """Point ``kvslim_cpp::linear`` at the C library's products for the dtypes whose product runs here
    (:func:`kvslim.kernels.linear.ready`), and at torch's linear for the others. Call it where that may have
    changed (a :class:`~kvslim.cache.paged_compiled.CompiledStep` does, when made)."""
    from . import linear

    if not status()[0]:
        return
    lib = clib.library()
    addresses = []
    for dtype, name in linear.ENTRIES.items():
        fn = getattr(lib, name, None) if lib is not None and linear.ready(dtype) else None
        addresses.append(ctypes.cast(fn, ctypes.c_void_p) if fn is not None else None)
    _state["lib"].kvslim_ops_bind(*addresses)


def step(handle: int, fields) -> None:
    """Hand ``kvslim_cpp::page_attend`` the step running under ``handle``: ``fields``, an int64 ``array.array``
    (:meth:`kvslim.cache.pagecalls.StepCalls.native` lays them out), read now; the addresses in them must stay valid
    until :func:`end`."""
    lib = _state["lib"]
    if len(fields) != _state["fields"]:
        raise RuntimeError(f"kvslim's C++ ops read {_state['fields']} fields a step, got {len(fields)}")
    lib.kvslim_ops_step(handle, fields.buffer_info()[0])


def end(handle: int) -> None:
    """The step under ``handle`` has ended: ``kvslim_cpp::page_attend`` forgets it (its later calls under the handle go
    to the Python op until the next :func:`step`)."""
    if _state.get("lib") is not None:
        _state["lib"].kvslim_ops_end(handle)
